"""The algorithm table: every algorithm a run can name, one row each.

An algorithm is one module of this package: its row (``AlgorithmSpec``, in the module's
``ROWS``), its settings group, the names it puts on the wire, its checks and its local
update (``fit(cohort)``, ``evaluate(cohort)``: ``fedpers.cohort``), written once for a
cohort of clients; what it does not write is its family's (``FamilySpec.update``). Its
strategy, where its server step differs, is named as ``"module:Class"`` and imported
only when a run needs it, so ``fedpers`` imports neither ``strategies`` nor ``clients``,
and no algorithm module imports torch at module level (a server never loads torch).

The built-in modules are found in this package, as the families are; users add their
own rows from their own package with ``register``, without editing fedpers::

    from fedpers.algorithms import AlgorithmSpec, Family, register
    register(AlgorithmSpec(name="my-fedper", family=Family.PERSONALIZED, shared=("body",)))

For the ServerApp and every ClientApp process to know it, the package declares a
function that registers its algorithms (and data sets, ``fedpers.data.sources.
register_dataset``, and models, ``fedpers.models.register_model``) in the entry-point
group ``fedpers.extensions``; ``load_extensions`` calls each once per process, before
any run configuration is parsed (see examples/server_momentum).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import pkgutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from importlib.metadata import entry_points
from typing import Any

from fedpers import families
from fedpers.families import LINEAR as LINEAR_FAMILY
from fedpers.families import RunConfig
from fedpers.protocol import EPOCHS, MODEL_PARTS

ENTRY_POINT_GROUP = "fedpers.extensions"


class Family(StrEnum):
    """The built-in families (``fedpers.families``); a row names its family by name, so
    a family from another package needs no member here."""

    PERSONALIZED = "personalized"  # a body/head model, part of it averaged by the server
    MIXTURE = "mixture"  # shared learners (and Gaussian components), personal weights
    SHEAF = "sheaf"  # no shared model: pilots relayed between graph neighbours


class FinalTest(StrEnum):
    """What the server asks of every client after the last round."""

    NONE = "none"
    FINETUNE = "finetune"  # fine-tune the head for ``finetune-epochs``, then test
    FINETUNE_ALL = "finetune-all"  # fine-tune body and head for ``finetune-epochs``, then test


@dataclass(frozen=True)
class Phase:
    """One phase of a client's local update: train ``parts`` for the epochs that the
    server sends under the message config key ``epochs``."""

    parts: tuple[str, ...]
    epochs: str = EPOCHS


JOINT = (Phase(MODEL_PARTS),)


@dataclass(frozen=True)
class LinearVariant:
    """An algorithm's linear-model variant (FedRep, Section 4): its strategy
    (``"module:Class"``) and the module of its local update, written for a cohort
    (``fit(cohort)``, ``evaluate(cohort)``; what it leaves out is the linear family's,
    ``fedpers.families.linear``)."""

    strategy: str
    update: str


@dataclass(frozen=True)
class AlgorithmSpec:
    """One row of the algorithm table.

    Parameters
    ----------
    name : str
        The value of the run-config key ``algorithm``.
    family : str
        How server and clients talk: the name of a registered family
        (``fedpers.families``; the built-in ones are the members of ``Family``).
    shared : tuple of str
        Model parts (``body``, ``head``) sent to and averaged by the server; the others
        stay on the device in ``context.state``.
    strategy : str (default: the personalized strategy)
        ``"module:Class"`` of the server strategy.
    update : str (default: the module that declares the row)
        The module of its local update: ``fit(cohort)``, ``evaluate(cohort)`` and the
        answers to its family's queries; what it leaves out is its family's
        (``FamilySpec.update``).

    phases : tuple of Phase (default: body and head jointly for ``epochs``)
        The local update of a personalized client, in order.
    final_test : FinalTest (default: NONE)
        What every client does after the last round.
    settings : tuple of type (default: ())
        Settings groups (``fedpers.settings``) the algorithm declares itself, beyond the
        core's and its family's; read them with ``run.group(Cls)``.
    checks : tuple of callables (default: ())
        Its cross-checks ``check(run)``, raising ``ConfigError``, run for runs of the row.
    wire : tuple of str (default: ())
        The names it puts on the wire beyond its family's (for the wire-contract test).
    unseen : bool (default: False)
        Whether it can serve unseen clients (``unseen-fraction > 0``).
    linear : LinearVariant, optional
        Its variant for the linear model (``dataset = "linear"``): the strategy and the
        update module that run instead of ``strategy`` and ``update`` there.
    deep : bool (default: True)
        False for algorithms that exist only for the linear model.
    personal_state : bool, optional
        Whether clients keep state between rounds beyond their personal parts (Ditto's
        personal model); by default, whether the row keeps model parts or is not of
        the personalized family.
    paper : str (default: "")
        Where it comes from.
    """

    name: str
    family: str
    shared: tuple[str, ...]
    strategy: str = "fedpers.strategies.base:FedpersStrategy"
    update: str = ""

    phases: tuple[Phase, ...] = JOINT
    final_test: FinalTest = FinalTest.NONE
    settings: tuple[type, ...] = ()
    checks: tuple[Callable[[RunConfig], None], ...] = ()
    wire: tuple[str, ...] = ()
    unseen: bool = False
    linear: LinearVariant | None = None
    deep: bool = True
    personal_state: bool | None = None
    paper: str = ""

    @property
    def personal(self) -> tuple[str, ...]:
        """Model parts kept on the device."""
        return tuple(part for part in MODEL_PARTS if part not in self.shared)

    @property
    def keeps_state(self) -> bool:
        """Whether clients keep anything between rounds (personal parts, mixture
        weights, a personal model, a whole agent): then an exact resume needs it on
        disk."""
        if self.personal_state is not None:
            return self.personal_state
        return self.family != Family.PERSONALIZED or bool(self.personal)

    def strategy_class(self, *, family: str | None = None) -> Any:
        """The strategy class of a run of ``family`` (its linear variant for the linear
        family's runs; the row's own otherwise)."""
        return load(self._variant(family).strategy if self._varies(family) else self.strategy)

    def update_function(self, name: str, family: families.FamilySpec) -> Callable[..., Any] | None:
        """The row's update function ``name`` (``fit``, ``evaluate``, a query's answer)
        for a run of ``family`` (the run's): its own module's (``update_module``), else
        its family's, else None."""
        for module in (self._update_path(family.name), family.update):
            if module:
                found = getattr(importlib.import_module(module), name, None)
                if found is not None:
                    return found
        return None

    def _update_path(self, family: str | None) -> str:
        return self._variant(family).update if self._varies(family) else self.update

    def _varies(self, family: str | None) -> bool:
        return family == LINEAR_FAMILY and self.family != LINEAR_FAMILY

    def _variant(self, family: str | None) -> LinearVariant:
        if self.linear is None:
            raise KeyError(f"algorithm '{self.name}' has no variant for family '{family}'")
        return self.linear


def load(path: str) -> Any:
    """Import ``"module:Name"`` and return the named object."""
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(f"cannot load '{path}' named in the algorithm table: {error}") from error


_TABLE: dict[str, AlgorithmSpec] = {}


def register(spec: AlgorithmSpec, *, replace: bool = False) -> AlgorithmSpec:
    """Add ``spec`` to the table (from a user's package; nothing in fedpers changes).

    Raises
    ------
    ValueError
        If an algorithm of that name exists and ``replace`` is False, or if the row
        names a model part other than ``body``/``head``.
    """
    if _TABLE.get(spec.name) == spec:  # the same row again (an extension loaded twice)
        return spec
    if spec.name in _TABLE and not replace:
        raise ValueError(
            f"algorithm '{spec.name}' is already registered; choose another name or pass "
            "replace=True"
        )
    unknown = sorted(set(spec.shared) | {p for phase in spec.phases for p in phase.parts})
    unknown = [p for p in unknown if p not in MODEL_PARTS]
    if unknown:
        raise ValueError(
            f"algorithm '{spec.name}' names model part(s) {unknown}; parts are {MODEL_PARTS}"
        )
    try:
        families.get(spec.family)
    except KeyError as error:
        raise ValueError(f"algorithm '{spec.name}': {error.args[0]}") from None
    _TABLE[spec.name] = spec
    return spec


# The built-in algorithms are the modules of this package, registered on first use in
# the order of this list (the order of the algorithm table), then any other by name;
# nothing here lists a new one.
FIRST = (
    "fedrep", "fedper", "fedavg", "fedavg_plus", "fedprox", "scaffold", "lg_fedavg",
    "local", "ditto", "apfl", "l2gd", "fed_mtl", "per_fedavg", "pfedme", "pfedme_fedem",
    "clustered_fl", "fedbabu", "fedsgd", "fedem", "fedgmm", "sheaf_frl", "fedproto",
    "sheaf_fmtl", "fedmuscle", "comfed", "non_cooperative",
)  # fmt: skip


@functools.cache
def _load_built_in() -> None:
    found = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    for name in [*(n for n in FIRST if n in found), *(n for n in found if n not in FIRST)]:
        module = importlib.import_module(f"{__name__}.{name}")
        for row in getattr(module, "ROWS", ()):
            if not row.update:
                row = dataclasses.replace(row, update=module.__name__)
            register(row)


# Installed extensions that failed to load: "name = module:function (package P)" -> the
# error, one line. Their rows are missing; every other algorithm works.
BROKEN_EXTENSIONS: dict[str, str] = {}


class _Extensions:
    """``load_extensions``: once per process, thread-safe, re-entrant for an extension
    that asks for the table while it registers."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.loaded = False
        self.loading = False

    def __call__(self) -> None:
        """Call, once per process, every function that installed packages declare in
        the entry-point group ``fedpers.extensions`` (each registers algorithms, data
        sets or models), after the built-in rows.

        An extension that fails (its import or its function raises) is left out with
        one warning naming its entry point and package, and the algorithm rows it
        registered before failing are removed: one broken package does not break the
        runs of every other algorithm. Asking for its algorithm names it (``get``).
        Another thread asking meanwhile waits for the table to be complete (a
        simulation's ServerApp and its ClientApp module load it at once); the loading
        thread itself, inside an extension's function, gets the table so far."""
        if self.loaded:
            return
        with self.lock:
            if self.loaded or self.loading:
                return
            self.loading = True
            try:
                _load_built_in()
                for entry in entry_points(group=ENTRY_POINT_GROUP):
                    _load(entry)
                self.loaded = True
            finally:
                self.loading = False

    def cache_clear(self) -> None:
        """Load again at the next call (tests that install an extension)."""
        self.loaded = False


load_extensions = _Extensions()


def _load(entry: Any) -> None:
    """Run one extension's entry point; on failure, undo its rows and say so once."""
    before = dict(_TABLE)
    try:
        entry.load()()
    except Exception as error:  # any failure of third-party code, kept to one line
        _TABLE.clear()
        _TABLE.update(before)
        package = getattr(entry.dist, "name", None)
        where = f"{entry.name} = {entry.value}" + (f" (package {package})" if package else "")
        first = (str(error).strip().splitlines() or [""])[0]
        BROKEN_EXTENSIONS[where] = f"{type(error).__name__}: {first}".rstrip(": ")
        logging.getLogger(__name__).warning(
            "the fedpers extension %s failed to load and is left out: %s; fix or "
            "uninstall that package",
            where,
            BROKEN_EXTENSIONS[where],
        )


def get(name: str) -> AlgorithmSpec:
    """The row of ``name``.

    Raises
    ------
    KeyError
        With the known names, if ``name`` is not in the table.
    """
    load_extensions()
    try:
        return _TABLE[name]
    except KeyError:
        raise KeyError(
            f"unknown algorithm '{name}'; choose one of: {', '.join(names())}, or register "
            f"your own with fedpers.algorithms.register.{broken_note()}"
        ) from None


def broken_note() -> str:
    """For an unknown algorithm's error: the installed extensions that failed to load
    (its row may be theirs); empty if none did."""
    return "".join(
        f" The extension {where} failed to load ({why}); fix or uninstall that package."
        for where, why in BROKEN_EXTENSIONS.items()
    )


def names() -> list[str]:
    """Every registered algorithm name, built-in ones first."""
    load_extensions()
    return list(_TABLE)


def all_specs() -> list[AlgorithmSpec]:
    """Every registered row."""
    load_extensions()
    return list(_TABLE.values())


def all_groups() -> list[type]:
    """Every settings group the registered rows declare, each once, in table order."""
    return list(dict.fromkeys(group for spec in _TABLE.values() for group in spec.settings))
