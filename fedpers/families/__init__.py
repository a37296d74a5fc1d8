"""The registry of algorithm families: what the shared hubs look up instead of naming one.

A family (``FamilySpec``) is one module that owns its knowledge: its settings groups and
their enums, its cross-checks (functions of a ``RunConfig``), the names it puts on the
wire, its result types, the queries its clients answer and how, and its end-of-run
summary. ``fedpers.config`` builds the schema from the registered groups,
``clients/client_app.py`` registers every family's query handlers, and
``strategies/server_app.py`` asks the run's family for its progress metric, its
server-side evaluation and its summary. A new family is a module that calls
``register``, its update module (the local update of a cohort, on the device), its
strategy and its rows; it touches no shared file.

The built-in families are the modules of this package (``personalized``, ``linear``,
``mixture``, ``sheaf``), registered on first use; installed extensions register theirs
through ``fedpers.algorithms.load_extensions``.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord

from fedpers.faults import FaultTargets

if TYPE_CHECKING:
    from fedpers.protocol import FinalTestResult
    from fedpers.results import RoundRecord

# A run configuration (``fedpers.config.RunConfig``) and a data configuration
# (``fedpers.data.client.DataConfig``), as the families' functions receive them: the
# registry does not import those modules, which import it (the configuration builds its
# schema from the registered families, the data layer asks a family for its protocol).
RunConfig = Any
DataConfig = Any
PilotSplit = Any

# The family of the runs on the linear tasks, which run a row's linear variant
# (``AlgorithmSpec.linear``); the algorithm table routes them by this name.
LINEAR = "linear"

Arrays = dict[str, np.ndarray]
Metrics = dict[str, float]
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]
"""A server-side evaluation of the global arrays after a round (Flower's evaluate_fn)."""


class Faults(StrEnum):
    """Which of the fault injections (``fedpers/faults.py``, tests only) a query's
    answer passes through on the device."""

    NONE = "none"
    STARTUP = "startup"  # an answer that seeds the run (initial arrays, statistics)
    RELAY = "relay"  # an answer the server relays to other nodes


@dataclass(frozen=True)
class QuerySpec:
    """A query a family's clients answer, beyond Flower's train and evaluate.

    Parameters
    ----------
    name : str
        The action: the message type is ``query.<name>`` (``fedpers.protocol.query_type``).
    function : str
        The name of the update function that answers, ``function(cohort) ->
        [(arrays, metrics)]`` (one per member; the member's ``arrays`` are the
        message's), looked up in the row's module, then its family's
        (``AlgorithmSpec.update_function``); a row without one is refused with a clear
        error.
    faults : Faults
        Which fault injection the answer passes through (tests).
    doc : str
        One line: what it answers.
    """

    name: str
    function: str
    faults: Faults = Faults.NONE
    doc: str = ""


@dataclass(frozen=True)
class RunSummary:
    """What a family's summary is computed from, at the end of a run."""

    run: RunConfig
    records: list[RoundRecord]
    final: FinalTestResult | None
    initial: Mapping[str, float]  # server metrics of the initial arrays (if evaluated)


Summary = Callable[[RunSummary], dict[str, object]]


@dataclass(frozen=True)
class FamilySpec:
    """One family of algorithms.

    Parameters
    ----------
    name : str
        The family's name, as rows of the algorithm table give it (``AlgorithmSpec.family``)
        and as data sets that bind their runs to it give it (``DatasetInfo.run_family``).
    summary : Summary
        The family's part of ``summary.json``.
    groups : tuple of type
        Settings groups (``fedpers.settings``) it declares, in the order of the docs.
    checks : tuple of callables
        Cross-checks ``check(run)`` raising ``ConfigError``; run for every run (a key of
        the family may be set in any run).
    queries : tuple of QuerySpec
        The queries its clients answer.
    progress_metric : str
        The metric of a run's progress line and plot.
    evaluate_fn : callable, optional
        ``evaluate_fn(run)``: a server-side evaluation after every round.
    evaluates_clients : bool
        Whether clients are evaluated (False: the server evaluates, ``evaluate_fn``).
    input_shape : callable, optional
        ``input_shape(run)``: the model input of a data set whose shape is a setting of
        the family, or None.
    sample_counts : callable, optional
        ``sample_counts(run)``: (train, test) samples of every client, known without
        building any data (fresh samples every round), or None.
    clients_per_round : callable, optional
        ``clients_per_round(run)``: how many clients a round of the family's strategy
        trains, where it does not sample ``fraction-train`` of the seen clients (the
        base strategy's ``sample``); the configuration checks ``min-replies`` against it.
    pools_splits : bool
        Whether its clients' samples come from the data set's train and test splits
        pooled (whatever ``test-split`` says); the configuration counts the samples
        there are to split from it.
    fault_targets : FaultTargets
        The arrays of its replies that the family-specific fault kinds aim at
        (``fedpers.faults``; tests of the server's screening).
    pilot_split : callable, optional
        ``pilot_split(run)``: the ``fedpers.data.client.PilotSplit`` of a family whose
        clients share pilot samples held out of everyone's data (their shift and share),
        or None: the data layer then splits as ``test-split`` says.
    wire : tuple of str
        Every name it puts on the wire (records, arrays, config and metric keys), for
        the wire-contract test.
    metric_ranges : tuple of (str, float, float)
        ``(pattern, low, high)``: the closed range of the metrics its clients send whose
        key matches ``pattern`` (a regular expression, matched in full); the server
        rejects a reply with a value outside it (``strategies.screening``).
    update : str
        The module of the family's local update: the functions (``fit``,
        ``evaluate``, ``initial_arrays``, query answers) a row's own module leaves out
        (``AlgorithmSpec.update_function``); "" for none.
    """

    name: str
    summary: Summary
    groups: tuple[type, ...] = ()
    checks: tuple[Callable[[RunConfig], None], ...] = ()
    queries: tuple[QuerySpec, ...] = ()
    progress_metric: str = "evaluate.accuracy"
    evaluate_fn: Callable[[RunConfig], EvaluateFn] | None = None
    evaluates_clients: bool = True
    input_shape: Callable[[RunConfig], tuple[int, ...] | None] | None = None
    sample_counts: Callable[[RunConfig], tuple[int, int]] | None = None
    clients_per_round: Callable[[RunConfig], int] | None = None
    pools_splits: bool = False
    pilot_split: Callable[[DataConfig], PilotSplit] | None = None
    fault_targets: FaultTargets = FaultTargets()
    wire: tuple[str, ...] = field(default=())
    metric_ranges: tuple[tuple[str, float, float], ...] = ()
    update: str = ""


_FAMILIES: dict[str, FamilySpec] = {}
# The built-in families are the modules of this package, registered on first use (in the
# order of this list where it names them, then by name); nothing here lists a new one.
FIRST = ("linear", "personalized", "sheaf", "mixture")


def register(spec: FamilySpec, *, replace: bool = False) -> FamilySpec:
    """Add a family (from its own module, or a user's package).

    Raises
    ------
    ValueError
        If a family of that name exists and ``replace`` is False, or one of its queries
        is already another family's.
    """
    if _FAMILIES.get(spec.name) == spec:  # the same family again (a module loaded twice)
        return spec
    if spec.name in _FAMILIES and not replace:
        raise ValueError(f"family '{spec.name}' is already registered; pass replace=True")
    taken = {q.name: f.name for f in _FAMILIES.values() if f.name != spec.name for q in f.queries}
    for query in spec.queries:
        if query.name in taken:
            raise ValueError(
                f"family '{spec.name}' declares query '{query.name}', which family "
                f"'{taken[query.name]}' already answers; choose another name"
            )
    _FAMILIES[spec.name] = spec
    return spec


def get(name: str) -> FamilySpec:
    """The family ``name``.

    Raises
    ------
    KeyError
        With the known names.
    """
    _load_built_in()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown family '{name}'; registered: {', '.join(_FAMILIES)}") from None


def all_families() -> list[FamilySpec]:
    """Every registered family: the built-in ones first, in the order of ``FIRST``
    (whichever module imported them first), then the others as registered."""
    _load_built_in()
    rank = {name: i for i, name in enumerate(FIRST)}
    order = sorted(
        range(len(_FAMILIES)), key=lambda i: (rank.get(list(_FAMILIES)[i], len(rank)), i)
    )
    return [list(_FAMILIES.values())[i] for i in order]


@functools.cache
def _load_built_in() -> None:
    found = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    for name in [*(n for n in FIRST if n in found), *(n for n in found if n not in FIRST)]:
        importlib.import_module(f"{__name__}.{name}")
