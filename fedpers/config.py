"""The run configuration: one schema, parsed once from ``context.run_config``, typed, validated.

Every key is declared once, in the settings group of its concern, with its type, default
and a one-line description (``fedpers.settings.setting``); each group checks its own
keys beside them. The core groups, the keys every run has, are declared here;
``RunConfig`` reads them flat (``run.lr``). The groups of a family (``fedpers.families``)
or of a row of the algorithm table (``fedpers.algorithms``) are declared by their
owner, and ``run.group(Cls)`` returns a run's instance of one, typed. ``RunConfig``
checks the keys that depend on each other: each family's cross-checks, then the core's.
The same declarations produce

- the ``[tool.flwr.app.config]`` table of pyproject.toml, which Flower reads and merges
  with ``--run-config`` overrides (``python -m fedpers.config pyproject``; a test keeps
  the file equal to it);
- the configuration reference, docs/configuration.md (``python -m fedpers.config
  markdown``);
- the ``--help`` of the scripts' flags that set a key (``simulations.flags``).

The launcher in ``simulations/`` merges overrides itself (``load_run_config``), so that
a bad value stops a run before Flower or Ray start.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

from fedpers import algorithms, families
from fedpers.aggregation import Aggregation, trim_count, trims_all
from fedpers.algorithms import AlgorithmSpec
from fedpers.data.registry import DATASETS, MODEL_INPUTS, DatasetInfo
from fedpers.data.shift import TRANSFORMS, parse_transforms
from fedpers.families import FamilySpec
from fedpers.faults import FAULT_KINDS, parse_faults
from fedpers.results import run_name_defect
from fedpers.settings import (
    CHOICES,
    DESCRIPTION,
    ConfigError,
    at_least,
    check_group,
    finite,
    positive,
    setting,
    step_size,
    within,
)
from fedpers.settings import summary as group_summary

__all__ = ["ConfigError", "RunConfig", "load_run_config", "setting"]

_G = TypeVar("_G")


# --------------------------------------------------------------------------- modes
class Partitioner(StrEnum):
    """How a data set is split over clients (``partitioner``)."""

    CLASSES = "classes"
    DIRICHLET = "dirichlet"
    LOGNORMAL = "lognormal"
    GENERATED = "generated"


class TestSplit(StrEnum):
    """Where a client's test samples come from (``test-split``)."""

    __test__ = False  # not a pytest test class, despite its name

    DATASET = "dataset"
    PER_CLIENT = "per-client"


class EvaluateSplit(StrEnum):
    """Which of a client's samples its evaluations report (``evaluate-split``)."""

    TEST = "test"
    VALIDATION = "validation"


class LrSchedule(StrEnum):
    """Step size over the rounds (``lr-schedule``)."""

    CONSTANT = "constant"
    MILESTONES = "milestones"


class Device(StrEnum):
    """Where clients train (``device``)."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


# ------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class ExperimentSettings:
    """What to run (algorithm, data set, model) and its seed."""

    algorithm: str = setting(
        "fedrep",
        "a row of the algorithm table, `fedpers.algorithms` (docs/architecture.md); packages "
        "can register more",
    )
    dataset: str = setting(
        "mnist1d",
        "`mnist`, `femnist`, `cifar10`, `cifar100` are read from `data-root`, "
        "`fashion-mnist` from it or (when empty) Debian's package dataset-fashion-mnist; "
        "the others are generated or ship with a package",
        choices=lambda: tuple(DATASETS),
    )
    model: str = setting(
        "auto",
        "`auto`: the data set's default; otherwise a model that takes its inputs",
        choices=lambda: ("auto", *MODEL_INPUTS),
    )
    seed: int = setting(0, "every random choice (data, partition, model, sampling, batches)")

    def check(self) -> None:
        if self.seed < 0:
            raise ConfigError(
                f"run-config key 'seed' = {self.seed} must be 0 or more (every random "
                "stream is keyed by non-negative integers); choose a seed >= 0."
            )
        if self.algorithm not in algorithms.names():
            raise ConfigError(
                f"run-config key 'algorithm' = '{self.algorithm}' is not allowed; choose one "
                f"of: {', '.join(algorithms.names())} (or register your own with "
                f"fedpers.algorithms.register).{algorithms.broken_note()}"
            )


@dataclass(frozen=True)
class DataSettings:
    """How the data is made and split over clients."""

    data_root: str = setting(
        "",
        "local directory of the data sets read from files (also caches generated data)",
    )
    partitioner: Partitioner = setting(
        Partitioner.CLASSES,
        "`classes`: S classes per client; `dirichlet`; `lognormal`: S classes, log-normal "
        "sizes; `generated`: each MNIST-1D client generates its own",
    )
    num_clients: int = setting(
        100, "clients = partitions = virtual nodes (a family may call them agents)"
    )
    classes_per_client: int = setting(
        2, "S, the classes of a client for `classes`, `lognormal` and `generated`"
    )
    dirichlet_alpha: float = setting(0.5, "concentration of `dirichlet`")
    lognormal_sigma: float = setting(1.0, "spread of the client sizes of `lognormal`")
    samples_per_client: int = setting(
        130,
        "training samples generated per client (generated data sets); mean size of `lognormal`",
    )
    test_split: TestSplit = setting(
        TestSplit.DATASET,
        "`dataset` (FedRep): test samples from the test split over the client's classes; "
        "`per-client` (FedEM's protocol): pool, partition, split each client 60/20/20",
    )
    evaluate_split: EvaluateSplit = setting(
        EvaluateSplit.TEST,
        "what clients evaluate on: `test`, or `validation` to choose settings "
        "(simulations.tune): the per-client protocol's 20%, else 20% of each client's "
        "training samples, held out of its training",
    )
    joint_shift: bool = setting(
        False, "transform a share of an image data set and permute its labels (a joint shift)"
    )
    shift_transforms: str = setting(
        "rot90+flip+invert",
        f"the transforms of `joint-shift`: {', '.join(TRANSFORMS)}, combined with `+`",
    )
    shift_fraction: float = setting(0.5, "share of the samples that `joint-shift` transforms")
    feature_shift: float = setting(
        0.0,
        "a feature shift (FedBN's setting): each client's inputs x become a x + b, its own "
        "contrast a = exp(s z1) and brightness b = s z2 (z1, z2 standard normal, drawn per "
        "client), for s = this value; 0: none",
    )

    def check(self) -> None:
        at_least("num-clients", self.num_clients, 1)
        at_least("samples-per-client", self.samples_per_client, 1)
        positive("dirichlet-alpha", self.dirichlet_alpha)
        at_least("lognormal-sigma", self.lognormal_sigma, 0.0)
        within("shift-fraction", self.shift_fraction, "[0, 1]")
        within("feature-shift", self.feature_shift, "[0, 3]")
        try:
            parse_transforms(self.shift_transforms)
        except ValueError as error:
            raise ConfigError(f"run-config key 'shift-transforms': {error}.") from error


@dataclass(frozen=True)
class RoundSettings:
    """Rounds, sampling and evaluation."""

    num_rounds: int = setting(100, "communication rounds")
    fraction_train: float = setting(0.1, "fraction of the clients trained each round")
    final_rounds: int = setting(10, "rounds averaged for the final accuracy")
    evaluate_every: int = setting(
        1,
        "evaluate all clients every this many rounds and in each of the last `final-rounds`; "
        "0: only after the last round",
    )
    round_timeout: float = setting(600.0, "seconds to wait for a round's replies")
    node_wait_timeout: float = setting(
        120.0,
        "seconds to wait for all nodes to register, and (at least `round-timeout`) for "
        "their answers to the start-up queries",
    )

    def check(self) -> None:
        at_least("num-rounds", self.num_rounds, 1)
        at_least("final-rounds", self.final_rounds, 1)
        at_least("evaluate-every", self.evaluate_every, 0)
        if not 0.0 < self.fraction_train <= 1.0:
            raise ConfigError(
                f"run-config key 'fraction-train' = {self.fraction_train} is outside "
                "(0, 1]; it is the fraction of clients sampled for training each round."
            )
        positive("round-timeout", self.round_timeout)
        positive("node-wait-timeout", self.node_wait_timeout)

    @property
    def startup_timeout(self) -> float:
        """Seconds to wait for the answers to a start-up query. A node's first message
        also starts its ClientApp (Ray starts the actor, torch is imported, the data is
        built), which on a loaded machine takes longer than a short round: a run with a
        10 s `round-timeout` on two busy cores lost every node at `query.initial`."""
        return max(self.round_timeout, self.node_wait_timeout)


@dataclass(frozen=True)
class TrainingSettings:
    """Local training of the deep models (a fresh SGD optimizer each round)."""

    epochs: int = setting(5, "local epochs (FedRep: epochs on the body)")
    head_epochs: int = setting(10, "FedRep's epochs on the head, before the body's")
    finetune_epochs: int = setting(10, "FedAvg+FT's epochs on the head after the last round")
    lr: float = setting(0.05, "SGD step size")
    momentum: float = setting(0.5, "SGD momentum, below 1")
    weight_decay: float = setting(0.0001, "SGD weight decay (none on biases)")
    batch_size: int = setting(10, "mini-batch size")
    lr_schedule: LrSchedule = setting(
        LrSchedule.CONSTANT,
        "`milestones`: x0.1 after half the rounds, x0.01 after three quarters",
    )

    def check(self) -> None:
        at_least("epochs", self.epochs, 0)
        at_least("head-epochs", self.head_epochs, 0)
        at_least("finetune-epochs", self.finetune_epochs, 0)
        at_least("batch-size", self.batch_size, 1)
        step_size("lr", self.lr)
        at_least("momentum", self.momentum, 0.0)
        at_least("weight-decay", self.weight_decay, 0.0)
        if self.momentum >= 1.0:
            raise ConfigError(f"run-config key 'momentum' = {self.momentum} must be < 1.")


@dataclass(frozen=True)
class ResourceSettings:
    """What a client may use on its machine."""

    client_threads: int = setting(1, "torch threads per ClientApp")
    device: Device = setting(Device.AUTO, "where clients train (`auto`: CUDA when visible)")

    def check(self) -> None:
        at_least("client-threads", self.client_threads, 1)


class Engine(StrEnum):
    """How a simulation runs its clients (``engine``)."""

    FLOWER = "flower"  # Flower's simulation engine on Ray: one ClientApp call per message
    BATCHED = "batched"  # a round's messages as cohorts, one computation each


@dataclass(frozen=True)
class EngineSettings:
    """How a simulation runs its clients (scripts and `fedpers run`)."""

    engine: Engine = setting(
        Engine.FLOWER,
        "`flower`: Flower's simulation engine on Ray, one ClientApp call per message; "
        "`batched`: the same ServerApp, a round's messages trained as cohorts, one "
        "computation each (fedpers.simulations.batched)",
    )
    cohort_size: int = setting(
        1024, "batched: the most clients of one computation (memory grows with it)"
    )
    cohort_mb: float = setting(
        256.0,
        "batched: the most megabytes of arrays sent to one computation's clients, a "
        "cohort cut at whichever of this and cohort-size comes first (rows that send "
        "many models, or an image model, fill it with few clients)",
    )
    engine_workers: int = setting(
        0,
        "batched: Ray actors the cohorts are sharded over (0: in the script's process; "
        "on a Ray cluster, actors across its machines)",
    )
    engine_threads: int = setting(
        0, "batched: torch threads of each computation (0: the cores it has)"
    )

    def check(self) -> None:
        at_least("cohort-size", self.cohort_size, 1)
        finite("cohort-mb", self.cohort_mb, 0.0, strict=True)
        at_least("engine-workers", self.engine_workers, 0)
        at_least("engine-threads", self.engine_threads, 0)


@dataclass(frozen=True)
class FaultSettings:
    """Bad replies, injected faults, checkpoints and resume."""

    min_replies: int = setting(
        1,
        "usable training replies a round needs; with fewer the run stops cleanly, unless "
        "enough clients answered: then the state sent failed, and the round goes back to "
        "the last state that got enough (a second such round in a row stops the run)",
    )
    fault_injection: str = setting(
        "",
        "make clients misbehave or attack (tests): `kind[=value]:partitions[@round]`, "
        f"comma-separated (fedpers/faults.py); kinds {', '.join(FAULT_KINDS)}",
    )
    client_state_dir: str = setting(
        "", "simulation: clients snapshot their personal state here every round"
    )
    resume: bool = setting(False, "continue the run `run-name` from its last checkpoint")

    def check(self) -> None:
        at_least("min-replies", self.min_replies, 1)
        try:
            parse_faults(self.fault_injection)
        except ValueError as error:
            raise ConfigError(f"run-config key 'fault-injection': {error}.") from error


@dataclass(frozen=True)
class RobustnessSettings:
    """How the server combines the shared parts, against bad or hostile updates."""

    aggregation: Aggregation = setting(
        Aggregation.MEAN,
        "`mean` (FedAvg's, by num-examples), coordinate-wise `trimmed-mean` or `median` "
        "(unweighted), or `clipped-mean` (updates clipped to a multiple of their median "
        "norm); for every algorithm's shared parts",
    )
    aggregation_trim: float = setting(
        0.2, "trimmed-mean: fraction of the values cut at each end, per coordinate"
    )
    aggregation_clip: float = setting(
        2.0, "clipped-mean: largest update norm, in multiples of the round's median norm"
    )
    weight_cap: float = setting(
        10.0,
        "largest weight of one reply (training, responsibilities, evaluation), in "
        "multiples of the lower median of the sizes the nodes registered",
    )
    update_cap: float = setting(
        100.0,
        "largest update norm of one training reply (its shared arrays less those sent, "
        "as one vector), in multiples of the lower median of the round's; beyond it the "
        "reply is left out",
    )
    # 101 voters: the vote costs a few milliseconds per voter; a wrong model wins with
    # probability below 1e-11 where a fifth of the nodes would send it, 3e-4 where a
    # third would, whatever the node count (docs/architecture.md, invariant 4).

    vote_size: int = setting(
        101,
        "nodes that vote on the initial model, drawn afresh by the server's secret "
        "generator (every node where there are no more)",
    )

    def check(self) -> None:
        within("aggregation-trim", self.aggregation_trim, "[0, 0.5)")
        positive("aggregation-clip", self.aggregation_clip)
        at_least("weight-cap", self.weight_cap, 1)
        at_least("update-cap", self.update_cap, 1)
        at_least("vote-size", self.vote_size, 1)


@dataclass(frozen=True)
class UnseenSettings:
    """Unseen clients: held out of training, then adapted and tested after the last round."""

    unseen_fraction: float = setting(0.0, "share of the clients held out of training")
    adapt_fraction: float = setting(
        0.5, "share of an unseen client's samples it adapts on; it is tested on the rest"
    )

    def check(self) -> None:
        within("unseen-fraction", self.unseen_fraction, "[0, 1)")
        within("adapt-fraction", self.adapt_fraction, "(0, 1)")


@dataclass(frozen=True)
class OutputSettings:
    """Where a run writes."""

    results_dir: str = setting("results", "directory of the run directories")
    run_name: str = setting(
        "",
        "the run's directory, one path segment: 1 to 128 of A-Za-z0-9 . _ + -, a letter or "
        "digit first (empty: `<algorithm>-<dataset>-<time>`)",
    )
    tensorboard: bool = setting(
        False,
        "also write each round's metrics as TensorBoard event files in "
        "`<run directory>/tensorboard` (the `tensorboard` extra)",
    )
    publish_dir: str = setting(
        "",
        "also write what may be published, and nothing that says who took part, to "
        "`<publish-dir>/<run-name>/` when the run ends: the final shared model, the "
        "evaluation curves and the privacy guarantee (docs/privacy.md); empty: not",
    )

    def check(self) -> None:
        if self.run_name and (defect := run_name_defect(self.run_name)) is not None:
            raise ConfigError(defect + ".")
        if not self.publish_dir:
            return
        published, results = Path(self.publish_dir).resolve(), Path(self.results_dir).resolve()
        if published == results or results in published.parents:
            raise ConfigError(
                f"run-config key 'publish-dir' = '{self.publish_dir}' lies within "
                f"results-dir = '{self.results_dir}': the publishable set would mix with the "
                "run's own files (fedpers.publish); choose a directory outside results-dir."
            )


# The groups in the order of the docs and of pyproject.toml.


# The core groups, the keys every run has, in the order of the docs and of pyproject.toml.
GROUPS: dict[str, type] = {
    "experiment": ExperimentSettings,
    "data": DataSettings,
    "rounds": RoundSettings,
    "training": TrainingSettings,
    "resources": ResourceSettings,
    "engine": EngineSettings,
    "faults": FaultSettings,
    "robustness": RobustnessSettings,
    "unseen clients": UnseenSettings,
    "output": OutputSettings,
}


def group_heading(group: type) -> str:
    """The heading of a family's or a row's group: its ``HEADING`` if it declares one
    (``FedProxSettings``: ``fedprox``), else from its name: ``ModelDataSettings`` ->
    ``model data``."""
    heading = getattr(group, "HEADING", None)
    if isinstance(heading, str):
        return heading
    name = group.__name__.removesuffix("Settings")
    return re.sub(r"(?<!^)(?=[A-Z])", " ", name).lower()


def declared_groups() -> dict[str, type]:
    """Every group of the schema, by heading: the core's, then each registered family's,
    then those of the rows of the algorithm table (installed extensions loaded first).

    Raises
    ------
    ValueError
        If two different groups would share a heading.
    """
    algorithms.load_extensions()
    found = dict(GROUPS)
    owned = [g for family in families.all_families() for g in family.groups]
    for group in [*owned, *algorithms.all_groups()]:
        heading = group_heading(group)
        if found.setdefault(heading, group) is not group:
            raise ValueError(
                f"settings groups {found[heading].__name__} and {group.__name__} share the "
                f"heading '{heading}'; rename one"
            )
    return found


# ---------------------------------------------------------------------- RunConfig
@dataclass(frozen=True)
class RunConfig(  # bases in reverse: dataclasses orders fields from the last base
    OutputSettings,
    UnseenSettings,
    RobustnessSettings,
    FaultSettings,
    EngineSettings,
    ResourceSettings,
    TrainingSettings,
    RoundSettings,
    DataSettings,
    ExperimentSettings,
):
    """Every key of the run config, typed and validated: the core groups' keys as
    attributes (the keys with ``-`` replaced by ``_``), and the groups that families and
    rows declare through ``group``. Build it with ``from_mapping`` or
    ``load_run_config``: the constructor does not validate.
    """

    groups: Mapping[type, Any] = dataclasses.field(default_factory=dict)
    """The run's instance of every group a family or a row declares, by class."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunConfig:
        """Parse and validate a run config (kebab-case keys, TOML scalar values).

        Keys of the core groups must be present; a key that a family or a row declares
        takes its default when absent (a package that registers one cannot add its keys
        to every app's pyproject).

        Raises
        ------
        ConfigError
            On a missing or unknown key, a value of the wrong type, or a value outside
            what the key allows. The message names the key and what is allowed.
        """
        every = schema()
        settings = {s.attribute: s for s in every.values()}
        given = _by_attribute(values)
        unknown = sorted(set(given) - set(settings))
        if unknown:
            keys = ", ".join(k.replace("_", "-") for k in unknown)
            raise ConfigError(
                f"unknown run-config key(s): {keys}. Every key must exist in "
                "[tool.flwr.app.config] of pyproject.toml."
            )
        core = {s.attribute for s in every.values() if s.group in GROUPS}
        missing = sorted(core - set(given))
        if missing:
            keys = ", ".join(k.replace("_", "-") for k in missing)
            raise ConfigError(
                f"run config lacks key(s): {keys}; they are defined in "
                "[tool.flwr.app.config] of pyproject.toml."
            )
        parsed = {
            name: s.parse(given[name]) if name in given else s.default
            for name, s in settings.items()
        }
        groups = {
            group: group(**{f.name: parsed[f.name] for f in dataclasses.fields(group)})
            for heading, group in declared_groups().items()
            if heading not in GROUPS
        }
        config = cls(**{name: parsed[name] for name in core}, groups=groups)
        config._validate()
        return config

    def group(self, cls: type[_G]) -> _G:
        """The run's instance of the settings group ``cls`` of a family or a row.

        Raises
        ------
        KeyError
            If ``cls`` is not a registered group.
        """
        if cls in self.groups:
            found: _G = self.groups[cls]
            return found
        if cls in declared_groups().values():  # a RunConfig built without from_mapping
            return cls()
        raise KeyError(
            f"{cls.__name__} is not a settings group of any registered family or algorithm"
        )

    def to_mapping(self) -> dict[str, Any]:
        """The run config with its kebab-case keys and plain TOML values (``config.json``)."""
        values: dict[str, Any] = {}
        for heading, group in declared_groups().items():
            owner = self if heading in GROUPS else self.group(group)
            for f in dataclasses.fields(group):
                values[f.name.replace("_", "-")] = _plain(getattr(owner, f.name))
        return values

    # ------------------------------------------------------------------ derived
    @property
    def spec(self) -> AlgorithmSpec:
        """The algorithm's row of the algorithm table."""
        return algorithms.get(self.algorithm)

    @property
    def dataset_info(self) -> DatasetInfo:
        """The static facts of the data set."""
        return DATASETS[self.dataset]

    @property
    def family(self) -> FamilySpec:
        """The run's family: the one its data set binds its runs to, if any
        (``DatasetInfo.run_family``), else its row's."""
        return families.get(self.dataset_info.run_family or self.spec.family)

    @property
    def model_name(self) -> str:
        """The model, with ``auto`` resolved to the data set's default."""
        return self.dataset_info.default_model if self.model == "auto" else self.model

    @property
    def num_classes(self) -> int:
        """Number of labels of the data set."""
        return self.dataset_info.num_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one model input: the data set's, or, where a family's settings set it,
        the family's."""
        for family in families.all_families():
            if family.input_shape is not None and (shape := family.input_shape(self)):
                return shape
        shape = self.dataset_info.input_shape
        assert shape is not None, f"no family sets the input shape of '{self.dataset}'"
        return shape

    @property
    def seen_clients(self) -> int:
        """The clients that train: ``num-clients`` less the unseen ones (the highest ids,
        ``round(unseen-fraction * num-clients)`` of them)."""
        return self.num_clients - round(self.unseen_fraction * self.num_clients)

    @property
    def clients_per_round(self) -> int:
        """The clients a round trains: the family's count where it sets one
        (``FamilySpec.clients_per_round``), else ``max(1, round(fraction-train * seen))``,
        the sampling of ``strategies/base.py``."""
        if self.family.clients_per_round is not None:
            return self.family.clients_per_round(self)
        return max(1, round(self.fraction_train * self.seen_clients))

    @property
    def per_client_split(self) -> bool:
        """True when each client splits its own data 60/20/20 (FedEM's protocol)."""
        return self.test_split == TestSplit.PER_CLIENT or self.dataset_info.per_client_split

    # --------------------------------------------------------------- validation
    def _validate(self) -> None:
        """Each group's own checks, each family's cross-checks, the row's own, then the
        core's."""
        for group in GROUPS.values():
            if hasattr(group, "check"):
                group.check(self)
        for heading, group in declared_groups().items():
            if heading not in GROUPS:
                check_group(self.group(group))
        for family in families.all_families():
            for check in family.checks:
                check(self)
        for check in self.spec.checks:
            check(self)

        self._check_model_fits_data()
        self._check_partition()
        self._check_shift()
        self._check_unseen()
        self._check_sampling()
        self._check_trim()
        self._check_capacity()
        self._check_faults()

    def _check_model_fits_data(self) -> None:
        data_shape = self.input_shape
        if MODEL_INPUTS[self.model_name] not in (None, data_shape):
            fitting = [m for m, shape in MODEL_INPUTS.items() if shape == data_shape]
            raise ConfigError(
                f"run-config key 'model' = '{self.model}' does not take the inputs of "
                f"dataset='{self.dataset}'; use 'auto' or one of: {', '.join(fitting)}."
            )

    def _check_partition(self) -> None:
        if not self.dataset_info.partitioned:  # clients draw fresh samples
            return
        if self.partitioner == Partitioner.GENERATED and self.dataset != "mnist1d":
            raise ConfigError(
                "run-config key 'partitioner' = 'generated' (each client generates its own "
                f"data) exists for dataset='mnist1d' only, not '{self.dataset}'."
            )
        by_classes = (Partitioner.CLASSES, Partitioner.LOGNORMAL, Partitioner.GENERATED)
        if self.partitioner in by_classes and not (
            1 <= self.classes_per_client <= self.num_classes
        ):
            raise ConfigError(
                f"run-config key 'classes-per-client' = {self.classes_per_client} must be "
                f"between 1 and the {self.num_classes} classes of dataset="
                f"'{self.dataset}'."
            )

    def _check_shift(self) -> None:
        if self.joint_shift and self.dataset_info.image_shape is None:
            images = [n for n, info in DATASETS.items() if info.image_shape is not None]
            raise ConfigError(
                f"run-config key 'joint-shift' = true needs an image data set; "
                f"dataset='{self.dataset}' is not one ({', '.join(images)} are)."
            )

    def _check_unseen(self) -> None:
        if self.unseen_fraction > 0 and not self.spec.unseen:
            allowed = sorted(s.name for s in algorithms.all_specs() if s.unseen)
            raise ConfigError(
                f"run-config key 'unseen-fraction' > 0 needs an algorithm that can serve "
                f"unseen clients ({', '.join(allowed)}), not '{self.algorithm}'."
            )
        if self.unseen_fraction > 0 and round(self.unseen_fraction * self.num_clients) < 1:
            raise ConfigError(
                f"run-config key 'unseen-fraction' = {self.unseen_fraction} of "
                f"{self.num_clients} clients leaves no unseen client."
            )
        if self.seen_clients < 1:
            raise ConfigError(
                f"run-config key 'unseen-fraction' = {self.unseen_fraction} holds out all "
                f"{self.num_clients} clients of 'num-clients' = {self.num_clients}, leaving "
                "no seen client to train; lower 'unseen-fraction' or raise 'num-clients'."
            )

    def _check_sampling(self) -> None:
        """A round must be able to reach ``min-replies``: it trains ``clients_per_round``."""
        trained = self.clients_per_round
        if self.min_replies <= trained:
            return
        if self.family.clients_per_round is not None:
            how = f"the '{self.family.name}' family's rounds of 'num-clients' = {self.num_clients}"
        else:
            how = (
                f"'fraction-train' = {self.fraction_train} of the {self.seen_clients} seen "
                f"clients of 'num-clients' = {self.num_clients}"
            )
        raise ConfigError(
            f"run-config key 'min-replies' = {self.min_replies} exceeds the {trained} "
            f"clients a round trains ({how}), so every round would fail; lower "
            f"'min-replies' to at most {trained}, or raise 'fraction-train' or 'num-clients'."
        )

    def _check_capacity(self) -> None:
        """Every client needs a sample: the partitioners (flwr-datasets') refuse more
        partitions than the samples they split. Checked here against the sizes a data
        set declares (``DatasetInfo.train_samples``, ``test_samples``), before Ray
        starts; a data set that grows with the run (MNIST-1D and the synthetic
        families' data sets), a client that generates its own, or a registered data set
        that declares no size has no such bound here. Finer shortfalls that only the
        labels reveal (a class with fewer samples than the clients holding it) are the
        partitioner's to report, where the data is split."""
        info = self.dataset_info
        if (
            not info.partitioned
            or self.partitioner == Partitioner.GENERATED
            or info.train_samples is None
        ):
            return
        pooled = self.per_client_split or self.joint_shift or self.family.pools_splits
        pool = info.train_samples + ((info.test_samples or 0) if pooled else 0)
        split = "train and test splits pooled" if pooled else "training split"
        if self.num_clients > pool:
            raise ConfigError(
                f"run-config key 'num-clients' = {self.num_clients} asks for more clients "
                f"than dataset='{self.dataset}' has samples to split ({pool} samples, its "
                f"{split}); every client needs at least one: lower 'num-clients' to at "
                f"most {pool}, or choose a larger data set."
            )

    def _check_faults(self) -> None:
        """Every partition a fault names exists (ranges are compared, not expanded)."""
        for fault in parse_faults(self.fault_injection):
            if fault.highest >= self.num_clients:
                raise ConfigError(
                    f"run-config key 'fault-injection': entry '{fault.entry}' names "
                    f"partition {fault.highest}, but 'num-clients' = {self.num_clients} "
                    f"has partitions 0..{self.num_clients - 1}; name partitions below "
                    f"{self.num_clients}, or raise 'num-clients'."
                )

    def _check_trim(self) -> None:
        if self.aggregation != Aggregation.TRIMMED_MEAN:
            return
        sampled = self.clients_per_round
        cut = trim_count(sampled, self.aggregation_trim)
        if trims_all(sampled, self.aggregation_trim):
            raise ConfigError(
                f"run-config keys 'aggregation' = 'trimmed-mean' and 'aggregation-trim' = "
                f"{self.aggregation_trim} cut {cut} of the {sampled} replies a round "
                "samples at each end, leaving none: lower aggregation-trim, or raise "
                "fraction-train or num-clients."
            )

    def check_client_state(self) -> None:
        """A resumed *simulated* run of an algorithm that keeps state on its clients
        needs their snapshots (``client-state-dir``). Not part of the key checks: on
        devices the snapshots are in each SuperNode's ``state-dir`` (node config), which
        the resumed run's server checks node by node before its first round
        (``fedpers.strategies.resume``); the simulated ServerApp and the scripts call
        this before anything starts.

        Raises
        ------
        ConfigError
            Naming the key and the fix.
        """
        if self.resume and self.spec.keeps_state and not self.client_state_dir:
            raise ConfigError(
                f"run-config key 'resume' = true, but algorithm '{self.algorithm}' keeps "
                "state on its clients and 'client-state-dir' is empty: the resumed run "
                "would restart every client from scratch. Set 'client-state-dir' in the "
                "interrupted run's configuration and in the resumed one (on devices, "
                "give each SuperNode --node-config state-dir=... instead)."
            )


# ------------------------------------------------------------------------- schema
@dataclass(frozen=True)
class Key:
    """One run-config key as the schema declares it.

    Parameters
    ----------
    key : str
        The kebab-case key (``num-clients``).
    attribute : str
        The ``RunConfig`` attribute (``num_clients``).
    group : str
        The name of its group in ``GROUPS``.
    kind : type
        ``int``, ``float``, ``str``, ``bool``, or a ``StrEnum`` of the allowed values.
    default : Any
        The default, as the attribute holds it.
    description : str
        What the key means, one line.
    choices : tuple of str
        The allowed values (empty: any value of the type).
    """

    key: str
    attribute: str
    group: str
    kind: type
    default: Any
    description: str
    choices: tuple[str, ...]

    @property
    def type_name(self) -> str:
        """The TOML type of the key's values."""
        return "str" if issubclass(self.kind, StrEnum) else self.kind.__name__

    @property
    def toml_default(self) -> str:
        """The default as a TOML literal (``"fedrep"``, ``100``, ``0.5``, ``false``)."""
        return _toml(self.default)

    def parse(self, value: Any) -> Any:
        """``value`` (a TOML scalar) as the attribute's type.

        Raises
        ------
        ConfigError
            On a value of the wrong type, or not among the allowed values.
        """
        if issubclass(self.kind, StrEnum) or self.choices:
            text = self._coerce(value, str)
            if text not in self.choices:
                raise ConfigError(
                    f"run-config key '{self.key}' = '{text}' is not allowed; choose one of: "
                    f"{', '.join(self.choices)}."
                )
            return self.kind(text)
        return self._coerce(value, self.kind)

    def _coerce(self, value: Any, kind: type) -> Any:
        if kind is bool and not isinstance(value, bool):
            raise ConfigError(
                f"run-config key '{self.key}' = {value!r} has type {type(value).__name__}; "
                "it must be bool (true or false)."
            )
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise ConfigError(f"run-config key '{self.key}' = {value} must be a finite number.")
            return float(value)
        if kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            if not INT64[0] <= value <= INT64[1]:
                raise ConfigError(
                    f"run-config key '{self.key}' = {value} does not fit a signed 64-bit "
                    "integer, the largest Flower sends; give a smaller value."
                )
            return value
        if isinstance(value, str) and "\x00" in value:
            raise ConfigError(
                f"run-config key '{self.key}' = {value!r} holds a NUL character, which no "
                "path or name can hold; remove it."
            )
        if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return value
        raise ConfigError(
            f"run-config key '{self.key}' = {value!r} has type {type(value).__name__}; "
            f"it must be {kind.__name__}."
        )


INT64 = (-(2**63), 2**63 - 1)  # what an int run-config value may be (Flower's wire)


def schema() -> dict[str, Key]:
    """Every run-config key, by key, in the order of ``declared_groups``: the core's,
    the families' and the rows' (installed extensions are loaded first). Keys whose
    values live in a registry (the data sets, the models) allow what it holds now."""
    groups = tuple(declared_groups().items())
    choices = tuple(
        tuple(allowed()) if (allowed := f.metadata[CHOICES]) is not None else ()
        for _, group in groups
        for f in dataclasses.fields(group)
    )
    return dict(_schema(groups, choices))


@functools.cache
def _schema(
    groups: tuple[tuple[str, type], ...], choices: tuple[tuple[str, ...], ...]
) -> dict[str, Key]:
    settings: dict[str, Key] = {}
    fields = [(heading, group, f) for heading, group in groups for f in dataclasses.fields(group)]
    for (heading, cls, f), allowed in zip(fields, choices, strict=True):
        kind = _hints(cls)[f.name]
        if issubclass(kind, StrEnum):
            allowed = tuple(member.value for member in kind)
        key = f.name.replace("_", "-")
        if key in settings:
            raise ValueError(
                f"run-config key '{key}' is declared by both group "
                f"'{settings[key].group}' and group '{heading}'; rename one"
            )
        settings[key] = Key(
            key=key,
            attribute=f.name,
            group=heading,
            kind=kind,
            default=f.default,
            description=f.metadata[DESCRIPTION],
            choices=allowed,
        )
    return settings


def core_schema() -> dict[str, Key]:
    """The keys every run has, by key, grouped and in the order of ``GROUPS``."""
    return {key: s for key, s in schema().items() if s.group in GROUPS}


def schema_defaults() -> dict[str, Any]:
    """Every key's default as a plain TOML value, in the order of the schema."""
    return {key: _plain(s.default) for key, s in schema().items()}


def default_run_config(pyproject: Path) -> dict[str, Any]:
    """The defaults of ``[tool.flwr.app.config]`` of an app's ``pyproject``, as Flower
    reads them; a test keeps fedpers' own equal to ``schema_defaults()``.

    Raises
    ------
    ConfigError
        If the file has no such table, or a table on the way is not one.
    """
    with pyproject.open("rb") as handle:
        document = tomllib.load(handle)
    if "tool" not in document:
        raise ConfigError(f"{pyproject} has no [tool.flwr.app.config] table.")
    return dict(run_config_table(document, str(pyproject)))


CONFIG_TABLE = ("tool", "flwr", "app", "config")


def run_config_table(document: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    """The run-config keys of a parsed TOML file: its ``[tool.flwr.app.config]`` table
    where it has ``tool``, else its top-level keys (a ``conf/*.toml`` file).

    Raises
    ------
    ConfigError
        If the file has ``tool`` and ``tool``, ``tool.flwr``, ``tool.flwr.app`` or
        ``tool.flwr.app.config`` is missing or not a table, naming it and the file.
    """
    if "tool" not in document:
        return document
    table: Any = document
    for depth, name in enumerate(CONFIG_TABLE):
        if name not in table:
            raise ConfigError(
                f"{source}: '{'.'.join(CONFIG_TABLE[:depth])}' has no '{name}'; put the "
                "run-config keys in a [tool.flwr.app.config] table, or at the top level "
                "of the file without a 'tool' key."
            )
        table = table[name]
        if not isinstance(table, dict):
            dotted = ".".join(CONFIG_TABLE[: depth + 1])
            raise ConfigError(
                f"{source}: '{dotted}' is {_toml_kind(table)}, not a table; put the "
                "run-config keys in a [tool.flwr.app.config] table, or at the top level "
                "of the file without a 'tool' key."
            )
    return table


def load_run_config(overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """The schema's defaults merged with ``overrides`` (kebab-case keys), parsed and
    validated. Reads no file: it works wherever fedpers is installed."""
    merged = schema_defaults()
    for key, value in (overrides or {}).items():
        if key not in merged:
            raise ConfigError(
                f"unknown run-config key '{key}'; known keys: {', '.join(sorted(merged))}."
            )
        merged[key] = value
    return RunConfig.from_mapping(merged)


# -------------------------------------------------------------------- renderings
def pyproject_table() -> str:
    """The ``[tool.flwr.app.config]`` table of pyproject.toml: every key and its default,
    a comment heading each group."""
    blocks = []
    for group, summary in _group_summaries().items():
        summary = summary.rstrip(".")
        lines = [f"# {group}: {summary[0].lower()}{summary[1:]}"]
        lines += [f"{s.key} = {s.toml_default}" for s in schema().values() if s.group == group]
        blocks.append("\n".join(lines))
    return "[tool.flwr.app.config]\n" + "\n\n".join(blocks) + "\n"


def markdown_reference() -> str:
    """The configuration reference of docs/configuration.md: one table per group."""
    blocks = []
    for group, summary in _group_summaries().items():
        rows = [
            f"### {group.capitalize()}",
            "",
            summary,
            "",
            "| key | type | default | allowed | description |",
            "|---|---|---|---|---|",
        ]
        for s in schema().values():
            if s.group == group:
                allowed = ", ".join(f"`{choice}`" for choice in s.choices)
                description = s.description.replace("|", "\\|")
                rows.append(
                    f"| `{s.key}` | {s.type_name} | `{s.toml_default}` | {allowed} | "
                    f"{description} |"
                )
        blocks.append("\n".join(rows))
    return "\n\n".join(blocks) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedpers.config {pyproject,markdown}``: print a rendering of the schema."""
    parser = argparse.ArgumentParser(
        prog="python -m fedpers.config",
        description="Print the run-config schema: the [tool.flwr.app.config] table of "
        "pyproject.toml, or the configuration reference of docs/configuration.md.",
    )
    parser.add_argument("format", choices=("pyproject", "markdown"))
    args = parser.parse_args(argv)
    sys.stdout.write(pyproject_table() if args.format == "pyproject" else markdown_reference())
    return 0


# ----------------------------------------------------------------------- helpers
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _by_attribute(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` by attribute name (``num-clients`` and ``num_clients`` -> ``num_clients``).

    Raises
    ------
    ConfigError
        If two keys name one attribute: which value is meant cannot be told.
    """
    given: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in values.items():
        attribute = key.replace("-", "_")
        if attribute in spelled:
            raise ConfigError(
                f"run-config keys '{spelled[attribute]}' and '{key}' name the same setting; "
                f"give it once (as '{attribute.replace('_', '-')}')."
            )
        spelled[attribute] = key
        given[attribute] = value
    return given


def _toml_kind(value: Any) -> str:
    """What a TOML value is, with its article: ``a str``, ``an int``, ``an array``."""
    names = {str: "a str", bool: "a bool", int: "an int", float: "a float", list: "an array"}
    return names.get(type(value), f"a {type(value).__name__}")


def _group_summaries() -> dict[str, str]:
    """Every group, by heading, with the first line of its docstring."""
    return {heading: group_summary(cls) for heading, cls in declared_groups().items()}


def _plain(value: Any) -> Any:
    """A StrEnum member as its plain string; any other value unchanged."""
    return value.value if isinstance(value, Enum) else value


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(_plain(value))
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


if __name__ == "__main__":
    raise SystemExit(main())
