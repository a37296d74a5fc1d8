"""FedAvg client (McMahan et al., 2017) and its fine-tuned variant FedAvg+FT.

The whole model is trained and shared. FedAvg+FT trains exactly like FedAvg; its final
evaluation message asks every client to fine-tune the head first (see
``PersonalizedClient.evaluate``).
"""

from __future__ import annotations

from clients.base import PersonalizedClient
from fedpers.protocol import Algorithm


class FedAvgClient(PersonalizedClient):
    """All parameters trained jointly and sent to the server."""

    algorithm = Algorithm.FEDAVG


class FedAvgFTClient(FedAvgClient):
    """FedAvg during training; head fine-tuning at the final evaluation."""

    algorithm = Algorithm.FEDAVG_FT
