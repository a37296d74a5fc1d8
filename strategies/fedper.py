"""FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", 2019).

Server side identical to FedRep's (average the body, leave heads alone); the two
differ on the device, where FedPer trains head and body jointly.
"""

from __future__ import annotations

from fedpers.protocol import Algorithm
from strategies.base import FedpersStrategy


class FedPer(FedpersStrategy):
    """Average the body over the sampled clients."""

    algorithm = Algorithm.FEDPER
