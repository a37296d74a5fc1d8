"""The ClientApp: unpack a message, call the algorithm's client, pack the reply.

Message types (``fedpers.protocol``): ``train`` and ``evaluate`` as in Flower, plus
``query.info`` (partition id and data sizes, used by the server to map nodes to
partitions), ``query.initial`` (the seeded initial shared arrays),
``query.moments`` (linear FedRep's Method-of-Moments statistic) and FedGMM's
initialization: ``query.pca``, ``query.summary``, ``query.assign``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    MetricRecordValues,
    RecordDict,
)
from flwr.clientapp import ClientApp

from clients import client_class, device_state, faults
from fedpers import protocol
from fedpers.config import RunConfig
from fedpers.data.client import client_data, generated_sizes

app = ClientApp()


def _partition(context: Context) -> int:
    if "partition-id" not in context.node_config:
        raise KeyError(
            "node config lacks 'partition-id': start the SuperNode with "
            '--node-config "partition-id=<i> num-partitions=<n>"'
        )
    return int(context.node_config["partition-id"])


def _client(context: Context, msg: Message | None = None) -> Any:
    """This node's client of the run's algorithm (``clients.client_class``), with its
    state restored from the device if the node is fresh (``clients.device_state``)."""
    run = RunConfig.from_mapping(context.run_config)
    if msg is not None and protocol.ROUND in _config(msg):
        server_round = int(_config(msg)[protocol.ROUND])  # type: ignore[arg-type]
        # Training in round r starts from the state after round r - 1; evaluating in
        # round r sees the state trained in round r.
        evaluating = msg.metadata.message_type.startswith("evaluate")
        device_state.restore(context, before_round=server_round + (1 if evaluating else 0))
    return client_class(run)(run, _partition(context), context.state)


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
    client = _client(context, msg)
    faults.before_fit(context, _config(msg))
    arrays, metrics = client.fit(_arrays(msg), _config(msg))
    arrays, metrics = faults.after_fit(context, _config(msg), arrays, metrics)
    device_state.count_round(context)
    device_state.persist(context, server_round=int(_config(msg)[protocol.ROUND]))  # type: ignore[arg-type]
    return _reply(msg, arrays, metrics)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Test metrics with the server's shared arrays and this node's personal parts."""
    return _reply(msg, None, _client(context, msg).evaluate(_arrays(msg), _config(msg)))


@app.query("info")
def info(msg: Message, context: Context) -> Message:
    """Which partition this node holds, and how many samples."""
    run = RunConfig.from_mapping(context.run_config)
    partition = _partition(context)
    if run.is_linear:
        num_train, num_test = run.linear_samples, 0
    elif run.partitioner == "generated":  # known without generating anything
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


@app.query("initial")
def initial(msg: Message, context: Context) -> Message:
    """The seeded initial values of the shared model parts."""
    return _reply(msg, _client(context).initial_arrays(), {})


@app.query("pca")
def pca(msg: Message, context: Context) -> Message:
    """FedGMM: moment statistics of this node's embedding inputs (pooled PCA)."""
    return _reply(msg, _client(context).pca_moments(), {})


@app.query("summary")
def summary(msg: Message, context: Context) -> Message:
    """FedGMM: local k-means centroids of the embeddings (federated k-means++)."""
    return _reply(msg, _client(context).summary(_arrays(msg)), {})


@app.query("assign")
def assign(msg: Message, context: Context) -> Message:
    """FedGMM: statistics of the embeddings assigned to the nearest initial mean."""
    return _reply(msg, _client(context).assignment_statistics(_arrays(msg)), {})


@app.query("pilots")
def pilots(msg: Message, context: Context) -> Message:
    """Sheaf-FRL: refit the whitening on the pilots, send the whitened pilot latents."""
    return _reply(msg, _client(context).pilots_message(_config(msg)), {})


@app.query("maps")
def maps(msg: Message, context: Context) -> Message:
    """Sheaf-FRL (homogeneous): compute owned edges' maps, send transported pilots."""
    return _reply(msg, _client(context).maps_message(_arrays(msg)), {})


@app.query("transport")
def transport(msg: Message, context: Context) -> Message:
    """Sheaf-FRL (private): own pilots transported into each neighbour's frame."""
    neighbours = [int(n) for n in _config(msg).get("neighbours", []) if int(n) >= 0]  # type: ignore[union-attr]
    return _reply(msg, _client(context).transport_message(neighbours), {})


@app.query("latents")
def latents(msg: Message, context: Context) -> Message:
    """Sheaf-FRL: whitened pilots and test latents for communication accuracy."""
    return _reply(msg, _client(context).latents_message(_config(msg)), {})


@app.query("moments")
def moments(msg: Message, context: Context) -> Message:
    """Linear FedRep's Method-of-Moments statistic."""
    client = _client(context)
    return _reply(msg, client.moments(), {protocol.NUM_EXAMPLES: float(client.run.linear_samples)})
