"""Replies generated from the record grammar, and the properties the server guarantees
for any of them (docs/architecture.md, "What the server guarantees").

A generated reply is one node's honest reply of the round, changed by one to three
edits of the record grammar (any records, names, kinds, shapes, dtypes, values, metric
keys, claimed weights), sent in place of that node's training or evaluation reply. It
goes through the round loop's own steps (``train_step``, ``evaluate_step``) against real
ClientApps in this process (``fedpers.simulations.inprocess``). For every reply:

- no exception escapes the step;
- the adopted state is well formed (the model's arrays, finite, and what the strategy's
  ``state_defect`` demands), and the round adopts it: one reply never voids a round;
- its influence is within the stated bounds: its weight at most what it registered and
  at most ``weight-cap`` x the lower median of what all registered (computed here, not
  by ``Federation.weight_bounds``), every adopted value at most ``screening.HUGE`` times
  the largest value sent (at least 1), its update norm at most ``update-cap`` x the
  lower median of the round's (FedGMM: each component's spread at most its square x
  the lower median of the spreads), its evaluation metrics in their ranges;
- what is rejected is recorded with a reason naming the partition.

``tests/strategies/test_reply_fuzz.py`` runs these properties with a fixed budget and
seed; ``simulations.robustness`` runs the long sweep (``sweep``), counting every
violation instead of stopping at the first. Needs ``hypothesis`` (``pip install
'fedpers[dev]'``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any, cast

import numpy as np
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
from flwr.serverapp import Grid
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from fedpers import protocol, records
from fedpers.clients.client_app import app as client_app
from fedpers.config import RunConfig
from fedpers.families.mixture import (
    GMM_COVARIANCES,
    QUERY_ASSIGN,
    QUERY_PCA,
    QUERY_SUMMARY,
    STATS_COUNT,
    STATS_SECOND,
)
from fedpers.simulations.grid import InProcessGrid, run_config
from fedpers.strategies import build_strategy, screening
from fedpers.strategies.base import FedpersStrategy
from fedpers.strategies.rounds import evaluate_step, train_step, well_formed

NODES = 4
ATTACKER = 1
FAMILIES: dict[str, dict[str, Any]] = {
    "fedavg": {"algorithm": "fedavg", "dataset": "digits"},
    "fedrep": {"algorithm": "fedrep", "dataset": "digits"},
    # SCAFFOLD: control variates travel both ways beside the model
    "scaffold": {"algorithm": "scaffold", "dataset": "digits"},
    # FedDyn: the server steps past the mean by its h, which every reply moves
    "feddyn": {"algorithm": "feddyn", "dataset": "digits", "feddyn_alpha": 0.1},
    # L2GD: the server keeps the mean of all personal models from the sampled changes
    "l2gd": {"algorithm": "l2gd", "dataset": "digits", "l2gd_p": 0.5},
    # Fed-MTL: every client's model is the state; each reply replaces its own
    "fed-mtl": {"algorithm": "fed-mtl", "dataset": "digits"},
    # FedAMP: the same state, each client sent an attentive combination of all of it
    "fedamp": {"algorithm": "fedamp", "dataset": "digits", "fedamp_sigma": 100.0},
    # pFedHN: each client sent its generated model; the replies step a hypernetwork
    "pfedhn": {"algorithm": "pfedhn", "dataset": "digits", "pfedhn_hidden": 16},
    # pFedMe: the server's beta step from the last global model
    "pfedme": {"algorithm": "pfedme", "dataset": "digits", "pfedme_beta": 2.0},
    # Clustered FL: split from the first round on, so that replies reach two clusters
    "clustered-fl": {
        "algorithm": "clustered-fl",
        "dataset": "digits",
        "clustered_fl_eps1": 1e9,
        "clustered_fl_eps2": 0.0,
    },
    "fedgmm": {"algorithm": "fedgmm", "dataset": "mixture", "samples_per_client": 60},
    # IFCA: FedEM's exchange, each model averaged by the clients whose gamma chose it
    "ifca": {"algorithm": "ifca", "dataset": "digits", "mixture_learners": 2},
    "sheaf-frl": {"algorithm": "sheaf-frl", "dataset": "digits"},
    # FedProto: class prototypes and their counts (weights) come back, no model
    "fedproto": {"algorithm": "fedproto", "dataset": "digits", "sheaf_latent_dims": "8,8,8,8"},
}
PHASES = (MessageType.TRAIN, MessageType.EVALUATE)
TIMEOUT = 5.0


def _family_values(family: str) -> dict[str, Any]:
    """The run config of a family's ``NODES``-node federation: one round, every node."""
    return run_config(**FAMILIES[family], num_clients=NODES, fraction_train=1.0, num_rounds=1)


def _connected(run: RunConfig, grid: Grid) -> FedpersStrategy:
    """A fresh strategy for ``run``, its nodes registered (``query.info``)."""
    strategy = build_strategy(run)
    strategy.federation.connect(grid, timeout=TIMEOUT)
    return strategy


class Federation:
    """One family's federation of ``NODES`` in-process nodes, set up once: the strategy
    after start-up, the round's messages, and each honest node's reply to them, replayed
    as fresh copies. Partition ``ATTACKER`` sends what ``crafted`` holds instead."""

    def __init__(self, family: str) -> None:
        self.values = _family_values(family)
        self.run = RunConfig.from_mapping(self.values)
        self.crafted: dict[str, RecordDict] = {}
        self.honest: dict[tuple[int, str], RecordDict] = {}
        # Flower's Grid in what the round loop uses of it (InProcessGrid's docstring)
        self.grid = cast(Grid, InProcessGrid(self._app, self.values, NODES))
        self.strategy = _connected(self.run, self.grid)
        self.initial = self.strategy.initial_arrays(self.grid, timeout=TIMEOUT)
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
        return min(float(sizes[ATTACKER]), self.run.weight_cap * lower_median)

    def template(self, kind: str) -> RecordDict:
        """The attacker's own honest reply of the round (one honest step first)."""
        self.crafted.pop(kind, None)
        step = train_step if kind == MessageType.TRAIN else evaluate_step
        config = (
            self.strategy.train_config()
            if kind == MessageType.TRAIN
            else self.strategy.evaluate_config()
        )
        step(self.strategy, self.grid, self.strategy.federation, 1, self.initial, config, TIMEOUT)
        return self.honest[(ATTACKER, kind)]

    def _app(self, message: Message, context: Context) -> Message:
        kind = message.metadata.message_type
        partition = int(context.node_config["partition-id"])
        if partition == ATTACKER and kind in self.crafted:
            return Message(self.crafted[kind], reply_to=message)
        if kind not in PHASES:
            return client_app(message, context)
        if (partition, kind) not in self.honest:  # the honest nodes answer once
            self.honest[(partition, kind)] = client_app(message, context).content
        return Message(copy_content(self.honest[(partition, kind)]), reply_to=message)


def copy_content(content: RecordDict) -> RecordDict:
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
    """The family's federation, built once per process."""
    return Federation(family)


# ------------------------------------------------------------------ the grammar
# Most edits keep the rest well formed, so that each reaches the checks after the first.
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
EDITS = [
    "record",
    "rename",
    "kind",
    "array",
    "values",
    "shape",
    "drop",
    "scale",
    "metric",
    "weight",
]
# In-bound scalings: finite, within the value bound, of the right type and shape
SCALES = st.sampled_from([-1e4, -100.0, -10.0, -3.0, 0.5, 3.0, 10.0, 100.0, 1e4])


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


def _is_number(value: Any) -> bool:
    """An int or float (an earlier edit may have made the weight a list or text)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _rebuilt(items: list[tuple[str, Any]]) -> RecordDict:
    content = RecordDict()
    for name, record in items:
        content[name] = record
    return content


def _record_edit(draw: st.DrawFn, content: RecordDict, edit: str) -> RecordDict:
    """A record more (first or last), a record renamed, or one of another kind."""
    items = list(content.items())
    if edit == "record":
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
    elif edit == "rename" and items:
        index = draw(st.integers(0, len(items) - 1))
        items[index] = (draw(NAMES), items[index][1])
    elif edit == "kind" and items:
        index = draw(st.integers(0, len(items) - 1))
        name, record = items[index]
        other = (
            MetricRecord({protocol.NUM_EXAMPLES: 1.0})
            if isinstance(record, ArrayRecord)
            else ArrayRecord({protocol.NUM_EXAMPLES: Array(np.ones(1))})
        )
        items[index] = (name, other)
    return _rebuilt(items)


def _array_edit(draw: st.DrawFn, arrays: ArrayRecord, edit: str) -> None:
    """One array more (any name), refilled (any dtype), reshaped, scaled (in bound), or
    dropped."""
    name = draw(st.sampled_from(sorted(arrays)))
    current = arrays[name].numpy()
    if edit == "array":
        arrays[draw(st.text(max_size=8))] = Array(current.copy())
    elif edit == "values":
        dtype = draw(st.one_of(st.just(str(current.dtype)), DTYPES))
        arrays[name] = Array(records.contiguous(draw(_values(current.shape, dtype))))
    elif edit == "shape":
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        arrays[name] = Array(records.contiguous(draw(_values(shape, str(current.dtype)))))
    elif edit == "scale":
        if current.dtype.kind == "f":
            arrays[name] = Array(records.contiguous(current * current.dtype.type(draw(SCALES))))
    else:
        del arrays[name]


@st.composite
def _edit(draw: st.DrawFn, content: RecordDict) -> RecordDict:
    arrays = content.array_records.get(protocol.ARRAYS)
    metrics = content.metric_records.get(protocol.METRICS)
    edit = draw(st.sampled_from(EDITS))
    if edit in ("record", "rename", "kind"):
        return _record_edit(draw, content, edit)
    if edit in ("array", "values", "shape", "scale", "drop") and arrays is not None and len(arrays):
        _array_edit(draw, arrays, edit)
    elif edit == "metric" and metrics is not None:
        key = draw(METRIC_KEYS)
        value = draw(METRIC_VALUES)
        if draw(st.booleans()) and key in metrics:
            del metrics[key]
        else:
            with contextlib.suppress(Exception):  # Flower refuses to hold it: none can
                cast(dict[str, Any], metrics)[key] = value  # any value, typed or not
    elif (
        edit == "weight" and metrics is not None and _is_number(metrics.get(protocol.NUM_EXAMPLES))
    ):
        factor = draw(st.sampled_from([0.0, -1.0, 2.0, 1e6, 1e12, 1e300]))
        metrics[protocol.NUM_EXAMPLES] = records.number(metrics[protocol.NUM_EXAMPLES]) * factor
        if arrays is not None and draw(st.booleans()):  # and every sum over samples alike
            for name in list(arrays):
                if name in ("gamma",) or name.startswith("stats."):
                    with np.errstate(all="ignore"):  # 1e300 x a sum: inf, on purpose
                        arrays[name] = Array(arrays[name].numpy() * factor)
    return content


def smuggled(template: RecordDict) -> RecordDict:
    """``template`` after a MetricRecord named ``arrays``, without num-examples: Flower's
    aggregate_metricrecords read the first MetricRecord and raised KeyError."""
    content = RecordDict({protocol.ARRAYS: MetricRecord({"x": 1.0})})
    for name, record in copy_content(template).items():
        content[name] = record
    return content


@st.composite
def replies(draw: st.DrawFn, template: RecordDict) -> RecordDict:
    """A reply: ``template`` after one to three edits of the grammar."""
    content = copy_content(template)
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


# Violation kinds, as the sweep counts them
ILL_FORMED = "ill-formed state adopted"
BOUND = "influence bound exceeded"
VOIDED = "round voided"
NO_REASON = "rejected without a reason"
KINDS = (ILL_FORMED, BOUND, VOIDED, NO_REASON)


Found = tuple[list[tuple[str, str]], bool]


def training_violations(fed: Federation, content: RecordDict) -> Found:
    """Send ``content`` as the attacker's training reply: the properties it breaks, as
    ``(kind, detail)`` pairs, and whether the reply took part. An exception escaping the
    step propagates."""
    fed.crafted[MessageType.TRAIN] = content
    federation_ = fed.strategy.federation
    outcome = train_step(
        fed.strategy, fed.grid, federation_, 1, fed.initial, fed.strategy.train_config(), TIMEOUT
    )
    found: list[tuple[str, str]] = []
    if not well_formed(outcome.arrays, fed.initial):
        found.append((ILL_FORMED, "not the model's arrays, or not finite"))
    elif outcome.arrays is not fed.initial:
        defect = fed.strategy.state_defect(outcome.arrays, fed.initial)
        if defect is not None:
            found.append((ILL_FORMED, defect))
    sent = _largest(fed.initial)
    for name, largest in _largest(outcome.arrays).items():
        if largest > screening.HUGE * max(1.0, sent.get(name, 0.0)) * (1 + 1e-9):
            found.append((BOUND, f"{name}: |value| {largest:.3g}"))
    if [r for r in outcome.rejections if r.startswith("global state not adopted")]:
        found.append((VOIDED, "global state not adopted"))
    if outcome.accepted < NODES - 1:
        found.append((VOIDED, f"{outcome.accepted} replies accepted of {NODES - 1} honest"))
    prefix = f"partition {ATTACKER}: "
    kept = [r for r in fed.aggregated if federation_.partition(r) == ATTACKER]
    mine = [r for r in outcome.rejections if r.startswith(prefix)]
    if not kept and not mine:
        found.append((NO_REASON, "left out, and no rejection recorded"))
    if any(len(r) <= len(prefix) for r in mine):
        found.append((NO_REASON, "a rejection with an empty reason"))
    bound = fed.bound(test=False)
    for reply in kept:
        weight = screening.num_examples(reply)
        if weight > bound:
            found.append((BOUND, f"weight {weight:.3g} > {bound:.3g}"))
    if kept:
        found += _beyond_update_bounds(fed)
    return found, bool(kept)


def _beyond_update_bounds(fed: Federation) -> list[tuple[str, str]]:
    """The attacker's kept training reply against the update bounds the docs state,
    computed here (Flower's decoding, ``statistics.median_low``): its update norm at
    most ``update-cap`` x the lower median of the round's replies of positive weight,
    and (FedGMM) each component's spread at most ``update-cap`` squared x the lower
    median of the spreads of the replies holding samples of it."""
    counted = [r for r in fed.aggregated if screening.num_examples(r) > 0]
    partition = fed.strategy.federation.partition
    if len(counted) < 2 or ATTACKER not in {partition(r) for r in counted}:
        return []  # a reply of weight zero is kept but not aggregated
    sent = {name: array.numpy().astype(np.float64) for name, array in fed.initial.items()}
    if not sent:
        return []  # Sheaf-FRL: nothing shared, its relayed pilots are bounded absolutely
    returned = {
        partition(r): {
            n: a.numpy()
            for n, a in r.content.array_records.get(protocol.ARRAYS, ArrayRecord()).items()
        }
        for r in counted
    }
    cap = fed.run.update_cap
    found = []
    norms = {}
    for p, arrays in returned.items():
        parts = [
            (values.astype(np.float64) - sent[name]).ravel()
            for name, values in arrays.items()
            if name in sent and values.dtype.kind == "f" and values.shape == sent[name].shape
        ]
        norms[p] = float(np.linalg.norm(np.concatenate(parts))) if parts else 0.0
    typical = statistics.median_low(norms.values())
    if typical > 0 and norms[ATTACKER] > cap * typical * (1 + 1e-9):
        found.append((BOUND, f"update norm {norms[ATTACKER]:.3g} > {cap:g} x {typical:.3g}"))
    if STATS_SECOND not in returned[ATTACKER]:
        return found
    for k in range(len(returned[ATTACKER][STATS_COUNT])):
        spreads = {}
        for p, arrays in returned.items():
            count, second = arrays[STATS_COUNT][k], arrays[STATS_SECOND][k]
            if count > 0:
                spreads[p] = float(np.trace(second) if second.ndim == 2 else second.sum()) / count
        if ATTACKER not in spreads or len(spreads) < 2:
            continue
        typical = statistics.median_low(spreads.values())
        if typical > 0 and spreads[ATTACKER] > cap**2 * typical * (1 + 1e-9):
            found.append((BOUND, f"component {k} spread {spreads[ATTACKER]:.3g}"))
    return found


def evaluation_violations(fed: Federation, content: RecordDict) -> Found:
    """Send ``content`` as the attacker's evaluation reply: the properties it breaks, and
    whether the reply took part."""
    fed.crafted[MessageType.EVALUATE] = content
    outcome = evaluate_step(
        fed.strategy,
        fed.grid,
        fed.strategy.federation,
        1,
        fed.initial,
        fed.strategy.evaluate_config(),
        TIMEOUT,
    )
    found: list[tuple[str, str]] = []
    if outcome.metrics is None:
        return [(VOIDED, f"no evaluation aggregated: {outcome.rejections[:2]}")], False
    accuracy = records.number(outcome.metrics[protocol.ACCURACY])
    if not 0.0 <= accuracy <= 1.0 + 1e-12:
        found.append((BOUND, f"federation accuracy {accuracy!r}"))
    mine = outcome.clients.get(str(ATTACKER))
    if mine is not None:  # kept: typed, in range, its weight within the bound
        for key, value in mine.items():
            defect = screening.metric_defect(key, value)
            if defect is not None:
                found.append((ILL_FORMED, f"kept metric {key!r}: {defect}"))
        bound = fed.bound(test=True)
        if mine.get(protocol.NUM_EXAMPLES, math.inf) > bound:
            found.append((BOUND, f"weight {mine.get(protocol.NUM_EXAMPLES)!r} > {bound:.3g}"))
    elif not any(
        r.startswith(f"evaluate: partition {ATTACKER}: ") and len(r) > 25
        for r in outcome.rejections
    ):
        found.append((NO_REASON, f"left out, recorded as {outcome.rejections}"))
    return found, mine is not None


VIOLATIONS: dict[str, Callable[[Federation, RecordDict], Found]] = {
    MessageType.TRAIN: training_violations,
    MessageType.EVALUATE: evaluation_violations,
}


# ------------------------------------------------------------------ start-up
STARTUP = protocol.QUERY_INITIAL
STARTUP_FAMILIES = ("fedavg", "fedrep", "fedgmm")  # Sheaf-FRL shares no initial model


class Startup:
    """One family's start-up vote on the initial model (``query.initial``): partition
    ``ATTACKER`` answers the digest question and the arrays question with what
    ``crafted`` holds (keyed by whether the question asks for the digest); the others
    answer honestly. ``honest`` is the model the vote chose with no crafted answer."""

    def __init__(self, family: str) -> None:
        self.values = _family_values(family)
        self.run = RunConfig.from_mapping(self.values)
        self.crafted: dict[bool, RecordDict] = {}
        self.templates: dict[bool, RecordDict] = {}  # the attacker's honest answers
        self.grid = cast(Grid, InProcessGrid(self._app, self.values, NODES))
        self.honest, rejections = self.vote()
        if rejections:
            raise AssertionError(f"a clean start-up rejected answers: {rejections}")
        # A clean vote fetches the arrays from partition 0: ask the attacker once too,
        # for its honest arrays answer
        _connected(self.run, self.grid).startup(
            self.grid, STARTUP, [ATTACKER], RecordDict(), TIMEOUT
        )

    def vote(self) -> tuple[ArrayRecord, tuple[str, ...]]:
        """A fresh strategy's start-up: registration, then the vote; the chosen arrays
        and the start-up rejections."""
        strategy = _connected(self.run, self.grid)
        arrays = strategy.initial_arrays(self.grid, timeout=TIMEOUT)
        return arrays, strategy.startup_rejections

    def _app(self, message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        if partition != ATTACKER or message.metadata.message_type != STARTUP:
            return client_app(message, context)
        config = message.content.config_records.get(protocol.CONFIG)
        digest = bool(config and config.get(protocol.DIGEST))
        if digest in self.crafted:
            return Message(copy_content(self.crafted[digest]), reply_to=message)
        reply = client_app(message, context)
        self.templates.setdefault(digest, copy_content(reply.content))
        return reply


@cache
def startup(family: str) -> Startup:
    """The family's start-up harness, built once per process."""
    return Startup(family)


@st.composite
def startup_answers(draw: st.DrawFn, harness: Startup) -> dict[bool, RecordDict]:
    """The attacker's two answers: each its honest answer or a generated one; or a
    coherent lie: a generated model with the digest of what it sends."""
    honest_digest, honest_arrays = harness.templates[True], harness.templates[False]
    if draw(st.booleans()):  # coherent: a model of its own, and that model's digest
        arrays = draw(replies(honest_arrays))
        record = arrays.array_records.get(protocol.ARRAYS)
        try:
            values = {k: a.numpy() for k, a in (record or {}).items()}
            digest = protocol.arrays_digest(values)
        except Exception:  # an array that does not decode: fall back to any digest
            return {True: draw(replies(honest_digest)), False: arrays}
        coherent = copy_content(honest_digest)
        coherent[protocol.ARRAYS] = ArrayRecord({protocol.DIGEST: Array(digest)})
        return {True: coherent, False: arrays}
    return {
        True: draw(st.one_of(st.just(honest_digest), replies(honest_digest))),
        False: draw(st.one_of(st.just(honest_arrays), replies(honest_arrays))),
    }


def startup_violations(harness: Startup, answers: dict[bool, RecordDict]) -> Found:
    """The vote with the attacker's ``answers``: the properties it breaks (the vote
    raising, a model other than the honest one, an honest node rejected, a rejection
    without a reason), and whether the attacker's answers were left out."""
    harness.crafted = dict(answers)
    try:
        arrays, rejections = harness.vote()
    finally:
        harness.crafted = {}
    found: list[tuple[str, str]] = []
    if _digest(arrays) != _digest(harness.honest):  # names, shapes, dtypes and bytes
        found.append((BOUND, "the vote chose a model other than the honest majority's"))
    found += _startup_rejection_violations(rejections)
    return found, not rejections


def _startup_rejection_violations(rejections: Sequence[str]) -> list[tuple[str, str]]:
    """A start-up rejection of an honest node (any but ``ATTACKER``), or one without a
    reason."""
    found: list[tuple[str, str]] = []
    prefix = f"partition {ATTACKER}: "
    for rejection in rejections:
        if not rejection.startswith(prefix):
            found.append((VOIDED, f"an honest answer was rejected: {rejection}"))
        elif len(rejection) <= len(prefix):
            found.append((NO_REASON, "a rejection with an empty reason"))
    return found


def _digest(arrays: ArrayRecord) -> bytes:
    return protocol.arrays_digest({k: a.numpy() for k, a in arrays.items()}).tobytes()


def sweep_startup(harness: Startup, family: str, examples: int, seed: int) -> SweepCount:
    """``examples`` generated answer pairs in place of the attacker's start-up answers."""
    return _sweep(
        SweepCount(family, STARTUP),
        startup_answers(harness),
        lambda answers: startup_violations(harness, answers),
        examples,
        seed,
    )


def _sweep(
    count: SweepCount,
    generated: st.SearchStrategy[Any],
    check: Callable[[Any], Found],
    examples: int,
    seed: int,
) -> SweepCount:
    """``count`` of ``check`` on ``examples`` values drawn from ``generated``, seeded."""
    started = time.monotonic()

    @_sweep_settings(examples, seed)
    @given(value=generated)
    def one(value: Any) -> None:
        count.add(lambda: check(value))

    one()
    count.seconds = time.monotonic() - started
    return count


# --------------------------------------------------- FedGMM's start-up statistics
STATISTICS_FAMILY = "fedgmm"
STATISTICS_QUERIES = (QUERY_PCA, QUERY_SUMMARY, QUERY_ASSIGN)
STATISTICS_VALUES = {  # digits: the embedding is a PCA, so all three queries are asked
    "algorithm": "fedgmm",
    "dataset": "digits",
    "num_clients": NODES,
    "fraction_train": 1.0,
    "num_rounds": 1,
}
STARTUP_BOUND = screening.HUGE  # no initial value beyond this x the honest state's largest


class StatisticsStartup:
    """FedGMM's start-up statistics (``query.pca``, ``query.summary``, ``query.assign``):
    partition ``ATTACKER`` answers the query ``crafted`` names with what it holds, the
    others answer honestly. ``honest`` is the initial state with no crafted answer;
    ``templates`` the attacker's honest answers, by query."""

    def __init__(self) -> None:
        self.values = run_config(**STATISTICS_VALUES)
        self.run = RunConfig.from_mapping(self.values)
        self.crafted: tuple[str, RecordDict] | None = None
        self.templates: dict[str, RecordDict] = {}
        self.grid = cast(Grid, InProcessGrid(self._app, self.values, NODES))
        self.honest, rejections = self.start()
        if rejections or set(self.templates) != set(STATISTICS_QUERIES):
            raise AssertionError(f"a clean start-up went wrong: {rejections}, {self.templates}")

    def start(self) -> tuple[ArrayRecord, tuple[str, ...]]:
        """A fresh strategy's start-up: the initial state and the start-up rejections."""
        strategy = _connected(self.run, self.grid)
        arrays = strategy.initial_arrays(self.grid, timeout=TIMEOUT)
        return arrays, strategy.startup_rejections

    def _app(self, message: Message, context: Context) -> Message:
        query = message.metadata.message_type
        if int(context.node_config["partition-id"]) != ATTACKER:
            return client_app(message, context)
        if self.crafted is not None and self.crafted[0] == query:
            return Message(copy_content(self.crafted[1]), reply_to=message)
        reply = client_app(message, context)
        if query in STATISTICS_QUERIES:
            self.templates.setdefault(query, copy_content(reply.content))
        return reply


@cache
def statistics_startup() -> StatisticsStartup:
    """FedGMM's start-up statistics harness, built once per process."""
    return StatisticsStartup()


def statistics_violations(harness: StatisticsStartup, query: str, answer: RecordDict) -> Found:
    """FedGMM's start-up with the attacker's ``answer`` to ``query``: the properties it
    breaks (the start-up raising is counted by the caller; an initial state that is not
    the honest one's arrays, finite, with positive definite covariances; a value beyond
    ``STARTUP_BOUND`` x the honest state's largest; an honest node rejected; a rejection
    without a reason), and whether the attacker's answer was left out."""
    harness.crafted = (query, answer)
    try:
        arrays, rejections = harness.start()
    finally:
        harness.crafted = None
    found: list[tuple[str, str]] = []
    if not well_formed(arrays, harness.honest) or not _positive_definite(arrays):
        found.append((ILL_FORMED, "the initial state is not well formed"))
    else:
        largest = max(float(np.max(np.abs(a.numpy()), initial=0.0)) for a in arrays.values())
        honest = max(float(np.max(np.abs(a.numpy()), initial=0.0)) for a in harness.honest.values())
        if largest > STARTUP_BOUND * honest:
            found.append((BOUND, f"an initial value of {largest:.3g}, honest {honest:.3g}"))
    found += _startup_rejection_violations(rejections)
    return found, not rejections


def sweep_statistics(
    harness: StatisticsStartup, query: str, examples: int, seed: int
) -> SweepCount:
    """``examples`` generated answers to ``query`` in place of the attacker's."""
    return _sweep(
        SweepCount(STATISTICS_FAMILY, query),
        replies(harness.templates[query]),
        lambda answer: statistics_violations(harness, query, answer),
        examples,
        seed,
    )


def _statistics_changed(
    template: RecordDict, change: Callable[[np.ndarray], np.ndarray]
) -> RecordDict:
    """``template`` with ``change`` applied to every array but the sample counts."""
    content = copy_content(template)
    arrays = content.array_records[protocol.ARRAYS]
    for name in list(arrays.keys()):
        if "count" not in name:
            arrays[name] = Array(records.contiguous(change(arrays[name].numpy())))
    return content


def scaled_statistics(template: RecordDict, factor: float) -> RecordDict:
    """``template`` with every array but the sample counts times ``factor``: a
    scaled-up client, consistent in its shapes and counts (the regression class)."""
    return _statistics_changed(template, lambda values: values * factor)


def least_integer_statistics(template: RecordDict) -> RecordDict:
    """``template`` with every array but the sample counts int64, filled with int64's
    least value (what 1e300 becomes, cast to int64). Bounds computed on it in int64
    pass: its ``abs`` is negative and its products wrap around to 0. The long sweep
    found it once (2026-12-05: a PCA mean of -1.14e16 adopted); the answers must now be
    float64, as honest ones are."""
    least = np.iinfo(np.int64).min
    return _statistics_changed(
        template, lambda values: np.full(values.shape, least, dtype=np.int64)
    )


def _positive_definite(arrays: ArrayRecord) -> bool:
    """Every full covariance positive definite (numpy's Cholesky), every variance > 0."""
    covariances = arrays[GMM_COVARIANCES].numpy().astype(np.float64)
    if covariances.ndim == 2:
        return bool(np.all(covariances > 0))
    try:
        np.linalg.cholesky(covariances)
    except np.linalg.LinAlgError:
        return False
    return True


def _sweep_settings(examples: int, seed: int) -> Callable[[Any], Any]:
    """hypothesis' settings for a sweep: ``examples`` generated, seeded, never shrunk
    (nothing fails: every outcome is counted)."""

    def apply(test: Any) -> Any:
        configured = settings(
            max_examples=examples,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )(test)
        return hypothesis_seed(seed)(configured)

    return apply


# ------------------------------------------------------------------ the sweep
@dataclass
class SweepCount:
    """What the sweep found for one family and phase."""

    family: str
    phase: str
    replies: int = 0
    exceptions: int = 0
    kept: int = 0  # replies that took part (the rest were left out with a reason)
    violations: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    examples: list[str] = field(default_factory=list)  # the first few, for the report
    seconds: float = 0.0

    def add(self, check: Callable[[], Found]) -> None:
        """Count one generated reply: what ``check`` found, or the exception it raised."""
        self.replies += 1
        try:
            found, kept = check()
        except Exception as error:  # counted: no exception escaping is the property
            self.exceptions += 1
            found, kept = [("exception", repr(error)[:200])], False
        self.kept += kept
        for kind, detail in found:
            if kind in self.violations:
                self.violations[kind] += 1
            if len(self.examples) < 5:
                self.examples.append(f"{kind}: {detail}")


def sweep(
    families: Sequence[str],
    examples: int,
    seed: int = 0,
    progress: Callable[[str], None] = print,
) -> list[SweepCount]:
    """``examples`` generated replies per family and phase (training, evaluation, the
    start-up vote's answers where the family has one, and FedGMM's three start-up
    statistics queries when it is among ``families``), every property checked on
    each. Nothing stops the sweep: an exception or a violation is counted, and the next
    reply generated. One progress line per family and phase, with an ETA."""
    counts: list[SweepCount] = []
    cases = [(family, phase) for family in families for phase in PHASES]
    cases += [(family, STARTUP) for family in families if family in STARTUP_FAMILIES]
    if STATISTICS_FAMILY in families:  # FedGMM's start-up statistics, a query each
        cases += [(STATISTICS_FAMILY, query) for query in STATISTICS_QUERIES]
    total = len(cases) * examples
    started = time.monotonic()
    for family, phase in cases:
        with _quiet():  # each rejection is logged: thousands of lines
            if phase == STARTUP:
                count = sweep_startup(startup(family), family, examples, seed)
            elif phase in STATISTICS_QUERIES:
                count = sweep_statistics(statistics_startup(), phase, examples, seed)
            else:
                count = sweep_phase(federation(family), family, phase, examples, seed)
        counts.append(count)
        done = len(counts) * examples
        eta = (time.monotonic() - started) / done * (total - done)
        progress(
            f"reply sweep {family} {phase}: {count.replies} replies, "
            f"{count.exceptions} exceptions, "
            + ", ".join(f"{v} {k}" for k, v in count.violations.items())
            + f" ({count.seconds:.0f} s; ETA {eta:.0f} s)"
        )
    return counts


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No log records up to WARNING (fedpers' rejections, Flower's record warnings)."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


def sweep_phase(fed: Federation, family: str, phase: str, examples: int, seed: int) -> SweepCount:
    """``examples`` generated replies in place of the attacker's ``phase`` reply."""
    check = VIOLATIONS[phase]
    return _sweep(
        SweepCount(family, phase),
        replies(fed.template(phase)),
        lambda content: check(fed, content),
        examples,
        seed,
    )
