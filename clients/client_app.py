"""The ClientApp: unpack a message, call the algorithm's client, pack the reply.

Each handler reads the run configuration once (typed, validated), builds this node's
client from the algorithm table's row (``fedpers.algorithms``), and calls it. Message
types (``fedpers.protocol``): ``train`` and ``evaluate`` as in Flower, plus the
queries of ``protocol.Query``: ``info`` (partition id and data sizes, which the server
uses to map nodes to partitions), ``initial`` (the seeded initial shared arrays),
``moments`` (linear FedRep's Method-of-Moments statistic), FedGMM's initialization
(``pca``, ``summary``, ``assign``) and Sheaf-FRL's relay (``pilots``, ``maps``,
``transport``, ``latents``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from fedpers.clients import device_state, faults
from fedpers.clients.common import (
    Client,
    MixtureInitializer,
    MomentsSource,
    PilotAgent,
    SeedsModel,
)
from fedpers.clients.linear import TEST_SAMPLES as LINEAR_TEST_SAMPLES
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    MetricRecordValues,
    RecordDict,
)
from flwr.clientapp import ClientApp

from fedpers import protocol
from fedpers.config import Partitioner, RunConfig
from fedpers.data.client import client_data, generated_sizes
from fedpers.protocol import Query

app = ClientApp()


def _partition(context: Context) -> int:
    if protocol.NODE_PARTITION_ID not in context.node_config:
        raise KeyError(
            "node config lacks 'partition-id': start the SuperNode with "
            '--node-config "partition-id=<i> num-partitions=<n>"'
        )
    return int(context.node_config[protocol.NODE_PARTITION_ID])


def _run(context: Context) -> RunConfig:
    """The run configuration, parsed once per distinct configuration in this process.

    A simulated ClientApp actor serves thousands of messages of the same run, each with
    its own copy of the run config; parsing it costs 0.8 ms and a lookup microseconds.
    ``RunConfig`` is frozen, so the parsed object can be shared.
    """
    return _parsed(tuple(sorted(context.run_config.items())))


@functools.lru_cache(maxsize=8)
def _parsed(items: tuple[tuple[str, Any], ...]) -> RunConfig:
    return RunConfig.from_mapping(dict(items))


def _client(run: RunConfig, context: Context, msg: Message | None = None) -> Client:
    """This node's client of the run's algorithm (its row's client class), with its
    state restored from the device if the node is fresh (``clients.device_state``)."""
    if msg is not None and protocol.ROUND in _config(msg):
        server_round = int(_config(msg)[protocol.ROUND])  # type: ignore[arg-type]
        # Training in round r starts from the state after round r - 1; evaluating in
        # round r sees the state trained in round r.
        evaluating = msg.metadata.message_type == MessageType.EVALUATE
        token = str(_config(msg).get(protocol.RUN_TOKEN, ""))
        before = server_round + (1 if evaluating else 0)
        device_state.restore(run, context, before_round=before, token=token)
    cls = run.spec.client_class(linear=run.is_linear)
    client: Client = cls(run, _partition(context), context.state)
    return client


def _incapable(client: Client, capability: str, query: Query) -> TypeError:
    return TypeError(
        f"{type(client).__name__} cannot answer query.{query.value}: it does not "
        f"implement {capability} (clients.common)"
    )


def _seeds_model(run: RunConfig, context: Context, query: Query) -> SeedsModel:
    client = _client(run, context)
    if not isinstance(client, SeedsModel):
        raise _incapable(client, "SeedsModel", query)
    return client


def _mixture(run: RunConfig, context: Context, query: Query) -> MixtureInitializer:
    client = _client(run, context)
    if not isinstance(client, MixtureInitializer):
        raise _incapable(client, "MixtureInitializer", query)
    return client


def _agent(run: RunConfig, context: Context, query: Query) -> PilotAgent:
    client = _client(run, context)
    if not isinstance(client, PilotAgent):
        raise _incapable(client, "PilotAgent", query)
    return client


def _startup(
    run: RunConfig, context: Context, arrays: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """A start-up answer, as the run's fault injection leaves it (tests only)."""
    return faults.startup(run, _partition(context), arrays)


def _relayed(
    run: RunConfig, context: Context, msg: Message, arrays: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Pilots to relay, as the run's fault injection leaves them (tests only)."""
    return faults.relay(run, _partition(context), _config(msg), arrays)


def _arrays(msg: Message) -> dict[str, np.ndarray]:
    if protocol.ARRAYS not in msg.content.array_records:
        return {}
    return {
        name: array.numpy() for name, array in msg.content.array_records[protocol.ARRAYS].items()
    }


def _config(msg: Message) -> ConfigRecord:
    if protocol.CONFIG in msg.content.config_records:
        return msg.content.config_records[protocol.CONFIG]
    return ConfigRecord()


def _reply(
    msg: Message, arrays: dict[str, np.ndarray] | None, metrics: dict[str, float]
) -> Message:
    values: dict[str, MetricRecordValues] = dict(metrics)
    content = RecordDict({protocol.METRICS: MetricRecord(values)})
    if arrays is not None:
        content[protocol.ARRAYS] = ArrayRecord(
            {name: Array(np.ascontiguousarray(a)) for name, a in arrays.items()}
        )
    return Message(content=content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local training."""
    run = _run(context)
    config = _config(msg)
    client = _client(run, context, msg)
    partition = _partition(context)
    faults.before_fit(run, partition, config)
    received = _arrays(msg)
    arrays, metrics = client.fit(dict(received), config)
    arrays, metrics = faults.after_fit(run, partition, config, received, arrays, metrics)
    device_state.count_round(context)
    device_state.persist(
        run,
        context,
        server_round=int(config[protocol.ROUND]),  # type: ignore[arg-type]
        token=str(config.get(protocol.RUN_TOKEN, "")),
    )
    return faults.on_wire(run, partition, config, _reply(msg, arrays, metrics))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Test metrics with the server's shared arrays and this node's personal parts."""
    client = _client(_run(context), context, msg)
    return _reply(msg, None, client.evaluate(_arrays(msg), _config(msg)))


@app.query(Query.INFO)
def info(msg: Message, context: Context) -> Message:
    """Which partition this node holds, and how many samples."""
    run = _run(context)
    partition = _partition(context)
    if run.is_linear:  # fresh samples for every round and every test: nothing stored
        num_train, num_test = run.linear_samples, LINEAR_TEST_SAMPLES
    elif run.partitioner == Partitioner.GENERATED:  # known without generating anything
        num_train, num_test = generated_sizes(run)
    else:  # the data alone: no model, no torch, for a message every node answers
        data = client_data(run, partition)
        num_train, num_test = len(data.y_train), len(data.y_test)
    return _reply(
        msg,
        None,
        {
            protocol.PARTITION_ID: float(partition),
            protocol.NUM_TRAIN: float(num_train),
            protocol.NUM_TEST: float(num_test),
        },
    )


@app.query(Query.INITIAL)
def initial(msg: Message, context: Context) -> Message:
    """The seeded initial values of the shared model parts."""
    run = _run(context)
    client = _seeds_model(run, context, Query.INITIAL)
    return _reply(msg, _startup(run, context, client.initial_arrays()), {})


@app.query(Query.PCA)
def pca(msg: Message, context: Context) -> Message:
    """FedGMM: moment statistics of this node's embedding inputs (pooled PCA)."""
    run = _run(context)
    client = _mixture(run, context, Query.PCA)
    return _reply(msg, _startup(run, context, client.pca_moments()), {})


@app.query(Query.SUMMARY)
def summary(msg: Message, context: Context) -> Message:
    """FedGMM: local k-means centroids of the embeddings (federated k-means++)."""
    run = _run(context)
    client = _mixture(run, context, Query.SUMMARY)
    return _reply(msg, _startup(run, context, client.summary(_arrays(msg))), {})


@app.query(Query.ASSIGN)
def assign(msg: Message, context: Context) -> Message:
    """FedGMM: statistics of the embeddings assigned to the nearest initial mean."""
    run = _run(context)
    client = _mixture(run, context, Query.ASSIGN)
    return _reply(msg, _startup(run, context, client.assignment_statistics(_arrays(msg))), {})


@app.query(Query.PILOTS)
def pilots(msg: Message, context: Context) -> Message:
    """Sheaf-FRL: refit the whitening on the pilots, send the whitened pilot latents."""
    run = _run(context)
    client = _agent(run, context, Query.PILOTS)
    return _reply(msg, _relayed(run, context, msg, client.pilots_message(_config(msg))), {})


@app.query(Query.MAPS)
def maps(msg: Message, context: Context) -> Message:
    """Sheaf-FRL (homogeneous): compute owned edges' maps, send transported pilots."""
    run = _run(context)
    client = _agent(run, context, Query.MAPS)
    return _reply(msg, _relayed(run, context, msg, client.maps_message(_arrays(msg))), {})


@app.query(Query.TRANSPORT)
def transport(msg: Message, context: Context) -> Message:
    """Sheaf-FRL (private): own pilots transported into each neighbour's frame."""
    run = _run(context)
    client = _agent(run, context, Query.TRANSPORT)
    neighbours = [int(n) for n in _arrays(msg).get(protocol.NEIGHBOURS, np.zeros(0))]
    return _reply(msg, _relayed(run, context, msg, client.transport_message(neighbours)), {})


@app.query(Query.LATENTS)
def latents(msg: Message, context: Context) -> Message:
    """Sheaf-FRL: whitened pilots and test latents for communication accuracy."""
    run = _run(context)
    client = _agent(run, context, Query.LATENTS)
    return _reply(msg, client.latents_message(_config(msg)), {})


@app.query(Query.MOMENTS)
def moments(msg: Message, context: Context) -> Message:
    """Linear FedRep's Method-of-Moments statistic."""
    run = _run(context)
    client = _client(run, context)
    if not isinstance(client, MomentsSource):
        raise _incapable(client, "MomentsSource", Query.MOMENTS)
    moments = _startup(run, context, client.moments())
    return _reply(msg, moments, {protocol.NUM_EXAMPLES: float(run.linear_samples)})
