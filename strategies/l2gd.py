"""L2GD's server (Hanzely and Richtarik, 2020, Algorithm 1; the clients' update is
``fedpers/algorithms/l2gd.py``). The global model is ``x_bar``, the mean of all ``n``
clients' personal models: they all start as the seeded initial model, and each round,
over the replies ``S`` kept (each ``x_bar + (x_i^new - x_i^old)``),

    x_bar <- x_bar + (|S| / n) mean_S(reply - x_bar)

with the paper's unweighted mean (the run's ``aggregation`` with equal weights): the
change of the mean when the clients of ``S`` changed and the others did not. The round's
coin, an aggregation step with probability ``l2gd-p``, is drawn from the seed and the
round, so a resumed run draws the same coins. ``MeanOfAll`` is that server without the
coin: FedEM's pFedMe (``fedpers/algorithms/pfedme_fedem.py``) runs on it.

Compute-matched by default (``l2gd-matched``): a local step's round samples
``clients_per_round / (1 - p)`` clients (at most all of them) and an aggregation step's
``clients_per_round``, so that a round trains ``clients_per_round`` clients on average,
as every other row's does; otherwise L2GD would train only the ``1 - p`` of rounds that
are local steps (``l2gd-matched = false``: the same count every round).
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.serverapp import Grid

from fedpers.algorithms.l2gd import AGGREGATE, L2GDSettings
from fedpers.seeding import rng
from fedpers.strategies.base import FedpersStrategy, step_toward


class MeanOfAll(FedpersStrategy):
    """FedAvg's rounds whose global model is the mean of all ``n`` clients' personal
    models, kept from the sampled clients' changes (L2GD's, and FedEM's pFedMe's)."""

    def combine(
        self,
        arrays: list[dict[str, np.ndarray]],
        weights: list[float],
        reference: dict[str, np.ndarray],
    ) -> dict[str, np.ndarray]:
        """``x_bar + (|S| / n) (mean of the replies - x_bar)``, the mean unweighted."""
        mean = super().combine(arrays, [1.0] * len(arrays), reference)
        share = len(arrays) / len(self.seen)
        return step_toward(reference, mean, lambda _: share)


class L2GD(MeanOfAll):
    """FedAvg's rounds with L2GD's coin and its mean of all personal models."""

    def aggregates(self, server_round: int) -> bool:
        """Whether ``server_round`` is an aggregation step (probability ``l2gd-p``)."""
        p = self.run.group(L2GDSettings).l2gd_p
        return bool(rng(self.run.seed, "l2gd", server_round).random() < p)

    def clients_to_train(self, server_round: int) -> int:
        """``clients_per_round`` on an aggregation step; ``clients_per_round / (1 - p)``
        (rounded, at most the seen clients) on a local step when compute-matched."""
        settings = self.run.group(L2GDSettings)
        base = self.run.clients_per_round
        if not settings.l2gd_matched or self.aggregates(server_round):
            return base
        return min(len(self.seen), round(base / (1.0 - settings.l2gd_p)))

    def train_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> dict[int, RecordDict]:
        """The mean ``x_bar`` and the round's coin."""
        config[AGGREGATE] = int(self.aggregates(server_round))
        return super().train_contents(server_round, arrays, config, grid)
