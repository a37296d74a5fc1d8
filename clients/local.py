"""Local-only client: the whole model stays on the device, nothing is shared.

It trains when sampled, exactly as much as the federated methods do, so that the
comparison is on equal local work.
"""

from __future__ import annotations

from clients.base import PersonalizedClient
from fedpers.protocol import Algorithm


class LocalClient(PersonalizedClient):
    """Trains its own model; sends no arrays."""

    algorithm = Algorithm.LOCAL
