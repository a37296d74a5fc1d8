"""A fedpers extension that lives outside fedpers: an algorithm, a data set, a model.

- ``fedavgm-example``: FedAvgM (Hsu et al., "Measuring the Effects of Non-Identical
  Data Distribution for Federated Visual Classification", 2019). The server treats
  ``w_t - mean(w_i)`` as a pseudo-gradient and applies heavy-ball momentum to it:
  ``v <- beta v + (w_t - mean(w_i))``, ``w_{t+1} = w_t - v``. Clients are FedAvg's
  (the personalized client of a row sharing body and head), so the row names only a
  strategy.
- ``blobs``: a synthetic 4-class data set from scikit-learn.
- ``blobs-mlp``: a small body/head MLP for it.

``register`` adds all three; the package declares it in the entry-point group
``fedpers.extensions`` (pyproject.toml beside this file), so that the ServerApp and
every ClientApp process load it once installed: ``pip install -e examples/server_momentum``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from sklearn.datasets import make_classification
from torch import nn

from fedpers import algorithms
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.config import RunConfig
from fedpers.data.registry import DatasetInfo
from fedpers.data.sources import Dataset, register_dataset
from fedpers.models import SplitModel, mlp, register_model
from fedpers.protocol import MODEL_PARTS
from fedpers.strategies.base import FedpersStrategy

# The server momentum, chosen on validation data: the docs' run (10 clients, one a round,
# 100 rounds; evaluate-split = "validation", seeds 0-2) gave 0.901, 0.879, 0.933, 0.247
# and 0.250 for beta 0, 0.3, 0.5, 0.7 and 0.9: from 0.7 on, the momentum's step (up to
# 1 / (1 - beta) times one client's pull) drives the model to chance and keeps it there.
BETA = 0.5


class ServerMomentum(FedpersStrategy):
    """FedAvg with server momentum: ``super().aggregate_train``, then one step more
    (the pattern of Flower's FedAvgM)."""

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.current = ArrayRecord()
        self.velocity: dict[str, np.ndarray] = {}

    def train_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> dict[int, RecordDict]:
        """As FedAvg; remembers ``w_t``."""
        self.current = arrays
        return super().train_contents(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The weighted mean of the clients' models, then the momentum step."""
        averaged, metrics = super().aggregate_train(server_round, replies)
        if averaged is None:
            return averaged, metrics
        updated = {}
        for name, array in self.current.items():
            current = array.numpy()
            step = current - averaged[name].numpy()
            velocity = BETA * self.velocity[name] + step if name in self.velocity else step
            self.velocity[name] = velocity
            updated[name] = Array(np.ascontiguousarray(current - velocity))
        return ArrayRecord(updated), metrics


def blobs(root: str, seed: int) -> Dataset:
    """4 classes of 16-dimensional Gaussian clusters, 2,400 training and 600 test samples."""
    x, y = make_classification(
        n_samples=3000,
        n_features=16,
        n_informative=8,
        n_classes=4,
        n_clusters_per_class=1,
        class_sep=2.0,
        random_state=seed,
    )
    x, y = x.astype(np.float32), y.astype(np.int64)
    return Dataset("blobs", x[:2400], y[:2400], x[2400:], y[2400:])


def blobs_mlp(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """16 -> 32 -> 16 body, linear head."""
    return SplitModel(mlp([16, 32, 16]), nn.Linear(16, num_classes))


SPEC = AlgorithmSpec(
    name="fedavgm-example",
    family=Family.PERSONALIZED,
    shared=MODEL_PARTS,
    strategy="fedpers_server_momentum:ServerMomentum",
    paper="Hsu et al., 2019 (FedAvgM), as a fedpers extension",
)


def register() -> None:
    """Add the algorithm, the data set and the model (the entry point calls this)."""
    algorithms.register(SPEC)
    register_dataset("blobs", DatasetInfo(4, (16,), "blobs-mlp", embedded=True), blobs)
    register_model("blobs-mlp", blobs_mlp, input_shape=(16,))
