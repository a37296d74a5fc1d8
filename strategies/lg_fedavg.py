"""LG-FedAvg (Liang et al., "Think Locally, Act Globally", 2020).

Local representations, global head: the server averages only the head.
"""

from __future__ import annotations

from fedpers.protocol import Algorithm
from strategies.base import FedpersStrategy


class LGFedAvg(FedpersStrategy):
    """Average the head over the sampled clients."""

    algorithm = Algorithm.LG_FEDAVG
