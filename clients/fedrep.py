"""FedRep client (Collins et al., ICML 2021, Algorithm 1).

Each round: many epochs on the personal head with the shared representation frozen,
then a few epochs on the representation with the head frozen. The head never leaves
the device; the representation goes back to the server to be averaged.
"""

from __future__ import annotations

from flwr.app import ConfigRecord

from clients.base import PersonalizedClient
from clients.common import config_int
from fedpers import protocol
from fedpers.protocol import Algorithm


class FedRepClient(PersonalizedClient):
    """Head epochs (body frozen), then representation epochs (head frozen)."""

    algorithm = Algorithm.FEDREP

    def local_update(self, config: ConfigRecord) -> list[tuple[tuple[str, ...], int]]:
        return [
            ((protocol.HEAD,), config_int(config, protocol.HEAD_EPOCHS)),
            ((protocol.BODY,), config_int(config, protocol.EPOCHS)),
        ]
