"""Property-based fuzzing of what one client sends (hypothesis): replies generated from
the record grammar (any records, names, kinds, shapes, dtypes, values, metric keys) in
place of one node's training or evaluation reply, for every family, through the
round loop's own steps (``train_step``, ``evaluate_step``) on real ClientApps in
process. For any reply, the properties the docs state (docs/architecture.md, "What
the server guarantees"):

- no exception escapes the step;
- the adopted state is well formed (the model's arrays, finite, and what the
  strategy's ``state_defect`` demands);
- the reply's influence is within the stated bounds: its weight at most
  ``Federation.weight_bounds``, every adopted value at most ``screening.HUGE`` times
  the largest value sent (at least 1), evaluation metrics in their ranges;
- what is rejected is recorded with a reason naming the partition.

A fixed budget and seed keep it fast in make test; ``FEDPERS_FUZZ_EXAMPLES`` raises the
budget (simulations.robustness runs the long profile)."""

from __future__ import annotations

import contextlib
import math
import os
from functools import cache
from typing import Any

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fedpers import protocol, records
from fedpers.clients.client_app import app as client_app
from fedpers.config import RunConfig
from fedpers.strategies import build_strategy, screening
from fedpers.strategies.base import FedpersStrategy
from fedpers.strategies.rounds import evaluate_step, train_step, well_formed
from tests.helpers import InProcessGrid, run_config

NODES = 4
ATTACKER = 1
EXAMPLES = int(os.environ.get("FEDPERS_FUZZ_EXAMPLES", "25"))
FAMILIES: dict[str, dict[str, Any]] = {
    "fedavg": {"algorithm": "fedavg", "dataset": "digits"},
    "fedrep": {"algorithm": "fedrep", "dataset": "digits"},
    "fedgmm": {"algorithm": "fedgmm", "dataset": "mixture", "samples_per_client": 60},
    "sheaf-frl": {"algorithm": "sheaf-frl", "dataset": "digits"},
}
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Federation:
    """One family's federation, set up once: the strategy after start-up, the round's
    messages, and each honest node's reply to them, replayed as fresh copies."""

    def __init__(self, family: str) -> None:
        self.values = run_config(
            **FAMILIES[family], num_clients=NODES, fraction_train=1.0, num_rounds=1
        )
        self.crafted: dict[str, RecordDict] = {}
        self.honest: dict[tuple[int, str], RecordDict] = {}
        self.grid = InProcessGrid(self._app, self.values, NODES)
        self.strategy: FedpersStrategy = build_strategy(RunConfig.from_mapping(self.values))
        self.strategy.federation.connect(self.grid, timeout=5)
        self.initial = self.strategy.initial_arrays(self.grid, timeout=5)
        self.aggregated: list[Message] = []  # what the last aggregate_train got
        aggregate = self.strategy.aggregate_train

        def recording(server_round: int, replies: Any) -> Any:
            self.aggregated = list(replies)
            return aggregate(server_round, self.aggregated)

        self.strategy.aggregate_train = recording  # type: ignore[method-assign]

    def bound(self, *, test: bool) -> float:
        """The weight bound the docs state, computed here: what the node registered, at
        most weight-cap x the lower median of what all registered."""
        federation = self.strategy.federation
        sizes = federation.test_sizes if test else federation.train_sizes
        lower_median = max(1.0, float(sorted(sizes.values())[(len(sizes) - 1) // 2]))
        cap = RunConfig.from_mapping(self.values).weight_cap
        return min(float(sizes[ATTACKER]), cap * lower_median)

    def template(self, kind: str) -> RecordDict:
        """The attacker's own honest reply of the round (one honest step first)."""
        self.crafted.pop(kind, None)
        step = train_step if kind == MessageType.TRAIN else evaluate_step
        config = (
            self.strategy.train_config()
            if kind == MessageType.TRAIN
            else self.strategy.evaluate_config()
        )
        step(self.strategy, self.grid, self.strategy.federation, 1, self.initial, config, 5)
        return self.honest[(ATTACKER, kind)]

    def _app(self, message: Message, context: Context) -> Message:
        kind = message.metadata.message_type
        partition = int(context.node_config["partition-id"])
        if partition == ATTACKER and kind in self.crafted:
            return Message(self.crafted[kind], reply_to=message)
        if kind not in (MessageType.TRAIN, MessageType.EVALUATE):
            return client_app(message, context)
        if (partition, kind) not in self.honest:  # the honest nodes answer once
            self.honest[(partition, kind)] = client_app(message, context).content
        return Message(_copy(self.honest[(partition, kind)]), reply_to=message)


def _copy(content: RecordDict) -> RecordDict:
    """A fresh copy of a reply's content: the server may change a reply it keeps (a
    capped weight)."""
    copy = RecordDict()
    for name, record in content.array_records.items():
        copy[name] = ArrayRecord({k: Array(a.numpy().copy()) for k, a in record.items()})
    for name, metrics in content.metric_records.items():
        copy[name] = MetricRecord(dict(metrics))
    return copy


@cache
def federation(family: str) -> Federation:
    return Federation(family)


# ------------------------------------------------------------------ the grammar
# A reply is an honest reply of the round, changed by a few edits drawn from the record
# grammar: records added (before or after the others), renamed or of another kind;
# arrays added, dropped, renamed, reshaped, retyped or refilled; metrics added,
# dropped or set to any value; the claimed weight scaled. Most edits keep the rest well
# formed, so that each reaches the checks after the first.
PROTOCOL_NAMES = [protocol.ARRAYS, protocol.METRICS, protocol.CONFIG]
NAMES = st.one_of(st.sampled_from(PROTOCOL_NAMES * 3), st.text(max_size=12))
DTYPES = st.sampled_from(["float32", "float64", "int64", "uint8", "bool", "complex64"])
SPECIAL = st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e300, -1e300, 1e6, 1e12, math.nan, math.inf])
NUMBERS = st.one_of(
    SPECIAL,
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.booleans(),
)
METRIC_VALUES = st.one_of(NUMBERS, st.lists(st.floats(), max_size=3), st.text(max_size=5))
KEYS = [protocol.NUM_EXAMPLES, protocol.LOSS, protocol.ACCURACY, "edge.1", "edge.²", "gamma"]
METRIC_KEYS = st.one_of(st.sampled_from(KEYS * 2), st.text(max_size=20))


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.inf


@st.composite
def _values(draw: st.DrawFn, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Any values of ``shape``: drawn one by one when few, else a special number, noise
    and a few drawn entries."""
    size = int(np.prod(shape))
    if size <= 16:
        values = np.array(draw(st.lists(NUMBERS.map(_as_float), min_size=size, max_size=size)))
    else:
        base = draw(SPECIAL)
        values = np.full(size, base) + np.random.default_rng(size).normal(size=size)
        for index in draw(st.lists(st.integers(0, size - 1), max_size=3)):
            values[index] = draw(NUMBERS.map(_as_float))
    with np.errstate(all="ignore"):
        return values.reshape(shape).astype(dtype)


def _records(content: RecordDict) -> list[tuple[str, Any]]:
    return list(content.items())


def _rebuilt(items: list[tuple[str, Any]]) -> RecordDict:
    content = RecordDict()
    for name, record in items:
        content[name] = record
    return content


@st.composite
def _edit(draw: st.DrawFn, content: RecordDict) -> RecordDict:
    items = _records(content)
    arrays = content.array_records.get(protocol.ARRAYS)
    metrics = content.metric_records.get(protocol.METRICS)
    edit = draw(
        st.sampled_from(
            ["record", "rename", "kind", "array", "values", "shape", "drop", "metric", "weight"]
        )
    )
    if edit == "record":  # a record more, first or last
        kind = draw(st.sampled_from([ArrayRecord, MetricRecord, ConfigRecord]))
        record: Any = (
            kind({"x": Array(np.ones(2))})
            if kind is ArrayRecord
            else MetricRecord({protocol.NUM_EXAMPLES: 1.0, "x": 1.0})
            if kind is MetricRecord
            else ConfigRecord({"x": "y"})
        )
        name = draw(NAMES)
        items = [(name, record), *items] if draw(st.booleans()) else [*items, (name, record)]
        return _rebuilt(items)
    if edit == "rename" and items:
        index = draw(st.integers(0, len(items) - 1))
        items[index] = (draw(NAMES), items[index][1])
        return _rebuilt(items)
    if edit == "kind" and items:  # a record under its name, of another kind
        index = draw(st.integers(0, len(items) - 1))
        name, record = items[index]
        other = (
            MetricRecord({protocol.NUM_EXAMPLES: 1.0})
            if isinstance(record, ArrayRecord)
            else ArrayRecord({protocol.NUM_EXAMPLES: Array(np.ones(1))})
        )
        items[index] = (name, other)
        return _rebuilt(items)
    if edit in ("array", "values", "shape", "drop") and arrays is not None and len(arrays):
        name = draw(st.sampled_from(sorted(arrays)))
        current = arrays[name].numpy()
        if edit == "array":  # one more, under any name
            arrays[draw(st.text(max_size=8))] = Array(current.copy())
        elif edit == "values":
            dtype = draw(st.one_of(st.just(str(current.dtype)), DTYPES))
            arrays[name] = Array(np.ascontiguousarray(draw(_values(current.shape, dtype))))
        elif edit == "shape":
            shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
            arrays[name] = Array(np.ascontiguousarray(draw(_values(shape, str(current.dtype)))))
        else:
            del arrays[name]
        return content
    if edit == "metric" and metrics is not None:
        key = draw(METRIC_KEYS)
        value = draw(METRIC_VALUES)
        if draw(st.booleans()) and key in metrics:
            del metrics[key]
        else:
            with contextlib.suppress(Exception):  # Flower refuses to hold it: none can
                metrics[key] = value
        return content
    if edit == "weight" and metrics is not None and protocol.NUM_EXAMPLES in metrics:
        factor = draw(st.sampled_from([0.0, -1.0, 2.0, 1e6, 1e12, 1e300]))
        metrics[protocol.NUM_EXAMPLES] = records.number(metrics[protocol.NUM_EXAMPLES]) * factor
        if arrays is not None and draw(st.booleans()):  # and every sum over samples alike
            for name in list(arrays):
                if name in ("gamma",) or name.startswith("stats."):
                    arrays[name] = Array(arrays[name].numpy() * factor)
        return content
    return content


def _smuggled(template: RecordDict) -> RecordDict:
    """``template`` after a MetricRecord named ``arrays``, without num-examples: Flower's
    aggregate_metricrecords read the first MetricRecord and raised KeyError."""
    content = RecordDict({protocol.ARRAYS: MetricRecord({"x": 1.0})})
    for name, record in _copy(template).items():
        content[name] = record
    return content


@st.composite
def _reply(draw: st.DrawFn, template: RecordDict) -> RecordDict:
    content = _copy(template)
    for _ in range(draw(st.integers(1, 3))):
        content = draw(_edit(content))
    return content


# ------------------------------------------------------------------ properties
def _largest(arrays: ArrayRecord) -> dict[str, float]:
    out = {}
    for name, array in arrays.items():
        values = array.numpy()
        out[name] = (
            float(np.max(np.abs(values), initial=0.0)) if values.dtype.kind in "iuf" else 0.0
        )
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_no_training_reply_breaks_the_round_or_exceeds_its_bounds(family: str) -> None:
    fed = federation(family)
    template = fed.template(MessageType.TRAIN)
    sent = _largest(fed.initial)

    @FUZZ
    @given(content=_reply(template))
    def check(content: RecordDict) -> None:
        fed.crafted[MessageType.TRAIN] = content
        config = fed.strategy.train_config()
        outcome = train_step(
            fed.strategy, fed.grid, fed.strategy.federation, 1, fed.initial, config, 5
        )
        # Well formed, and what the strategy's own invariants demand
        assert well_formed(outcome.arrays, fed.initial)
        if outcome.arrays is not fed.initial:
            assert fed.strategy.state_defect(outcome.arrays, fed.initial) is None
        # Bounded: no adopted value beyond HUGE x what was sent
        for name, largest in _largest(outcome.arrays).items():
            assert largest <= screening.HUGE * max(1.0, sent[name]) * (1 + 1e-9), name
        # One reply costs that reply, never the round: the state is adopted
        assert not [r for r in outcome.rejections if r.startswith("global state not adopted")]
        assert outcome.accepted >= NODES - 1  # the honest replies all count
        # Rejected with a reason naming the partition, or kept within its weight bound
        kept = [r for r in fed.aggregated if fed.strategy.federation.partition(r) == ATTACKER]
        mine = [r for r in outcome.rejections if r.startswith(f"partition {ATTACKER}: ")]
        assert kept or mine
        assert all(len(r) > len(f"partition {ATTACKER}: ") for r in mine)
        for reply in kept:
            assert screening.num_examples(reply) <= fed.bound(test=False)

    check()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_no_evaluation_reply_breaks_the_round_or_exceeds_its_bounds(family: str) -> None:
    fed = federation(family)
    template = fed.template(MessageType.EVALUATE)
    bound = fed.bound(test=True)

    @FUZZ
    @given(content=_reply(template))
    @example(content=_smuggled(template))  # the class's example: a MetricRecord first
    def check(content: RecordDict) -> None:
        fed.crafted[MessageType.EVALUATE] = content
        config = fed.strategy.evaluate_config()
        outcome = evaluate_step(
            fed.strategy, fed.grid, fed.strategy.federation, 1, fed.initial, config, 5
        )
        # The honest replies are always aggregated, with an accuracy in [0, 1]
        assert outcome.metrics is not None, outcome.rejections
        accuracy = records.number(outcome.metrics[protocol.ACCURACY])
        assert 0.0 <= accuracy <= 1.0 + 1e-12
        mine = outcome.clients.get(str(ATTACKER))
        if mine is not None:  # kept: typed, in range, its weight within the bound
            for key, value in mine.items():
                assert screening.metric_defect(key, value) is None
            assert mine[protocol.NUM_EXAMPLES] <= bound
        else:  # left out, and recorded with a reason
            assert any(
                r.startswith(f"evaluate: partition {ATTACKER}: ") and len(r) > 25
                for r in outcome.rejections
            ), outcome.rejections

    check()
