"""SCAFFOLD's server (Karimireddy et al., ICML 2020, Algorithm 1): the global model
``x`` and control variate ``c`` are one state, the model's arrays and the same arrays
under ``control.`` (``fedpers.algorithms.scaffold.CONTROL``), so that the round loop
sends both, screens both, and checkpoints both (an exact resume needs the clients'
``c_i`` too: ``client-state-dir``). Each round, over the replies ``S`` kept,

    x <- x + eta_g mean_S(y_i - x)        c <- c + (|S| / N) mean_S(c_i+ - c_i)

with the paper's unweighted means (the run's ``aggregation`` of the replies with equal
weights), ``eta_g`` = ``scaffold-server-lr`` and ``N`` the clients that train. A client
replies ``c + (c_i+ - c_i)`` for the variate (``fedpers/algorithms/scaffold.py``), so the mean of
what came back less ``c`` is the mean of the ``c_i+ - c_i``.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedpers.algorithms.scaffold import ScaffoldSettings, is_control
from fedpers.strategies.base import FedpersStrategy, step_toward


class Scaffold(FedpersStrategy):
    """FedAvg's rounds with SCAFFOLD's server step and its control variate."""

    def combine(
        self,
        arrays: list[dict[str, np.ndarray]],
        weights: list[float],
        reference: dict[str, np.ndarray],
    ) -> dict[str, np.ndarray]:
        """``x + eta_g (mean y - x)`` and ``c + (|S| / N) (mean returned - c)``, the
        means unweighted."""
        mean = super().combine(arrays, [1.0] * len(arrays), reference)
        eta = self.run.group(ScaffoldSettings).scaffold_server_lr
        share = len(arrays) / len(self.seen)
        return step_toward(reference, mean, lambda name: share if is_control(name) else eta)

    def evaluate_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> dict[int, RecordDict]:
        """The model alone: evaluation needs no control variate."""
        model = ArrayRecord({k: v for k, v in arrays.items() if not is_control(k)})
        return super().evaluate_contents(server_round, model, config)
