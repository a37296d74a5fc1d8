"""FedDyn's server (Acar et al., ICLR 2021, Algorithm 1): the global state is the model
``theta`` and the paper's ``h``, the same arrays under ``feddyn.h.``
(``fedpers.algorithms.feddyn.H``), so that it is checkpointed and resumed with the model
(an exact resume needs the clients' ``g_k`` too: ``client-state-dir``). Only ``theta``
is sent: clients train and are evaluated on it alone. Each round, over the replies
``S`` kept and the ``N`` clients that train,

    h <- h - alpha (|S| / N) mean_S(w_k - theta)        theta <- mean_S(w_k) - h / alpha

with the paper's unweighted mean (the run's ``aggregation`` of the replies with equal
weights, so a robust aggregation replaces the mean in both), ``alpha`` =
``feddyn-alpha``. The replies are screened as FedAvg's are: against the ``theta``
sent.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.serverapp import Grid

from fedpers import records
from fedpers.algorithms.feddyn import FedDynSettings, H, is_h
from fedpers.strategies.base import FedpersStrategy


def model_of(arrays: ArrayRecord) -> ArrayRecord:
    """The global state without ``h``: what clients receive."""
    return ArrayRecord({k: v for k, v in arrays.items() if not is_h(k)})


class FedDyn(FedpersStrategy):
    """FedAvg's rounds with FedDyn's server step and its state ``h``."""

    h: dict[str, np.ndarray]

    def train_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> dict[int, RecordDict]:
        """The base's, of ``theta`` alone; ``h`` stays here for ``combine``."""
        self.h = {k[len(H) :]: records.values(v) for k, v in arrays.items() if is_h(k)}
        return super().train_contents(server_round, model_of(arrays), config, grid)

    def combine(
        self,
        arrays: list[dict[str, np.ndarray]],
        weights: list[float],
        reference: dict[str, np.ndarray],
    ) -> dict[str, np.ndarray]:
        """``theta`` and ``h`` stepped from the unweighted mean of the models
        (``reference``: the ``theta`` sent)."""
        mean = super().combine(arrays, [1.0] * len(arrays), reference)
        alpha = self.run.group(FedDynSettings).feddyn_alpha
        share = len(arrays) / len(self.seen)
        theta, h = {}, {}
        for name, sent in reference.items():
            start = sent.astype(np.float64)
            moved = mean[name].astype(np.float64)
            h[name] = self.h[name].astype(np.float64) - alpha * share * (moved - start)
            theta[name] = (moved - h[name] / alpha).astype(sent.dtype)
        return {**theta, **{H + k: v.astype(self.h[k].dtype) for k, v in h.items()}}

    def evaluate_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> dict[int, RecordDict]:
        """``theta`` alone."""
        return super().evaluate_contents(server_round, model_of(arrays), config)
