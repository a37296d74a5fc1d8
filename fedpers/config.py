"""The run configuration: one schema, parsed once from ``context.run_config``, typed, validated.

Every key is declared once, in the settings group of its concern, with its type, default
and a one-line description (``setting``); each group checks its own keys beside them, and
``RunConfig`` (every group, read flat: ``run.lr``) checks the keys that depend on each
other. The same declarations produce

- the ``[tool.flwr.app.config]`` table of pyproject.toml, which Flower reads and merges
  with ``--run-config`` overrides (``python -m fedpers.config pyproject``; a test keeps
  the file equal to it);
- the configuration reference of README.md (``python -m fedpers.config markdown``);
- the ``--help`` of the scripts' flags that set a key (``simulations.common.config_help``).

The launcher in ``simulations/`` merges overrides itself (``load_run_config``), so that
a bad value stops a run before Flower or Ray start.
"""

# ruff: noqa: RUF009  (setting() returns a dataclasses.Field, which the rule cannot see)

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

from fedpers import algorithms
from fedpers.aggregation import Aggregation
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.data.registry import DATASETS, MODEL_INPUTS
from fedpers.data.shift import TRANSFORMS, parse_transforms
from fedpers.faults import FAULT_KINDS, parse_faults
from fedpers.sheaf import AgentSpec, agent_specs, class_overlap_graph, target_classes

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
SHEAF_DATASETS = ("digits", "mnist")
GMM_ALGORITHM = "fedgmm"  # the one algorithm whose Gaussians model an embedding (gmm-*)

_T = TypeVar("_T")
_DESCRIPTION = "fedpers.description"
_CHOICES = "fedpers.choices"


class ConfigError(ValueError):
    """A run-config value that cannot work; the message names the key and the fix."""


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


class GmmCovariance(StrEnum):
    """Covariance of FedGMM's Gaussian components (``gmm-covariance``)."""

    FULL = "full"
    DIAG = "diag"


class GmmAggregation(StrEnum):
    """How the server combines the clients' Gaussian statistics (``gmm-aggregation``)."""

    EXACT = "exact"
    AVERAGE = "average"


class Embedding(StrEnum):
    """What FedGMM's Gaussians model (``gmm-embedding``)."""

    AUTO = "auto"
    IDENTITY = "identity"
    PCA = "pca"
    RESNET18 = "resnet18"


class MixtureCovariance(StrEnum):
    """Covariance of the synthetic mixtures' components (``fedpers.data.mixture``)."""

    IDENTITY = "identity"
    OFFICIAL = "official"


class MixtureLabels(StrEnum):
    """Labelling directions of the synthetic mixtures (``fedpers.data.mixture``)."""

    DIFFERENCE = "difference"
    RANDOM = "random"


class MixtureSizes(StrEnum):
    """Client sizes of the synthetic mixtures (``fedpers.data.mixture``)."""

    FIXED = "fixed"
    LOGNORMAL = "lognormal"


class SheafVariant(StrEnum):
    """How Sheaf-FRL's agents exchange pilots (``sheaf-variant``)."""

    HETEROGENEOUS = "heterogeneous"
    HOMOGENEOUS = "homogeneous"
    PRIVATE = "private"


def setting(
    default: _T,
    description: str,
    *,
    choices: Callable[[], Sequence[str]] | None = None,
) -> _T:
    """Declare a run-config key: its default and what it means, in one line.

    The key is the attribute name with ``_`` replaced by ``-``, its type the attribute's
    annotation, its group the class that declares it. ``choices`` restricts a plain
    ``str`` key to a list that lives elsewhere and may grow (the registered data sets
    and models); keys with a fixed set of values are ``StrEnum``s instead.
    """
    metadata = {_DESCRIPTION: description, _CHOICES: choices}
    return dataclasses.field(default=default, metadata=metadata)


# ------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class ExperimentSettings:
    """What to run (algorithm, data set, model) and its seed."""

    algorithm: str = setting(
        "fedrep",
        "a row of the algorithm table, `fedpers.algorithms` (README: Algorithms); packages "
        "can register more",
    )
    dataset: str = setting(
        "mnist1d",
        "`mnist`, `femnist`, `cifar10`, `cifar100` are read from `data-root`; the others "
        "are generated or ship with a package",
        choices=lambda: tuple(DATASETS),
    )
    model: str = setting(
        "auto",
        "`auto`: the data set's default; otherwise a model that takes its inputs",
        choices=lambda: ("auto", *MODEL_INPUTS),
    )
    seed: int = setting(0, "every random choice (data, partition, model, sampling, batches)")

    def _check_experiment(self) -> None:
        if self.algorithm not in algorithms.names():
            raise ConfigError(
                f"run-config key 'algorithm' = '{self.algorithm}' is not allowed; choose one "
                f"of: {', '.join(algorithms.names())} (or register your own with "
                "fedpers.algorithms.register)."
            )


@dataclass(frozen=True)
class DataSettings:
    """How the data is made and split over clients."""

    data_root: str = setting(
        "", "local directory of the torchvision data sets (also caches generated data)"
    )
    partitioner: Partitioner = setting(
        Partitioner.CLASSES,
        "`classes`: S classes per client; `dirichlet`; `lognormal`: S classes, log-normal "
        "sizes; `generated`: each MNIST-1D client generates its own",
    )
    num_clients: int = setting(100, "clients = partitions = virtual nodes (agents of Sheaf-FRL)")
    classes_per_client: int = setting(
        2, "S, the classes of a client for `classes`, `lognormal` and `generated`"
    )
    dirichlet_alpha: float = setting(0.5, "concentration of `dirichlet`")
    lognormal_sigma: float = setting(1.0, "spread of the client sizes of `lognormal`")
    samples_per_client: int = setting(
        130,
        "training samples generated per client (MNIST-1D, mixtures); mean size of `lognormal`",
    )
    test_split: TestSplit = setting(
        TestSplit.DATASET,
        "`dataset` (FedRep): test samples from the test split over the client's classes; "
        "`per-client` (FedEM, FedGMM): pool, partition, split each client 60/20/20",
    )
    evaluate_split: EvaluateSplit = setting(
        EvaluateSplit.TEST,
        "what clients evaluate on: `test`, or `validation` to choose settings "
        "(simulations.tune): the per-client protocol's 20%, else 20% of each client's "
        "training samples, held out of its training",
    )
    joint_shift: bool = setting(
        False, "transform a share of an image data set and permute its labels (FedGMM, 4.1)"
    )
    shift_transforms: str = setting(
        "rot90+flip+invert",
        f"the transforms of `joint-shift`: {', '.join(TRANSFORMS)}, combined with `+`",
    )
    shift_fraction: float = setting(0.5, "share of the samples that `joint-shift` transforms")

    def _check_data(self) -> None:
        _at_least("num-clients", self.num_clients, 1)
        _at_least("samples-per-client", self.samples_per_client, 1)
        _positive("dirichlet-alpha", self.dirichlet_alpha)
        _at_least("lognormal-sigma", self.lognormal_sigma, 0.0)
        _within("shift-fraction", self.shift_fraction, "[0, 1]")
        try:
            parse_transforms(self.shift_transforms)
        except ValueError as error:
            raise ConfigError(f"run-config key 'shift-transforms': {error}.") from error


@dataclass(frozen=True)
class MixtureDataSettings:
    """The synthetic mixtures of FedGMM's Section 4.1 (dataset "mixture")."""

    mixture_dim: int = setting(32, "input dimension d")
    mixture_components: int = setting(3, "Gaussian components M")
    mixture_alpha: float = setting(0.4, "Dirichlet concentration of a client's mixture weights")
    mixture_covariance: MixtureCovariance = setting(
        MixtureCovariance.IDENTITY, "`identity` (the paper's text) or `official` (I / sqrt(d))"
    )
    mixture_labels: MixtureLabels = setting(
        MixtureLabels.DIFFERENCE,
        "labelling directions: the `difference` of two means (the authors' code) or `random`",
    )
    mixture_sizes: MixtureSizes = setting(
        MixtureSizes.FIXED,
        "`fixed` (`samples-per-client` each) or `lognormal` (the authors' code)",
    )

    def _check_mixture_data(self) -> None:
        _at_least("mixture-dim", self.mixture_dim, 1)
        _at_least("mixture-components", self.mixture_components, 1)
        _positive("mixture-alpha", self.mixture_alpha)


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
    node_wait_timeout: float = setting(120.0, "seconds to wait for all nodes to register")

    def _check_rounds(self) -> None:
        _at_least("num-rounds", self.num_rounds, 1)
        _at_least("final-rounds", self.final_rounds, 1)
        _at_least("evaluate-every", self.evaluate_every, 0)
        if not 0.0 < self.fraction_train <= 1.0:
            raise ConfigError(
                f"run-config key 'fraction-train' = {self.fraction_train} is outside "
                "(0, 1]; it is the fraction of clients sampled for training each round."
            )
        _positive("round-timeout", self.round_timeout)
        _positive("node-wait-timeout", self.node_wait_timeout)


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

    def _check_training(self) -> None:
        _at_least("epochs", self.epochs, 0)
        _at_least("head-epochs", self.head_epochs, 0)
        _at_least("finetune-epochs", self.finetune_epochs, 0)
        _at_least("batch-size", self.batch_size, 1)
        _positive("lr", self.lr)
        _at_least("momentum", self.momentum, 0.0)
        _at_least("weight-decay", self.weight_decay, 0.0)
        if self.momentum >= 1.0:
            raise ConfigError(f"run-config key 'momentum' = {self.momentum} must be < 1.")


@dataclass(frozen=True)
class ResourceSettings:
    """What a client may use on its machine."""

    client_threads: int = setting(1, "torch threads per ClientApp")
    device: Device = setting(Device.AUTO, "where clients train (`auto`: CUDA when visible)")

    def _check_resources(self) -> None:
        _at_least("client-threads", self.client_threads, 1)


@dataclass(frozen=True)
class FaultSettings:
    """Bad replies, injected faults, checkpoints and resume."""

    min_replies: int = setting(
        1, "usable training replies a round needs, else the run stops cleanly"
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

    def _check_faults(self) -> None:
        _at_least("min-replies", self.min_replies, 1)
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

    def _check_robustness(self) -> None:
        _within("aggregation-trim", self.aggregation_trim, "[0, 0.5)")
        _positive("aggregation-clip", self.aggregation_clip)


@dataclass(frozen=True)
class LinearSettings:
    """Linear representation learning, FedRep's Section 4 (dataset "linear")."""

    linear_dim: int = setting(10, "input dimension d")
    linear_rank: int = setting(2, "representation dimension k, at most d")
    linear_samples: int = setting(5, "fresh samples m per client and round")
    linear_noise_std: float = setting(0.0316, "label noise (the paper's variance 1e-3)")
    linear_lr: float = setting(0.4, "step on B (gradients averaged over samples and clients)")
    linear_head_steps: int = setting(
        0, "steps on the head: 0 solves it by least squares (FedRep); 1: GD-GD; 10: 10GD-GD"
    )
    linear_head_lr: float = setting(0.4, "step on the head when `linear-head-steps` > 0")

    def _check_linear(self) -> None:
        _at_least("linear-dim", self.linear_dim, 1)
        _at_least("linear-rank", self.linear_rank, 1)
        _at_least("linear-samples", self.linear_samples, 1)
        _at_least("linear-head-steps", self.linear_head_steps, 0)
        _at_least("linear-noise-std", self.linear_noise_std, 0.0)
        _positive("linear-lr", self.linear_lr)
        _positive("linear-head-lr", self.linear_head_lr)
        if self.linear_rank > self.linear_dim:
            raise ConfigError(
                f"run-config key 'linear-rank' = {self.linear_rank} exceeds "
                f"'linear-dim' = {self.linear_dim}; the representation is d x k, k <= d."
            )


@dataclass(frozen=True)
class MixtureSettings:
    """Mixtures of learners: FedEM and FedGMM, and their unseen clients."""

    mixture_learners: int = setting(3, "M2 learners of FedEM and FedGMM")
    gmm_components: int = setting(3, "M1 Gaussian components of FedGMM")
    gmm_covariance: GmmCovariance = setting(GmmCovariance.FULL, "covariance of every component")
    gmm_ridge: float = setting(0.01, "ridge added to every covariance")
    gmm_aggregation: GmmAggregation = setting(
        GmmAggregation.EXACT, "`exact`: from pooled statistics; `average`: the paper's"
    )
    gmm_shared_weights: bool = setting(
        False, "clients use the server's weights in their E-step (pure federated EM)"
    )
    gmm_embedding: Embedding = setting(
        Embedding.AUTO,
        "what the Gaussians model; `auto`: `identity` for the mixtures, `pca` for images",
    )
    gmm_embedding_dim: int = setting(16, "dimensions of the pooled PCA (`pca`, `resnet18`)")
    gmm_encoder_weights: str = setting(
        "", "path of a torchvision resnet18 state dict for `resnet18` (never downloaded)"
    )
    unseen_fraction: float = setting(0.0, "share of the clients held out of training")
    adapt_fraction: float = setting(
        0.5, "share of an unseen client's samples it adapts on; it is tested on the rest"
    )

    def _check_mixtures(self) -> None:
        _at_least("mixture-learners", self.mixture_learners, 1)
        _at_least("gmm-components", self.gmm_components, 1)
        _at_least("gmm-embedding-dim", self.gmm_embedding_dim, 1)
        _at_least("gmm-ridge", self.gmm_ridge, 0.0)
        _within("unseen-fraction", self.unseen_fraction, "[0, 1)")
        _within("adapt-fraction", self.adapt_fraction, "(0, 1)")


@dataclass(frozen=True)
class SheafSettings:
    """The Sheaf-FRL algorithms: sheaf-frl and its baseline, non-cooperative."""

    sheaf_shift: float = setting(0.9, "distribution shift s of the agents' data (0: uniform)")
    sheaf_lambda: float = setting(0.1, "weight of the gluing penalty")
    sheaf_pilot_fraction: float = setting(0.1, "share of the data held out as pilots, by all")
    sheaf_pilot_batch: int = setting(64, "pilots K per step")
    sheaf_density: float = setting(0.4, "edge density of the communication graph")
    sheaf_variant: SheafVariant = setting(
        SheafVariant.HETEROGENEOUS, "`homogeneous` and `private` need equal latent dimensions"
    )
    sheaf_latent_dims: str = setting(
        "",
        "comma-separated latent dimension per agent (empty: the paper's x `sheaf-latent-scale`)",
    )
    sheaf_hidden: str = setting(
        "", "comma-separated encoder width per agent (empty: the paper's x `sheaf-latent-scale`)"
    )
    sheaf_latent_scale: float = setting(
        0.125, "scale of the paper's latent dimensions (128...256 -> 16...32)"
    )
    sheaf_clip: float = setting(1.0, "gradient-norm clip of an agent's step (0: none)")

    def _check_sheaf(self) -> None:
        _within("sheaf-shift", self.sheaf_shift, "[0, 1]")
        _within("sheaf-pilot-fraction", self.sheaf_pilot_fraction, "(0, 1)")
        _within("sheaf-density", self.sheaf_density, "(0, 1]")
        _at_least("sheaf-lambda", self.sheaf_lambda, 0.0)
        _at_least("sheaf-pilot-batch", self.sheaf_pilot_batch, 1)
        _positive("sheaf-latent-scale", self.sheaf_latent_scale)
        _at_least("sheaf-clip", self.sheaf_clip, 0.0)
        for key, text in (
            ("sheaf-latent-dims", self.sheaf_latent_dims),
            ("sheaf-hidden", self.sheaf_hidden),
        ):
            try:
                values = _int_list(text)
            except ValueError as error:
                raise ConfigError(
                    f"run-config key '{key}' = '{text}' must be comma-separated integers."
                ) from error
            if any(v < 1 for v in values):
                raise ConfigError(f"run-config key '{key}' = '{text}' must be positive.")


@dataclass(frozen=True)
class OutputSettings:
    """Where a run writes."""

    results_dir: str = setting("results", "directory of the run directories")
    run_name: str = setting("", "the run's directory (empty: `<algorithm>-<dataset>-<time>`)")
    tensorboard: bool = setting(
        False,
        "also write each round's metrics as TensorBoard event files in "
        "`<run directory>/tensorboard` (the `tensorboard` extra)",
    )


# The groups in the order of the docs and of pyproject.toml.
GROUPS: dict[str, type] = {
    "experiment": ExperimentSettings,
    "data": DataSettings,
    "mixture data": MixtureDataSettings,
    "rounds": RoundSettings,
    "training": TrainingSettings,
    "resources": ResourceSettings,
    "faults": FaultSettings,
    "robustness": RobustnessSettings,
    "linear": LinearSettings,
    "mixtures": MixtureSettings,
    "sheaf": SheafSettings,
    "output": OutputSettings,
}


# ---------------------------------------------------------------------- RunConfig
@dataclass(frozen=True)
class RunConfig(  # bases in reverse: dataclasses orders fields from the last base
    OutputSettings,
    SheafSettings,
    MixtureSettings,
    LinearSettings,
    RobustnessSettings,
    FaultSettings,
    ResourceSettings,
    TrainingSettings,
    RoundSettings,
    MixtureDataSettings,
    DataSettings,
    ExperimentSettings,
):
    """Every key of the run config as a typed attribute, validated.

    Attribute names are the keys with ``-`` replaced by ``_``; each is declared, with
    its default and description, in one of the ``GROUPS`` (see README.md,
    "Configuration"). Build it with ``from_mapping`` or ``load_run_config``: the
    constructor does not validate.
    """

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunConfig:
        """Parse and validate a run config (kebab-case keys, TOML scalar values).

        Raises
        ------
        ConfigError
            On a missing or unknown key, a value of the wrong type, or a value outside
            what the key allows. The message names the key and what is allowed.
        """
        every = schema()
        settings = {s.attribute: s for s in every.values()}
        given = {key.replace("-", "_"): value for key, value in values.items()}
        unknown = sorted(set(given) - set(settings))
        if unknown:
            keys = ", ".join(k.replace("_", "-") for k in unknown)
            raise ConfigError(
                f"unknown run-config key(s): {keys}. Every key must exist in "
                "[tool.flwr.app.config] of pyproject.toml."
            )
        # Keys an algorithm declares take its default when absent: a package that
        # registers an algorithm cannot add them to every app's pyproject.
        for key in every.values():
            if key.group == ALGORITHM_GROUP:
                given.setdefault(key.attribute, key.default)
        missing = sorted(set(settings) - set(given))
        if missing:
            keys = ", ".join(k.replace("_", "-") for k in missing)
            raise ConfigError(
                f"run config lacks key(s): {keys}; they are defined in "
                "[tool.flwr.app.config] of pyproject.toml."
            )
        parsed = {name: s.parse(given[name]) for name, s in settings.items()}
        declared = {
            s.key: parsed[s.attribute] for s in every.values() if s.group == ALGORITHM_GROUP
        }
        config = cls(
            **{
                s.attribute: parsed[s.attribute]
                for s in every.values()
                if s.group != ALGORITHM_GROUP
            },
            algorithm_settings=declared,
        )
        config._validate()
        return config

    algorithm_settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Values of the keys that algorithms declare (``AlgorithmSpec.settings``), by key."""

    def setting(self, key: str) -> Any:
        """The value of ``key``, a core key or one an algorithm declares.

        Raises
        ------
        KeyError
            If no registered algorithm declares ``key`` and it is not a core key.
        """
        if key in self.algorithm_settings:
            return self.algorithm_settings[key]
        if key in core_schema():
            return getattr(self, core_schema()[key].attribute)
        raise KeyError(f"run-config key '{key}' is not declared by any registered algorithm")

    def to_mapping(self) -> dict[str, Any]:
        """The run config with its kebab-case keys and plain TOML values (``config.json``)."""
        core = {s.key: _plain(getattr(self, s.attribute)) for s in core_schema().values()}
        return {**core, **self.algorithm_settings}

    # ------------------------------------------------------------------ derived
    @property
    def spec(self) -> AlgorithmSpec:
        """The algorithm's row of the algorithm table."""
        return algorithms.get(self.algorithm)

    @property
    def is_linear(self) -> bool:
        """True for the linear representation-learning tasks of FedRep's Section 4."""
        return self.dataset == "linear"

    @property
    def is_sheaf(self) -> bool:
        """True for the decentralized Sheaf-FRL family (no shared model)."""
        return self.spec.family is Family.SHEAF

    @property
    def model_name(self) -> str:
        """The model, with ``auto`` resolved to the data set's default."""
        return DATASETS[self.dataset].default_model if self.model == "auto" else self.model

    @property
    def num_classes(self) -> int:
        """Number of labels of the data set."""
        return DATASETS[self.dataset].num_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one model input."""
        if self.dataset == "mixture":
            return (self.mixture_dim,)
        if self.dataset == "linear":
            return (self.linear_dim,)
        shape = DATASETS[self.dataset].input_shape
        assert shape is not None
        return shape

    @property
    def embedding(self) -> Embedding:
        """The GMM's input embedding, with ``auto`` resolved: raw vectors of the
        synthetic mixtures, PCA of the pixels for images."""
        if self.gmm_embedding != Embedding.AUTO:
            return Embedding(self.gmm_embedding)
        return Embedding.IDENTITY if self.dataset == "mixture" else Embedding.PCA

    @property
    def per_client_split(self) -> bool:
        """True when each client splits its own data 60/20/20 (FedEM's protocol)."""
        return self.test_split == TestSplit.PER_CLIENT or self.dataset == "mixture"

    @property
    def clients_per_round(self) -> int:
        """Clients sampled for training each round (at least one)."""
        return max(1, round(self.fraction_train * self.num_clients))

    def agent_specs(self) -> list[AgentSpec]:
        """The heterogeneous agents of a Sheaf-FRL run."""
        return agent_specs(
            self.num_clients,
            scale=self.sheaf_latent_scale,
            latent_dims=_int_list(self.sheaf_latent_dims) or None,
            hidden=_int_list(self.sheaf_hidden) or None,
        )

    def sheaf_graph(self) -> list[tuple[int, int]]:
        """The agents' communication graph (oriented edges), the same on every party."""
        return class_overlap_graph(
            target_classes(self.num_clients, self.num_classes, self.seed),
            [spec.latent for spec in self.agent_specs()],
            self.sheaf_density,
        )

    # --------------------------------------------------------------- validation
    def _validate(self) -> None:
        """Each group's own checks, then those of keys that depend on each other."""
        self._check_experiment()
        self._check_data()
        self._check_mixture_data()
        self._check_rounds()
        self._check_training()
        self._check_resources()
        self._check_faults()
        self._check_robustness()
        self._check_linear()
        self._check_mixtures()
        self._check_sheaf()
        self._check_algorithm_fits_data()
        self._check_partition()
        self._check_shift()
        self._check_mixture_run()
        self._check_sheaf_run()
        self._check_resume()
        self._check_algorithm_settings()

    def _check_algorithm_settings(self) -> None:
        for key, setting in algorithms.all_settings().items():
            why = setting.check(self.algorithm_settings[key])
            if why is not None:
                raise ConfigError(
                    f"run-config key '{key}' = {self.algorithm_settings[key]!r} {why}."
                )

    def _check_algorithm_fits_data(self) -> None:
        spec = self.spec
        if self.is_linear:
            if spec.linear is None:
                allowed = [s.name for s in algorithms.all_specs() if s.linear is not None]
                raise ConfigError(
                    f"run-config key 'algorithm' = '{self.algorithm}' has no linear "
                    f"variant; with dataset='linear' choose one of: {', '.join(allowed)}."
                )
            if self.model not in ("auto", "linear"):
                raise ConfigError(
                    f"run-config key 'model' = '{self.model}' does not fit "
                    "dataset='linear'; use model='linear' or 'auto'."
                )
            return
        if not spec.deep:
            raise ConfigError(
                f"run-config key 'algorithm' = '{self.algorithm}' exists only for the "
                "linear model; set dataset='linear' or choose fedavg for deep models."
            )
        data_shape = self.input_shape
        if MODEL_INPUTS[self.model_name] not in (None, data_shape):
            fitting = [m for m, shape in MODEL_INPUTS.items() if shape == data_shape]
            raise ConfigError(
                f"run-config key 'model' = '{self.model}' does not take the inputs of "
                f"dataset='{self.dataset}'; use 'auto' or one of: {', '.join(fitting)}."
            )

    def _check_partition(self) -> None:
        if self.is_linear:  # clients draw fresh samples; nothing is partitioned
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
        if self.joint_shift and DATASETS[self.dataset].image_shape is None:
            images = [n for n, info in DATASETS.items() if info.image_shape is not None]
            raise ConfigError(
                f"run-config key 'joint-shift' = true needs an image data set; "
                f"dataset='{self.dataset}' is not one ({', '.join(images)} are)."
            )

    def _check_mixture_run(self) -> None:
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
        if self.algorithm != GMM_ALGORITHM:
            return
        if self.embedding == Embedding.RESNET18:
            if not self.gmm_encoder_weights:
                raise ConfigError(
                    "run-config key 'gmm-embedding' = 'resnet18' needs 'gmm-encoder-weights': "
                    "the path of a torchvision resnet18 state dict on this machine "
                    "(weights are never downloaded at run time)."
                )
            if not Path(self.gmm_encoder_weights).is_file():
                raise ConfigError(
                    f"run-config key 'gmm-encoder-weights' = '{self.gmm_encoder_weights}' "
                    "is not a file; save a resnet18 state dict there first."
                )
            if DATASETS[self.dataset].image_shape is None:
                raise ConfigError("run-config key 'gmm-embedding' = 'resnet18' needs image data.")
        if self.embedding == Embedding.PCA:
            flat = math.prod(self.input_shape)
            if self.gmm_embedding_dim > flat:
                raise ConfigError(
                    f"run-config key 'gmm-embedding-dim' = {self.gmm_embedding_dim} exceeds "
                    f"the {flat} input dimensions of dataset='{self.dataset}'."
                )

    def _check_resume(self) -> None:
        if self.resume and self.spec.keeps_state and not self.client_state_dir:
            raise ConfigError(
                f"run-config key 'resume' = true, but algorithm '{self.algorithm}' keeps "
                "state on its clients and 'client-state-dir' is empty: the resumed run "
                "would restart every client from scratch. Set 'client-state-dir' (in "
                "simulation; on devices, give each SuperNode --node-config state-dir=...) "
                "in the interrupted run's configuration and in the resumed one."
            )

    def _check_sheaf_run(self) -> None:
        for key, text in (
            ("sheaf-latent-dims", self.sheaf_latent_dims),
            ("sheaf-hidden", self.sheaf_hidden),
        ):
            count = len(_int_list(text))
            if count and count != self.num_clients:
                raise ConfigError(
                    f"run-config key '{key}' lists {count} values for num-clients = "
                    f"{self.num_clients} agents; give one per agent or leave it empty."
                )
        if not self.is_sheaf:
            return
        if self.dataset not in SHEAF_DATASETS:
            raise ConfigError(
                f"run-config key 'dataset' = '{self.dataset}' has no Sheaf-FRL agents; "
                f"choose one of: {', '.join(SHEAF_DATASETS)}."
            )
        if self.num_clients < 2:
            raise ConfigError("Sheaf-FRL needs num-clients >= 2 agents on a graph.")
        dims = {spec.latent for spec in self.agent_specs()}
        if self.sheaf_variant != SheafVariant.HETEROGENEOUS and len(dims) > 1:
            raise ConfigError(
                f"run-config key 'sheaf-variant' = '{self.sheaf_variant}' needs equal latent "
                f"dimensions, found {sorted(dims)}; set 'sheaf-latent-dims' or use 'heterogeneous'."
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
            return int(value)
        if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return value
        raise ConfigError(
            f"run-config key '{self.key}' = {value!r} has type {type(value).__name__}; "
            f"it must be {kind.__name__}."
        )


ALGORITHM_GROUP = "algorithms"  # keys that rows of the algorithm table declare themselves


def schema() -> dict[str, Key]:
    """Every run-config key, by key: the core keys grouped in the order of ``GROUPS``,
    then the keys that registered algorithms declare (``AlgorithmSpec.settings``).
    Installed extensions (``fedpers.algorithms.load_extensions``) are loaded first."""
    algorithms.load_extensions()
    core = core_schema()
    declared = {
        setting.key: Key(
            key=setting.key,
            attribute=setting.key.replace("-", "_"),
            group=ALGORITHM_GROUP,
            kind=type(setting.default),
            default=setting.default,
            description=setting.description,
            choices=setting.choices,
        )
        for setting in algorithms.all_settings().values()
        if setting.key not in core
    }
    return {**core, **declared}


def core_schema() -> dict[str, Key]:
    """The keys every run has, by key, grouped and in the order of ``GROUPS``."""
    settings: dict[str, Key] = {}
    for group, cls in GROUPS.items():
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            allowed = f.metadata[_CHOICES]
            choices: tuple[str, ...] = tuple(allowed()) if allowed is not None else ()
            if issubclass(kind, StrEnum):
                choices = tuple(member.value for member in kind)
            key = f.name.replace("_", "-")
            settings[key] = Key(
                key=key,
                attribute=f.name,
                group=group,
                kind=kind,
                default=f.default,
                description=f.metadata[_DESCRIPTION],
                choices=choices,
            )
    return settings


def schema_defaults() -> dict[str, Any]:
    """Every key's default as a plain TOML value, in the order of ``GROUPS``."""
    return {key: _plain(s.default) for key, s in schema().items()}


def default_run_config(pyproject: Path = PYPROJECT) -> dict[str, Any]:
    """The defaults of ``[tool.flwr.app.config]``, as Flower reads them (for launchers
    and tests); a test keeps them equal to ``schema_defaults()``."""
    with pyproject.open("rb") as handle:
        return dict(tomllib.load(handle)["tool"]["flwr"]["app"]["config"])


def load_run_config(overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Defaults merged with ``overrides`` (kebab-case keys), parsed and validated."""
    merged = default_run_config()
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
    """The configuration reference of README.md: one table per group."""
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
        "pyproject.toml, or the configuration reference of README.md.",
    )
    parser.add_argument("format", choices=("pyproject", "markdown"))
    args = parser.parse_args(argv)
    sys.stdout.write(pyproject_table() if args.format == "pyproject" else markdown_reference())
    return 0


# ----------------------------------------------------------------------- helpers
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _group_summaries() -> dict[str, str]:
    """Every group that has keys, with the first line of its docstring."""
    summaries = {group: _summary(cls) for group, cls in GROUPS.items()}
    if any(key.group == ALGORITHM_GROUP for key in schema().values()):
        summaries[ALGORITHM_GROUP] = (
            "Keys that rows of the algorithm table declare themselves (`fedpers.algorithms`)."
        )
    return summaries


def _summary(cls: type) -> str:
    """The first line of a group's docstring."""
    return (cls.__doc__ or "").strip().splitlines()[0]


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


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _within(key: str, value: float, interval: str) -> None:
    """Check ``value`` against an interval written ``[0, 1)``, ``(0, 1]``, ..."""
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    above = value >= low if interval[0] == "[" else value > low
    below = value <= high if interval[-1] == "]" else value < high
    if not (above and below):
        raise ConfigError(f"run-config key '{key}' = {value} must be in {interval}.")


def _at_least(key: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(f"run-config key '{key}' = {value} must be at least {low}.")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"run-config key '{key}' = {value} must be greater than 0.")


if __name__ == "__main__":
    raise SystemExit(main())
