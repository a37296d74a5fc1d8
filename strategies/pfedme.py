"""pFedMe's server (T Dinh et al., NeurIPS 2020, Algorithm 1; the client is
``fedpers/algorithms/pfedme.py``): over the replies ``S`` kept,

    w <- (1 - beta) w + beta mean_S(w_i)

with the paper's unweighted mean (the run's ``aggregation`` with equal weights) and
``beta`` = ``pfedme-beta`` (1: the mean itself).
"""

from __future__ import annotations

import numpy as np

from fedpers.algorithms.pfedme import PFedMeSettings
from fedpers.strategies.base import FedpersStrategy, step_toward


class PFedMe(FedpersStrategy):
    """FedAvg's rounds with pFedMe's server step."""

    def combine(
        self,
        arrays: list[dict[str, np.ndarray]],
        weights: list[float],
        reference: dict[str, np.ndarray],
    ) -> dict[str, np.ndarray]:
        """``w + beta (mean_S w_i - w)``, the mean unweighted."""
        mean = super().combine(arrays, [1.0] * len(arrays), reference)
        beta = self.run.group(PFedMeSettings).pfedme_beta
        return step_toward(reference, mean, lambda _: beta)
