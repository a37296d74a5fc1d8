"""The run configuration: parsed once from ``context.run_config``, typed, validated.

Defaults live in exactly one place, ``[tool.flwr.app.config]`` in pyproject.toml.
Flower merges them with ``--run-config`` overrides before the apps see them; the
launcher in ``simulations/`` merges them itself (``default_run_config``) so that a bad
value stops a run before Flower or Ray start.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpers.data.mixture import COVARIANCES, LABELLINGS, SIZES
from fedpers.data.registry import DATASETS, MODEL_INPUTS
from fedpers.data.shift import parse_transforms
from fedpers.protocol import (
    LINEAR_ALGORITHMS,
    LINEAR_ONLY,
    MIXTURE_ALGORITHMS,
    SHEAF_ALGORITHMS,
    Algorithm,
)
from fedpers.sheaf import AgentSpec, agent_specs, class_overlap_graph, target_classes

PARTITIONERS = ("classes", "dirichlet", "lognormal", "generated")
TEST_SPLITS = ("dataset", "per-client")
LR_SCHEDULES = ("constant", "milestones")
EMBEDDINGS = ("auto", "identity", "pca", "resnet18")
UNSEEN_ALGORITHMS = frozenset({Algorithm.FEDGMM, Algorithm.FEDEM, Algorithm.FEDAVG})
SHEAF_VARIANTS = ("heterogeneous", "homogeneous", "private")
SHEAF_DATASETS = ("digits", "mnist")
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


class ConfigError(ValueError):
    """A run-config value that cannot work; the message names the key and the fix."""


@dataclass(frozen=True)
class RunConfig:
    """Every key of ``[tool.flwr.app.config]`` as a typed attribute.

    Attribute names are the keys with ``-`` replaced by ``_``. See README.md
    ("Configuration") for what each key means.
    """

    algorithm: str
    dataset: str
    model: str
    data_root: str
    partitioner: str
    num_clients: int
    classes_per_client: int
    dirichlet_alpha: float
    lognormal_sigma: float
    samples_per_client: int
    test_split: str
    num_rounds: int
    fraction_train: float
    final_rounds: int
    round_timeout: float
    node_wait_timeout: float
    epochs: int
    head_epochs: int
    finetune_epochs: int
    lr: float
    momentum: float
    weight_decay: float
    batch_size: int
    lr_schedule: str
    client_threads: int
    device: str
    evaluate_every: int
    min_replies: int
    fault_injection: str
    client_state_dir: str
    resume: bool
    linear_dim: int
    linear_rank: int
    linear_samples: int
    linear_noise_std: float
    linear_lr: float
    linear_head_steps: int
    linear_head_lr: float
    mixture_learners: int
    gmm_components: int
    gmm_covariance: str
    gmm_ridge: float
    gmm_aggregation: str
    gmm_shared_weights: bool
    gmm_embedding: str
    gmm_embedding_dim: int
    gmm_encoder_weights: str
    unseen_fraction: float
    adapt_fraction: float
    mixture_dim: int
    mixture_components: int
    mixture_alpha: float
    mixture_covariance: str
    mixture_labels: str
    mixture_sizes: str
    joint_shift: bool
    shift_transforms: str
    shift_fraction: float
    sheaf_shift: float
    sheaf_lambda: float
    sheaf_pilot_fraction: float
    sheaf_pilot_batch: int
    sheaf_density: float
    sheaf_variant: str
    sheaf_latent_dims: str
    sheaf_hidden: str
    sheaf_latent_scale: float
    sheaf_clip: float
    seed: int
    results_dir: str
    run_name: str

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunConfig:
        """Parse and validate a run config (kebab-case keys, TOML scalar values).

        Raises
        ------
        ConfigError
            On a missing or unknown key, a value of the wrong type, or a value outside
            what the key allows. The message names the key and what is allowed.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        given = {key.replace("-", "_"): value for key, value in values.items()}
        unknown = sorted(set(given) - set(fields))
        if unknown:
            keys = ", ".join(k.replace("_", "-") for k in unknown)
            raise ConfigError(
                f"unknown run-config key(s): {keys}. Every key must exist in "
                "[tool.flwr.app.config] of pyproject.toml."
            )
        missing = sorted(set(fields) - set(given))
        if missing:
            keys = ", ".join(k.replace("_", "-") for k in missing)
            raise ConfigError(
                f"run config lacks key(s): {keys}; they are defined in "
                "[tool.flwr.app.config] of pyproject.toml."
            )
        kwargs = {name: _coerce(name, given[name], f.type) for name, f in fields.items()}
        config = cls(**kwargs)
        config._validate()
        return config

    # ------------------------------------------------------------------ derived
    @property
    def is_linear(self) -> bool:
        """True for the linear representation-learning tasks of FedRep's Section 4."""
        return self.dataset == "linear"

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
    def embedding(self) -> str:
        """The GMM's input embedding, with ``auto`` resolved: raw vectors of the
        synthetic mixtures, PCA of the pixels for images."""
        if self.gmm_embedding != "auto":
            return self.gmm_embedding
        return "identity" if self.dataset == "mixture" else "pca"

    @property
    def per_client_split(self) -> bool:
        """True when each client splits its own data 60/20/20 (FedEM's protocol)."""
        return self.test_split == "per-client" or self.dataset == "mixture"

    @property
    def clients_per_round(self) -> int:
        """Clients sampled for training each round (at least one)."""
        return max(1, round(self.fraction_train * self.num_clients))

    def to_mapping(self) -> dict[str, Any]:
        """The run config with its original kebab-case keys (for ``config.json``)."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in dataclasses.fields(self)}

    # --------------------------------------------------------------- validation
    def _validate(self) -> None:
        _one_of("algorithm", self.algorithm, [a.value for a in Algorithm])
        _one_of("dataset", self.dataset, list(DATASETS))
        _one_of("model", self.model, ["auto", *MODEL_INPUTS])
        _one_of("partitioner", self.partitioner, list(PARTITIONERS))
        _one_of("test-split", self.test_split, list(TEST_SPLITS))
        _one_of("lr-schedule", self.lr_schedule, list(LR_SCHEDULES))
        _at_least("num-clients", self.num_clients, 1)
        _at_least("num-rounds", self.num_rounds, 1)
        _at_least("final-rounds", self.final_rounds, 1)
        _at_least("epochs", self.epochs, 0)
        _at_least("head-epochs", self.head_epochs, 0)
        _at_least("finetune-epochs", self.finetune_epochs, 0)
        _at_least("batch-size", self.batch_size, 1)
        _at_least("client-threads", self.client_threads, 1)
        _one_of("device", self.device, ["auto", "cpu", "cuda"])
        _at_least("evaluate-every", self.evaluate_every, 0)
        _at_least("min-replies", self.min_replies, 1)
        try:
            parse_faults(self.fault_injection)
        except ValueError as error:
            raise ConfigError(f"run-config key 'fault-injection': {error}.") from error
        _at_least("samples-per-client", self.samples_per_client, 1)
        if not 0.0 < self.fraction_train <= 1.0:
            raise ConfigError(
                f"run-config key 'fraction-train' = {self.fraction_train} is outside "
                "(0, 1]; it is the fraction of clients sampled for training each round."
            )
        for key in ("lr", "round-timeout", "node-wait-timeout", "dirichlet-alpha"):
            _positive(key, getattr(self, key.replace("-", "_")))
        for key in ("momentum", "weight-decay", "lognormal-sigma"):
            _at_least(key, getattr(self, key.replace("-", "_")), 0.0)
        if self.momentum >= 1.0:
            raise ConfigError(f"run-config key 'momentum' = {self.momentum} must be < 1.")
        self._validate_mixtures()
        self._validate_sheaf()

        algorithm = Algorithm(self.algorithm)
        if self.is_linear:
            if algorithm not in LINEAR_ALGORITHMS:
                allowed = ", ".join(sorted(a.value for a in LINEAR_ALGORITHMS))
                raise ConfigError(
                    f"run-config key 'algorithm' = '{self.algorithm}' has no linear "
                    f"variant; with dataset='linear' choose one of: {allowed}."
                )
            if self.model not in ("auto", "linear"):
                raise ConfigError(
                    f"run-config key 'model' = '{self.model}' does not fit "
                    "dataset='linear'; use model='linear' or 'auto'."
                )
            self._validate_linear()
            return
        if algorithm in LINEAR_ONLY:
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
        if self.partitioner == "generated" and self.dataset != "mnist1d":
            raise ConfigError(
                "run-config key 'partitioner' = 'generated' (each client generates its own "
                f"data) exists for dataset='mnist1d' only, not '{self.dataset}'."
            )
        if self.partitioner in ("classes", "lognormal", "generated") and not (
            1 <= self.classes_per_client <= self.num_classes
        ):
            raise ConfigError(
                f"run-config key 'classes-per-client' = {self.classes_per_client} must be "
                f"between 1 and the {self.num_classes} classes of dataset="
                f"'{self.dataset}'."
            )

    def _validate_mixtures(self) -> None:
        algorithm = Algorithm(self.algorithm)
        for key in (
            "mixture-learners",
            "gmm-components",
            "gmm-embedding-dim",
            "mixture-dim",
        ):
            _at_least(key, getattr(self, key.replace("-", "_")), 1)
        _at_least("mixture-components", self.mixture_components, 1)
        _at_least("gmm-ridge", self.gmm_ridge, 0.0)
        _positive("mixture-alpha", self.mixture_alpha)
        _one_of("gmm-covariance", self.gmm_covariance, ["full", "diag"])
        _one_of("gmm-aggregation", self.gmm_aggregation, ["exact", "average"])
        _one_of("gmm-embedding", self.gmm_embedding, list(EMBEDDINGS))
        _one_of("mixture-covariance", self.mixture_covariance, list(COVARIANCES))
        _one_of("mixture-labels", self.mixture_labels, list(LABELLINGS))
        _one_of("mixture-sizes", self.mixture_sizes, list(SIZES))
        if not 0.0 <= self.unseen_fraction < 1.0:
            raise ConfigError(
                f"run-config key 'unseen-fraction' = {self.unseen_fraction} must be in [0, 1)."
            )
        if self.unseen_fraction > 0 and algorithm not in UNSEEN_ALGORITHMS:
            allowed = ", ".join(sorted(a.value for a in UNSEEN_ALGORITHMS))
            raise ConfigError(
                f"run-config key 'unseen-fraction' > 0 needs an algorithm that can serve "
                f"unseen clients ({allowed}), not '{self.algorithm}'."
            )
        if self.unseen_fraction > 0 and round(self.unseen_fraction * self.num_clients) < 1:
            raise ConfigError(
                f"run-config key 'unseen-fraction' = {self.unseen_fraction} of "
                f"{self.num_clients} clients leaves no unseen client."
            )
        if not 0.0 < self.adapt_fraction < 1.0:
            raise ConfigError(
                f"run-config key 'adapt-fraction' = {self.adapt_fraction} must be in (0, 1)."
            )
        if not 0.0 <= self.shift_fraction <= 1.0:
            raise ConfigError(
                f"run-config key 'shift-fraction' = {self.shift_fraction} must be in [0, 1]."
            )
        try:
            parse_transforms(self.shift_transforms)
        except ValueError as error:
            raise ConfigError(f"run-config key 'shift-transforms': {error}.") from error
        if self.joint_shift and DATASETS[self.dataset].image_shape is None:
            images = [n for n, info in DATASETS.items() if info.image_shape is not None]
            raise ConfigError(
                f"run-config key 'joint-shift' = true needs an image data set; "
                f"dataset='{self.dataset}' is not one ({', '.join(images)} are)."
            )
        if algorithm in MIXTURE_ALGORITHMS and self.is_linear:
            raise ConfigError(
                f"run-config key 'algorithm' = '{self.algorithm}' has no linear variant."
            )
        if algorithm is Algorithm.FEDGMM and self.embedding == "resnet18":
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
        if algorithm is Algorithm.FEDGMM and self.embedding == "pca":
            flat = math.prod(self.input_shape)
            if self.gmm_embedding_dim > flat:
                raise ConfigError(
                    f"run-config key 'gmm-embedding-dim' = {self.gmm_embedding_dim} exceeds "
                    f"the {flat} input dimensions of dataset='{self.dataset}'."
                )

    @property
    def is_sheaf(self) -> bool:
        """True for the decentralized Sheaf-FRL family (no shared model)."""
        return Algorithm(self.algorithm) in SHEAF_ALGORITHMS

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

    def _validate_sheaf(self) -> None:
        if not 0.0 <= self.sheaf_shift <= 1.0:
            raise ConfigError(
                f"run-config key 'sheaf-shift' = {self.sheaf_shift} must be in [0, 1]."
            )
        if not 0.0 < self.sheaf_pilot_fraction < 1.0:
            raise ConfigError(
                f"run-config key 'sheaf-pilot-fraction' = {self.sheaf_pilot_fraction} "
                "must be in (0, 1)."
            )
        if not 0.0 < self.sheaf_density <= 1.0:
            raise ConfigError(
                f"run-config key 'sheaf-density' = {self.sheaf_density} must be in (0, 1]."
            )
        _at_least("sheaf-lambda", self.sheaf_lambda, 0.0)
        _at_least("sheaf-pilot-batch", self.sheaf_pilot_batch, 1)
        _positive("sheaf-latent-scale", self.sheaf_latent_scale)
        _one_of("sheaf-variant", self.sheaf_variant, list(SHEAF_VARIANTS))
        for key in ("sheaf-latent-dims", "sheaf-hidden"):
            text = getattr(self, key.replace("-", "_"))
            try:
                values = _int_list(text)
            except ValueError as error:
                raise ConfigError(
                    f"run-config key '{key}' = '{text}' must be comma-separated integers."
                ) from error
            if values and len(values) != self.num_clients:
                raise ConfigError(
                    f"run-config key '{key}' lists {len(values)} values for num-clients = "
                    f"{self.num_clients} agents; give one per agent or leave it empty."
                )
            if any(v < 1 for v in values):
                raise ConfigError(f"run-config key '{key}' = '{text}' must be positive.")
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
        if self.sheaf_variant != "heterogeneous" and len(dims) > 1:
            raise ConfigError(
                f"run-config key 'sheaf-variant' = '{self.sheaf_variant}' needs equal latent "
                f"dimensions, found {sorted(dims)}; set 'sheaf-latent-dims' or use 'heterogeneous'."
            )

    def _validate_linear(self) -> None:
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


def default_run_config(pyproject: Path = PYPROJECT) -> dict[str, Any]:
    """The defaults of ``[tool.flwr.app.config]`` (for launchers and tests)."""
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


# ----------------------------------------------------------------------- helpers
def _coerce(name: str, value: Any, annotation: Any) -> Any:
    key = name.replace("_", "-")
    kind = {"int": int, "float": float, "str": str, "bool": bool}[str(annotation)]
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(
            f"run-config key '{key}' = {value!r} has type {type(value).__name__}; "
            "it must be bool (true or false)."
        )
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(float(value)):
            raise ConfigError(f"run-config key '{key}' = {value} must be a finite number.")
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise ConfigError(
        f"run-config key '{key}' = {value!r} has type {type(value).__name__}; "
        f"it must be {kind.__name__}."
    )


FAULT_KINDS = ("raise", "sleep", "nan", "shape", "dtype")


def parse_faults(spec: str) -> list[tuple[str, int, int | None]]:
    """``"raise:3@2,nan:5"`` -> ``[("raise", 3, 2), ("nan", 5, None)]`` (clients/faults.py)."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, _, target = item.partition(":")
        partition, _, at = target.partition("@")
        if kind not in FAULT_KINDS or not partition.isdigit() or (at and not at.isdigit()):
            raise ValueError(
                f"entry '{item}' is not kind:partition[@round], kind one of "
                f"{', '.join(FAULT_KINDS)}"
            )
        faults.append((kind, int(partition), int(at) if at else None))
    return faults


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _one_of(key: str, value: str, allowed: list[str]) -> None:
    if value not in allowed:
        raise ConfigError(
            f"run-config key '{key}' = '{value}' is not allowed; choose one of: "
            f"{', '.join(allowed)}."
        )


def _at_least(key: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(f"run-config key '{key}' = {value} must be at least {low}.")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"run-config key '{key}' = {value} must be greater than 0.")
