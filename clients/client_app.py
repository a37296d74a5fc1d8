"""The ClientApp: unpack a message, call the algorithm's local update, pack the reply.

Each handler reads the run configuration once (typed, validated) and calls the row's
local update (``fedpers.algorithms``), written for a cohort of clients: here a cohort of
one, this node. ``train_cohort`` and ``evaluate_cohort`` are the same handlers for many
nodes' messages at once, which a batched simulation engine calls
(``fedpers.simulations.batched``); what they do for each message (its device state, its
fault injection, its privacy mechanism, its reply) is what a device does. Message
types (``fedpers.protocol``): ``train`` and ``evaluate`` as in Flower, the queries
every family answers (``protocol.Query``: ``info``, the partition id and data sizes
that the server maps nodes by, ``initial``, the seeded initial shared arrays, and
``snapshot``, a resumed run's restore of the node's state), and
each registered family's own queries (``fedpers.families``, ``FamilySpec.queries``),
registered below from the registry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
from fedpers.cohort import Cohort, Member, Reply
from fedpers.config import Partitioner, RunConfig
from fedpers.data.client import adaptation_test_size, client_data, generated_sizes
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


def _restore(run: RunConfig, context: Context, msg: Message, config: ConfigRecord) -> None:
    """The node's state restored from the device if the node is fresh
    (``clients.device_state``): training in round r starts from the state after round
    r - 1; evaluating in round r sees the state trained in round r. ``config`` is the
    message's (``_config``)."""
    if protocol.ROUND in config:
        server_round = records.integer(config[protocol.ROUND], protocol.ROUND)
        evaluating = msg.metadata.message_type == MessageType.EVALUATE
        token = str(config.get(protocol.RUN_TOKEN, ""))
        before = server_round + (1 if evaluating else 0)
        device_state.restore(run, context, before_round=before, token=token)


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


def _arrays(msg: Message, decoded: dict[int, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The message's arrays, decoded (read-only); ``decoded`` shares the decoding of an
    ``Array`` that several messages of a cohort hold (the round's shared arrays)."""
    found = msg.content.array_records
    if protocol.ARRAYS not in found:
        return {}
    arrays = {}
    for name, array in found[protocol.ARRAYS].items():
        if decoded is None or id(array) not in decoded:
            values = records.values(array)
            values.flags.writeable = False
            if decoded is not None:
                decoded[id(array)] = values
        arrays[name] = decoded[id(array)] if decoded is not None else values
    return arrays


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
            {name: Array(records.contiguous(a)) for name, a in arrays.items()}
        )
    return Message(content=content, reply_to=msg)


@dataclass
class _Work:
    """One message of a cohort, unpacked: where its reply goes."""

    index: int
    msg: Message
    context: Context
    run: RunConfig
    config: ConfigRecord
    member: Member


def _unpack(pairs: Sequence[tuple[Message, Context]], results: list[Any]) -> list[_Work]:
    """Each message's run, settings and member, with its node's state restored; a
    message that fails here gets its exception as its result."""
    work = []
    decoded: dict[int, np.ndarray] = {}  # one decoding of an Array that many messages hold
    for index, (msg, context) in enumerate(pairs):
        try:
            run = _run(context)
            config = _config(msg)
            _restore(run, context, msg, config)
            member = Member(_partition(context), context.state, _arrays(msg, decoded))
            work.append(_Work(index, msg, context, run, config, member))
        except Exception as error:  # one message's defect is its own reply
            results[index] = error
    return work


def _groups(work: list[_Work]) -> list[list[_Work]]:
    """The messages that one update can take together: the same run and settings."""
    groups: dict[tuple[Any, ...], list[_Work]] = {}
    for item in work:
        key = (id(item.run), tuple(sorted((k, repr(v)) for k, v in item.config.items())))
        groups.setdefault(key, []).append(item)
    return list(groups.values())


def _cohort_call(
    name: str, group: list[_Work], results: list[Any], threads: int | None, dtype: str | None
) -> list[tuple[_Work, Any]]:
    """The row's update function ``name`` on the group as one cohort; if it raises for
    a cohort of several, each message alone, so that one client's defect is its own."""
    run = group[0].run
    cohort = Cohort(run, group[0].config, [w.member for w in group], threads, dtype)
    try:
        return list(zip(group, _update(run, name, cohort), strict=True))
    except Exception as error:
        if len(group) == 1:
            results[group[0].index] = error
            return []
    done = []
    for item in group:
        try:
            alone = cohort.with_members([item.member])
            done.append((item, _update(run, name, alone)[0]))
        except Exception as error:
            results[item.index] = error
    return done


def _update(run: RunConfig, name: str, cohort: Cohort) -> Any:
    """The row's update function ``name`` (``fit``, ``evaluate``, a query's answer:
    one result per member; ``initial_arrays``: the arrays) on ``cohort``.

    Raises
    ------
    TypeError
        Naming the function, if neither the row's module nor its family's defines it.
    """
    function = run.spec.update_function(name, run.family)
    if function is None:
        raise TypeError(
            f"algorithm '{run.algorithm}' has no local update function '{name}': neither "
            f"its module ({run.spec.update}) nor its family's defines one"
        )
    return function(cohort)


def train_cohort(
    pairs: Sequence[tuple[Message, Context]],
    *,
    threads: int | None = None,
    dtype: str | None = None,
) -> list[Message | BaseException]:
    """TRAIN messages of several nodes, one cohort per run and settings: each reply, or
    the exception its message ended with, in order. Per message, what a device does:
    its state restored, its faults injected, under ``dp = "distributed"`` its update
    clipped and noised, its state counted and persisted."""
    results: list[Any] = [None] * len(pairs)
    for group in _groups(_unpack(pairs, results)):
        for item in group:
            try:
                floor = item.context.node_config.get(protocol.NODE_DP_MIN_NOISE)
                privacy.device_floor(item.run, floor)
                faults.before_fit(item.run, item.member.partition, item.config)
            except Exception as error:
                results[item.index] = error
        ready = [item for item in group if results[item.index] is None]
        if not ready:
            continue
        fallback = ready[0].run.client_threads if threads is None else None
        for item, reply in _cohort_call("fit", ready, results, threads or fallback, dtype):
            try:
                results[item.index] = _finish_fit(item, reply)
            except Exception as error:
                results[item.index] = error
    return results


def _finish_fit(item: _Work, reply: Reply) -> Message:
    run, config, partition = item.run, item.config, item.member.partition
    received = item.member.arrays
    arrays, metrics = reply
    # Only a distributed run's device needs the mechanism: building it may calibrate the
    # noise (seconds of accounting), which a central run's devices must not pay per message.
    if run.group(privacy.PrivacySettings).dp is privacy.DpMode.DISTRIBUTED and received:
        mechanism = privacy.run_mechanism(run)
        assert mechanism is not None  # dp is not "none"
        clip, std = faults.device_privacy(
            run, partition, config, mechanism.clip, mechanism.share_std
        )
        arrays = privacy.private_update(received, arrays, clip, std, privacy.secret_generator())
    arrays, metrics = faults.after_fit(run, partition, config, received, arrays, metrics)
    device_state.count_round(item.context)
    device_state.persist(
        run,
        item.context,
        server_round=records.integer(config[protocol.ROUND], protocol.ROUND),
        token=str(config.get(protocol.RUN_TOKEN, "")),
    )
    return faults.on_wire(run, partition, config, _reply(item.msg, arrays, metrics))


def evaluate_cohort(
    pairs: Sequence[tuple[Message, Context]],
    *,
    threads: int | None = None,
    dtype: str | None = None,
) -> list[Message | BaseException]:
    """EVALUATE messages of several nodes, as ``train_cohort``: each node's test
    figures with the server's arrays and its own state."""
    results: list[Any] = [None] * len(pairs)
    for group in _groups(_unpack(pairs, results)):
        fallback = group[0].run.client_threads if threads is None else None
        for item, metrics in _cohort_call("evaluate", group, results, threads or fallback, dtype):
            results[item.index] = _reply(item.msg, None, metrics)
    return results


def _one(results: list[Message | BaseException]) -> Message:
    """The reply of a cohort of one; an exception is raised, as a handler's is."""
    if isinstance(results[0], BaseException):
        raise results[0]
    return results[0]


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local training (a cohort of one); under ``dp = "distributed"`` the
    update of the shared parts leaves the device clipped and noised
    (``fedpers.privacy``)."""
    return _one(train_cohort([(msg, context)]))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Test metrics with the server's shared arrays and this node's personal parts."""
    return _one(evaluate_cohort([(msg, context)]))


@app.query(Query.INFO)
def info(msg: Message, context: Context) -> Message:
    """Which partition this node holds, and how many samples (an unseen client's test
    size: what it is tested on after adapting, ``adaptation_test_size``)."""
    run = _run(context)
    partition = _partition(context)
    if run.family.sample_counts is not None:  # fresh samples every round: nothing stored
        num_train, num_test = run.family.sample_counts(run)
    elif partition >= run.seen_clients:  # unseen (unseen-fraction): its adaptation split
        data = client_data(run, partition)
        num_train, num_test = len(data.y_train), adaptation_test_size(data, run.adapt_fraction)
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
    member = Member(_partition(context), context.state)
    arrays = _update(run, "initial_arrays", Cohort(run, _config(msg), [member]))
    arrays = _startup(run, context, arrays)
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
    """The ClientApp handler of a family's query: the row's update function
    ``query.function`` answers it for this node, through the query's fault injection."""

    def handle(msg: Message, context: Context) -> Message:
        run = _run(context)
        member = Member(_partition(context), context.state, _arrays(msg))
        cohort = Cohort(run, _config(msg), [member], run.client_threads)
        arrays, metrics = _update(run, query.function, cohort)[0]
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
