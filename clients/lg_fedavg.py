"""LG-FedAvg client (Liang et al., 2020): local representation, global head.

The opposite split of FedRep: the body stays on the device, the head is averaged.
"""

from __future__ import annotations

from clients.base import PersonalizedClient
from fedpers.protocol import Algorithm


class LGFedAvgClient(PersonalizedClient):
    """Body and head trained jointly; only the head is sent to the server."""

    algorithm = Algorithm.LG_FEDAVG
