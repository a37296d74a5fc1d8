"""A client's own data, built on the device from (data set, partitioner, seed, id).

No data crosses the network: every client regenerates or reads the whole data set,
computes the same deterministic partition, and keeps its own part. Both steps are
cached per process (a Ray actor serves many virtual clients), so the cost is paid once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from fedpers.config import RunConfig
from fedpers.data.partition import (
    partition_classes,
    partition_dirichlet,
    partition_lognormal,
    split_test_like_train,
)
from fedpers.data.sources import Dataset, load_dataset

@dataclass(frozen=True)
class ClientData:
    """Model-ready float32 inputs and int64 labels of one client."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


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

    @classmethod
    def of(cls, config: RunConfig) -> DataKey:
        """The data key of a run configuration."""
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
        )


def client_data(config: RunConfig, partition_id: int) -> ClientData:
    """The train and test data of client ``partition_id``."""
    key = DataKey.of(config)
    if not 0 <= partition_id < key.num_clients:
        raise ValueError(
            f"partition-id {partition_id} is outside 0..{key.num_clients - 1} "
            f"(run config num-clients = {key.num_clients})"
        )
    dataset = _dataset(key)
    train, test = partitions(key)
    return ClientData(
        x_train=dataset.features(dataset.x_train[train[partition_id]]),
        y_train=dataset.y_train[train[partition_id]],
        x_test=dataset.features(dataset.x_test[test[partition_id]]),
        y_test=dataset.y_test[test[partition_id]],
    )


@lru_cache(maxsize=2)
def _dataset(key: DataKey) -> Dataset:
    return load_dataset(
        key.dataset,
        root=key.data_root,
        seed=key.seed,
        train_size=key.num_clients * key.samples_per_client,
    )


@lru_cache(maxsize=2)
def partitions(key: DataKey) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Train and test indices of every client (cached per process)."""
    dataset = _dataset(key)
    labels = dataset.y_train
    if key.partitioner == "classes":
        train = partition_classes(labels, key.num_clients, key.classes_per_client, key.seed)
    elif key.partitioner == "dirichlet":
        train = partition_dirichlet(labels, key.num_clients, key.dirichlet_alpha, key.seed)
    elif key.partitioner == "lognormal":
        train = partition_lognormal(
            labels,
            key.num_clients,
            key.classes_per_client,
            mean_size=key.samples_per_client,
            sigma=key.lognormal_sigma,
            seed=key.seed,
        )
    else:
        raise ValueError(f"unknown partitioner '{key.partitioner}'")
    test = split_test_like_train([labels[idx] for idx in train], dataset.y_test, key.seed)
    return train, test
