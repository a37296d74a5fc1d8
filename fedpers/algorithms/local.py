"""Local training only: each client trains its own whole model for ``epochs`` when it is
sampled and shares nothing; the server averages nothing. The update is the
personalized family's with no shared part.
"""

from __future__ import annotations

from fedpers.algorithms import AlgorithmSpec, Family

ROWS = (
    AlgorithmSpec(
        name="local",
        family=Family.PERSONALIZED,
        shared=(),
        paper="local training only",
    ),
)
