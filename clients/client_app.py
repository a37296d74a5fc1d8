"""The ClientApp: unpack a message, call the algorithm's client, pack the reply.

Each handler reads the run configuration once (typed, validated), builds this node's
client from the algorithm table's row (``fedpers.algorithms``), and calls it. Message
types (``fedpers.protocol``): ``train`` and ``evaluate`` as in Flower, the queries
every family answers (``protocol.Query``: ``info``, the partition id and data sizes
that the server maps nodes by, ``initial``, the seeded initial shared arrays, and
``snapshot``, a resumed run's restore of the node's state), and
each registered family's own queries (``fedpers.families``, ``FamilySpec.queries``),
registered below from the registry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
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

from fedpers import algorithms, families, privacy, protocol, records
from fedpers.clients import device_state, faults
from fedpers.clients.common import Client, SeedsModel
from fedpers.config import Partitioner, RunConfig
from fedpers.data.client import client_data, generated_sizes
from fedpers.families import Faults, QuerySpec
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
        server_round = records.integer(_config(msg)[protocol.ROUND], protocol.ROUND)
        # Training in round r starts from the state after round r - 1; evaluating in
        # round r sees the state trained in round r.
        evaluating = msg.metadata.message_type == MessageType.EVALUATE
        token = str(_config(msg).get(protocol.RUN_TOKEN, ""))
        before = server_round + (1 if evaluating else 0)
        device_state.restore(run, context, before_round=before, token=token)
    cls = run.spec.client_class(family=run.family.name)
    client: Client = cls(run, _partition(context), context.state)
    return client


def _capable(client: Client, capability: type, query: str) -> Any:
    """``client``, if it implements ``capability``; else a clear error."""
    if not isinstance(client, capability):
        raise TypeError(
            f"{type(client).__name__} cannot answer query.{query}: it does not "
            f"implement {capability.__name__} ({capability.__module__})"
        )
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
        name: records.values(array)
        for name, array in msg.content.array_records[protocol.ARRAYS].items()
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
    """One round of local training; under ``dp = "distributed"`` the update of the
    shared parts leaves the device clipped and noised (``fedpers.privacy``)."""
    run = _run(context)
    config = _config(msg)
    client = _client(run, context, msg)
    partition = _partition(context)
    faults.before_fit(run, partition, config)
    received = _arrays(msg)
    arrays, metrics = client.fit(dict(received), config)
    # Only a distributed run's device needs the mechanism: building it may calibrate the
    # noise (seconds of accounting), which a central run's devices must not pay per message.
    if run.group(privacy.PrivacySettings).dp is privacy.DpMode.DISTRIBUTED and received:
        mechanism = privacy.run_mechanism(run)
        assert mechanism is not None  # dp is not "none"
        arrays = privacy.private_update(received, arrays, mechanism, privacy.secret_generator())
    arrays, metrics = faults.after_fit(run, partition, config, received, arrays, metrics)
    device_state.count_round(context)
    device_state.persist(
        run,
        context,
        server_round=records.integer(config[protocol.ROUND], protocol.ROUND),
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
    if run.family.sample_counts is not None:  # fresh samples every round: nothing stored
        num_train, num_test = run.family.sample_counts(run)
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
    """The seeded initial values of the shared model parts, or (config ``digest`` = 1)
    their SHA-256 (``protocol.arrays_digest``), which the server's vote counts."""
    run = _run(context)
    client: SeedsModel = _capable(_client(run, context), SeedsModel, Query.INITIAL)
    arrays = _startup(run, context, client.initial_arrays())
    if records.config_int(_config(msg), protocol.DIGEST, default=0):
        arrays = {protocol.DIGEST: protocol.arrays_digest(arrays)}
    return _reply(msg, arrays, {})


@app.query(Query.SNAPSHOT)
def snapshot(msg: Message, context: Context) -> Message:
    """A resumed run's first question to a node: restore its state from its newest
    snapshot up to the checkpoint's round, and say which round that was (0: none; -1:
    the node already held state, of an unknown round)."""
    run = _run(context)
    config = _config(msg)
    if len(context.state) > 0:
        return _reply(msg, None, {protocol.SNAPSHOT_ROUND: -1.0})
    restored = device_state.restore(
        run,
        context,
        before_round=records.config_int(config, protocol.ROUND) + 1,
        token=str(config.get(protocol.RUN_TOKEN, "")),
    )
    return _reply(msg, None, {protocol.SNAPSHOT_ROUND: float(restored)})


def family_handler(query: QuerySpec) -> Callable[[Message, Context], Message]:
    """The ClientApp handler of a family's query: this node's client answers it (if it
    implements the query's capability), through the query's fault injection."""

    def handle(msg: Message, context: Context) -> Message:
        run = _run(context)
        client = _capable(_client(run, context), query.capability, query.name)
        arrays, metrics = query.answer(client, run, _arrays(msg), _config(msg))
        if query.faults is Faults.STARTUP:
            arrays = _startup(run, context, arrays)
        elif query.faults is Faults.RELAY:
            arrays = _relayed(run, context, msg, arrays)
        return _reply(msg, arrays, metrics)

    handle.__name__ = handle.__qualname__ = f"query_{query.name}"
    handle.__doc__ = query.doc
    return handle


algorithms.load_extensions()  # families that installed packages register
for _family in families.all_families():
    for _query in _family.queries:
        app.query(_query.name)(family_handler(_query))
