"""Local-only training: no communication of model parts at all.

Sampled clients train their own models as much as in the federated methods; the
server only schedules rounds and collects metrics.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, Message, MetricRecord

from fedpers.protocol import Algorithm
from strategies.base import FedpersStrategy


class Local(FedpersStrategy):
    """Nothing to aggregate: keep the (empty) global arrays, average the metrics."""

    algorithm = Algorithm.LOCAL

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Training metrics only."""
        valid = self.screen(server_round, replies)
        if not valid:
            return None, None
        return None, self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)
