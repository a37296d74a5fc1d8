"""A client's own data, built on the device from (data set, partitioner, seed, id).

No data crosses the network: every client regenerates or reads the whole data set,
computes the same deterministic partition, and keeps its own part. Both steps are
cached per process (a Ray actor serves many virtual clients), so the cost is paid once.
The synthetic mixtures go further: each client draws only its own samples.

Two test protocols (run-config key ``test-split``):
- ``dataset`` (FedRep's): training samples come from the data set's training split;
  each client's test samples from its test split, over the client's own classes;
- ``per-client`` (FedEM's and FedGMM's): train and test splits are pooled, partitioned,
  and each client splits its own samples 60/20/20 into train/validation/test. The
  synthetic mixtures and the joint-distribution shift always use it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol, TypeVar

import numpy as np

from fedpers.data.mixture import DATASET as MIXTURE
from fedpers.data.mixture import MixtureDataSettings, MixtureTasks
from fedpers.data.partition import (
    partition_classes,
    partition_dirichlet,
    partition_lognormal,
    partition_shift,
    split_test_like_train,
    target_classes,
)
from fedpers.data.registry import DATASETS
from fedpers.data.shift import joint_shift, parse_transforms, transform_images
from fedpers.data.sources import Dataset, cached_index_lists, load_dataset
from fedpers.seeding import rng

_G = TypeVar("_G")

SPLIT = (0.6, 0.2, 0.2)  # train / validation / test of the per-client protocol
PILOT_SPLIT = (0.8, 0.1, 0.1)  # train / validation / test of the pilot protocol
VALIDATION_SHARE = 0.2  # of a client's training samples, where it has no validation split
_EMPTY = np.zeros((0,), dtype=np.float32)


class DataConfig(Protocol):
    """The run-config attributes that determine every client's data.

    ``fedpers.config.RunConfig`` has them all. Naming them here, read-only, keeps
    ``fedpers.data`` free of the configuration, which validates against it.
    """

    @property
    def dataset(self) -> str: ...
    @property
    def data_root(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def partitioner(self) -> str: ...
    @property
    def num_clients(self) -> int: ...
    @property
    def classes_per_client(self) -> int: ...
    @property
    def dirichlet_alpha(self) -> float: ...
    @property
    def lognormal_sigma(self) -> float: ...
    @property
    def samples_per_client(self) -> int: ...
    @property
    def per_client_split(self) -> bool: ...
    @property
    def evaluate_split(self) -> str: ...
    @property
    def joint_shift(self) -> bool: ...
    @property
    def shift_transforms(self) -> str: ...
    @property
    def shift_fraction(self) -> float: ...
    @property
    def feature_shift(self) -> float: ...
    @property
    def family(self) -> Any: ...  # its FamilySpec (fedpers.families): its pilot_split
    def group(self, cls: type[_G]) -> _G: ...


@dataclass(frozen=True)
class ClientData:
    """Model-ready float32 inputs and int64 labels of one client."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    x_val: np.ndarray = field(default_factory=lambda: _EMPTY)
    y_val: np.ndarray = field(default_factory=lambda: _EMPTY.astype(np.int64))


@dataclass(frozen=True)
class PilotSplit:
    """The pilot protocol of a family that declares it (``FamilySpec.pilot_split``;
    Sheaf-FRL and its baselines): a stratified ``fraction`` of the pooled train and test
    splits is held out as pilots, held by every client; the rest is split over the
    clients by a label shift ``shift`` (``fedpers.data.partition.partition_shift``), and
    each client's part 80/10/10 into train, validation and test."""

    shift: float
    fraction: float


@dataclass(frozen=True)
class DataKey:
    """The run-config fields that determine every client's data, and nothing else."""

    dataset: str
    data_root: str
    seed: int
    partitioner: str
    num_clients: int
    classes_per_client: int
    dirichlet_alpha: float
    lognormal_sigma: float
    samples_per_client: int
    per_client_split: bool
    joint_shift: bool
    shift_transforms: str
    shift_fraction: float
    mixture: MixtureTasks | None
    pilots: PilotSplit | None

    @classmethod
    def of(cls, config: DataConfig) -> DataKey:
        """The data key of a run configuration."""
        mixture = None
        if config.dataset == MIXTURE:
            tasks = config.group(MixtureDataSettings)
            mixture = MixtureTasks(
                dim=tasks.mixture_dim,
                components=tasks.mixture_components,
                alpha=tasks.mixture_alpha,
                covariance=tasks.mixture_covariance,
                labels=tasks.mixture_labels,
                sizes=tasks.mixture_sizes,
                samples=config.samples_per_client,
                seed=config.seed,
            )
        pilot_split = config.family.pilot_split
        return cls(
            dataset=config.dataset,
            data_root=config.data_root,
            seed=config.seed,
            partitioner=config.partitioner,
            num_clients=config.num_clients,
            classes_per_client=config.classes_per_client,
            dirichlet_alpha=config.dirichlet_alpha,
            lognormal_sigma=config.lognormal_sigma,
            samples_per_client=config.samples_per_client,
            per_client_split=config.per_client_split or config.joint_shift,
            joint_shift=config.joint_shift,
            shift_transforms=config.shift_transforms,
            shift_fraction=config.shift_fraction,
            mixture=mixture,
            pilots=None if pilot_split is None else pilot_split(config),
        )


def client_data(
    config: DataConfig, partition_id: int, *, transforms: tuple[str, ...] = ()
) -> ClientData:
    """The train (validation) and test data of client ``partition_id``.

    ``transforms`` (image data only) applies image transforms to the client's raw
    samples before normalization: the out-of-distribution copies of its data. With
    run-config ``evaluate-split = "validation"`` the returned test samples are the
    client's validation samples (``for_validation``), so that every evaluation of the
    run reports validation figures; the test samples are then not returned at all.
    """
    data = _client_data(config, partition_id, transforms=transforms)
    if config.feature_shift:
        data = feature_shifted(data, config.feature_shift, config.seed, partition_id)
    if str(config.evaluate_split) == "validation":
        return for_validation(data, DataKey.of(config).seed, partition_id)
    return data


def feature_shifted(data: ClientData, strength: float, seed: int, partition_id: int) -> ClientData:
    """The client's inputs, every split alike, under its own affine map ``a x + b``:
    contrast ``a = exp(strength z1)`` and brightness ``b = strength z2``, ``z1, z2``
    standard normal drawn from the client's own stream (run-config ``feature-shift``, the
    covariate shift of FedBN's experiments: ``P(x)`` differs between clients, ``P(y | x)``
    does not up to the map). Labels are unchanged."""
    z1, z2 = rng(seed, "feature-shift", partition_id).standard_normal(2)
    a, b = np.float32(np.exp(strength * z1)), np.float32(strength * z2)

    def mapped(x: np.ndarray) -> np.ndarray:
        return (a * x + b).astype(x.dtype) if len(x) else x

    return ClientData(
        mapped(data.x_train),
        data.y_train,
        mapped(data.x_test),
        data.y_test,
        mapped(data.x_val),
        data.y_val,
    )


def for_validation(data: ClientData, seed: int, partition_id: int) -> ClientData:
    """The client's data for choosing settings: its validation samples in place of its
    test samples. A protocol without a validation split (FedRep's ``dataset`` test
    split, MNIST-1D generated per client) holds out a seeded ``VALIDATION_SHARE`` of
    the client's training samples instead, which it then does not train on."""
    if len(data.y_val):
        return ClientData(data.x_train, data.y_train, data.x_val, data.y_val)
    order = rng(seed, "validation-split", partition_id).permutation(len(data.y_train))
    held = int(round(VALIDATION_SHARE * len(order)))
    if len(order) > 1:
        held = min(max(held, 1), len(order) - 1)
    val, train = order[:held], order[held:]
    return ClientData(
        data.x_train[train], data.y_train[train], data.x_train[val], data.y_train[val]
    )


def _client_data(
    config: DataConfig, partition_id: int, *, transforms: tuple[str, ...] = ()
) -> ClientData:
    key = DataKey.of(config)
    if not 0 <= partition_id < key.num_clients:
        raise ValueError(
            f"partition-id {partition_id} is outside 0..{key.num_clients - 1} "
            f"(run config num-clients = {key.num_clients})"
        )
    if key.partitioner == "generated":
        if transforms:
            raise ValueError("image transforms do not apply to MNIST-1D")
        return _generated_client(key, partition_id)
    if key.mixture is not None:
        if transforms:
            raise ValueError("image transforms do not apply to the synthetic mixtures")
        return _mixture_client(key, partition_id)
    dataset = _dataset(key)

    def features(raw: np.ndarray) -> np.ndarray:
        if transforms:
            info = DATASETS[key.dataset]
            if info.image_shape is None:
                raise ValueError(f"dataset='{key.dataset}' has no images to transform")
            raw = transform_images(
                raw, transforms, image_shape=info.image_shape, maximum=info.raw_maximum
            )
        return dataset.features(raw)

    if key.pilots is not None:
        x_all, y_all = _pooled(key)
        mine = pilot_partitions(key)[1][partition_id]
        return _split_per_client(
            features(x_all[mine]), y_all[mine], key.seed, partition_id, split=PILOT_SPLIT
        )
    if key.per_client_split:
        x_all, y_all = _pooled(key)
        mine = pooled_partitions(key)[partition_id]
        return _split_per_client(features(x_all[mine]), y_all[mine], key.seed, partition_id)
    train, test = partitions(key)
    return ClientData(
        x_train=features(dataset.x_train[train[partition_id]]),
        y_train=dataset.y_train[train[partition_id]],
        x_test=features(dataset.x_test[test[partition_id]]),
        y_test=dataset.y_test[test[partition_id]],
    )


def pilot_data(config: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """The pilots of a family with the pilot protocol (``FamilySpec.pilot_split``):
    labelled samples held out of every client's data, held by all."""
    key = DataKey.of(config)
    if key.pilots is None:
        raise ValueError(
            f"family '{config.family.name}' has no pilots (its FamilySpec sets no pilot_split)"
        )
    x_all, y_all = _pooled(key)
    pilots = pilot_partitions(key)[0]
    return _dataset(key).features(x_all[pilots]), y_all[pilots]


def generated_sizes(config: DataConfig | DataKey) -> tuple[int, int]:
    """Train and test sizes of a client of ``partitioner = "generated"``."""
    return config.samples_per_client, max(1, config.samples_per_client // 4)


_GENERATED: dict[tuple[DataKey, int], ClientData] = {}  # per process, about 20 kB a client


def _generated_client(key: DataKey, partition_id: int) -> ClientData:
    """MNIST-1D generated by the client itself: ``classes-per-client`` classes (class
    ``id mod 10`` and random others), ``samples-per-client`` training samples and a
    quarter as many test samples. Cached per process."""
    return _generated_clients(key, [partition_id])[0]


def _generated_clients(key: DataKey, partitions: Sequence[int]) -> list[ClientData]:
    """``_generated_client`` of several clients, those not cached yet generated together
    (``mnist1d_clients``: each from its own seed, the same bits as one at a time)."""
    from fedpers.data.sources import mnist1d_clients

    missing = sorted({p for p in partitions if (key, p) not in _GENERATED})
    chosen = []
    for partition_id in missing:
        others = [c for c in range(10) if c != partition_id % 10]
        drawn = rng(key.seed, "generated-classes", partition_id).permutation(others)
        chosen.append(sorted([partition_id % 10, *drawn[: key.classes_per_client - 1].tolist()]))
    train, test = generated_sizes(key)
    made = mnist1d_clients(key.seed, list(zip(missing, chosen, strict=True)), train, test)
    for partition_id, (x, y, x_test, y_test) in zip(missing, made, strict=True):
        _GENERATED[(key, partition_id)] = ClientData(x, y, x_test, y_test)
    return [_GENERATED[(key, p)] for p in partitions]


def clients_data(config: DataConfig, partitions: Sequence[int]) -> list[ClientData]:
    """``client_data`` of several clients (a cohort's); generated MNIST-1D clients not
    built yet are built together, the same samples as one at a time."""
    key = DataKey.of(config)
    if key.partitioner == "generated":
        _generated_clients(key, [p for p in partitions if 0 <= p < key.num_clients])
    return [client_data(config, p) for p in partitions]


@lru_cache(maxsize=256)
def _mixture_client(key: DataKey, partition_id: int) -> ClientData:
    """A synthetic mixture client's samples, split; cached per process (at most 1,000
    samples a client: 128 kB at 32 dimensions), as every message would draw them anew."""
    assert key.mixture is not None
    x, y, _ = key.mixture.sample(partition_id)
    return _split_per_client(x, y, key.seed, partition_id)


def _split_per_client(
    x: np.ndarray,
    y: np.ndarray,
    seed: int,
    partition_id: int,
    split: tuple[float, float, float] = SPLIT,
) -> ClientData:
    order = rng(seed, "client-split", partition_id).permutation(len(y))
    n_train = int(round(split[0] * len(y)))
    n_val = int(round(split[1] * len(y)))
    train, val, test = np.split(order, [n_train, n_train + n_val])
    return ClientData(x[train], y[train], x[test], y[test], x[val], y[val])


@lru_cache(maxsize=2)
def _dataset(key: DataKey) -> Dataset:
    return load_dataset(
        key.dataset,
        root=key.data_root,
        seed=key.seed,
        train_size=key.num_clients * key.samples_per_client,
    )


def _split_over_clients(key: DataKey, labels: np.ndarray) -> list[np.ndarray]:
    inputs = {
        "partitioner": key.partitioner,
        "num_clients": key.num_clients,
        "classes_per_client": key.classes_per_client,
        "alpha": key.dirichlet_alpha,
        "sigma": key.lognormal_sigma,
        "samples": key.samples_per_client,
        "seed": key.seed,
        "labels": hashlib.sha256(np.ascontiguousarray(labels).tobytes()).hexdigest(),
    }
    return cached_index_lists(
        key.data_root, "partition", inputs, lambda: _compute_split(key, labels)
    )


def _compute_split(key: DataKey, labels: np.ndarray) -> list[np.ndarray]:
    if key.partitioner == "classes":
        return partition_classes(labels, key.num_clients, key.classes_per_client, key.seed)
    if key.partitioner == "dirichlet":
        return partition_dirichlet(labels, key.num_clients, key.dirichlet_alpha, key.seed)
    if key.partitioner == "lognormal":
        return partition_lognormal(
            labels,
            key.num_clients,
            key.classes_per_client,
            mean_size=key.samples_per_client,
            sigma=key.lognormal_sigma,
            seed=key.seed,
        )
    raise ValueError(f"unknown partitioner '{key.partitioner}'")


@lru_cache(maxsize=2)
def partitions(key: DataKey) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Train and test indices of every client, FedRep's protocol (cached per process)."""
    dataset = _dataset(key)
    train = _split_over_clients(key, dataset.y_train)
    test = split_test_like_train([dataset.y_train[i] for i in train], dataset.y_test, key.seed)
    return train, test


@lru_cache(maxsize=2)
def _pooled(key: DataKey) -> tuple[np.ndarray, np.ndarray]:
    """Train and test splits pooled (raw), with the joint shift applied if asked."""
    dataset = _dataset(key)
    x = np.concatenate([dataset.x_train, dataset.x_test])
    y = np.concatenate([dataset.y_train, dataset.y_test])
    if key.joint_shift:
        info = DATASETS[key.dataset]
        assert info.image_shape is not None
        x, y, _ = joint_shift(
            x,
            y,
            names=parse_transforms(key.shift_transforms),
            fraction=key.shift_fraction,
            num_classes=info.num_classes,
            image_shape=info.image_shape,
            maximum=info.raw_maximum,
            seed=key.seed,
        )
    return x, y


@lru_cache(maxsize=2)
def pilot_partitions(key: DataKey) -> tuple[np.ndarray, list[np.ndarray]]:
    """Pilot indices (a stratified ``pilot_fraction`` of the pooled data) and each
    client's indices under the distribution shift ``shift``, into the pooled data."""
    assert key.pilots is not None
    y = _pooled(key)[1]
    generator = rng(key.seed, "pilots")
    pilots = np.sort(
        np.concatenate(
            [
                generator.permutation(np.flatnonzero(y == c))[
                    : int(round(key.pilots.fraction * np.count_nonzero(y == c)))
                ]
                for c in np.unique(y)
            ]
        )
    )
    rest = np.setdiff1d(np.arange(len(y)), pilots)
    targets = target_classes(key.num_clients, DATASETS[key.dataset].num_classes, key.seed)
    parts = partition_shift(y[rest], targets, key.pilots.shift, key.seed)
    return pilots, [rest[p] for p in parts]


@lru_cache(maxsize=2)
def pooled_partitions(key: DataKey) -> list[np.ndarray]:
    """Indices into the pooled data of every client, the per-client protocol."""
    return _split_over_clients(key, _pooled(key)[1])


def adaptation_split(
    data: ClientData, fraction: float, seed: int, partition_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """An unseen client's data pooled and split: (x, y) to adapt on, (x, y) to test on.

    FedGMM's Table 4 protocol: a client that never trained adapts on ``fraction`` of
    its samples and is tested on the rest (``adaptation_test_size`` of them).
    """
    parts = [(data.x_train, data.y_train), (data.x_val, data.y_val), (data.x_test, data.y_test)]
    x = np.concatenate([p[0] for p in parts if len(p[1])])
    y = np.concatenate([p[1] for p in parts if len(p[1])])
    order = rng(seed, "adapt-split", partition_id).permutation(len(y))
    cut = _adaptation_cut(fraction, len(y))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def _adaptation_cut(fraction: float, pooled: int) -> int:
    return int(round(fraction * pooled))


def adaptation_test_size(data: ClientData, fraction: float) -> int:
    """How many samples ``adaptation_split`` tests an unseen client on: what its node
    registers as its test size, which bounds the weight of its test reply."""
    pooled = len(data.y_train) + len(data.y_val) + len(data.y_test)
    return pooled - _adaptation_cut(fraction, pooled)
