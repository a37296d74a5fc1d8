"""Local's server: nothing to average; with ``local-all-clients`` every seen client
trains in every round (``fedpers/algorithms/local.py``)."""

from __future__ import annotations

from fedpers.algorithms.local import LocalSettings
from fedpers.strategies.base import FedpersStrategy


class Local(FedpersStrategy):
    """The base rounds; every client a round when Local trains them all."""

    def clients_to_train(self, server_round: int) -> int:
        if self.run.group(LocalSettings).local_all_clients:
            return len(self.seen)
        return super().clients_to_train(server_round)
