"""FedPer client (Arivazhagan et al., 2019).

The same split as FedRep (shared body, personal head) but head and body are trained
jointly, for the same number of epochs.
"""

from __future__ import annotations

from clients.base import PersonalizedClient
from fedpers.protocol import Algorithm


class FedPerClient(PersonalizedClient):
    """Body and head trained together; the head stays on the device."""

    algorithm = Algorithm.FEDPER
