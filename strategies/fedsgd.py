"""FedSGD (distributed SGD on one global model), the single-model baseline of FedRep's
linear experiments (Collins et al., 2021, Figures 3 and 4).

The global model ``(B, w)`` starts from the same Method-of-Moments ``B`` as FedRep
(and ``w = 0``); each sampled client takes one gradient step on its fresh samples and
the server averages both parts.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.serverapp import Grid

from fedpers.protocol import Algorithm
from strategies.base import FedpersStrategy
from strategies.fedrep import BODY, moments_representation

HEAD = "head.weight"


class FedSGD(FedpersStrategy):
    """Average the whole linear model after one local gradient step.

    Parameters
    ----------
    rank : int
        Dimension ``k`` of the representation.
    **kwargs
        As for ``FedpersStrategy``.
    """

    algorithm = Algorithm.FEDSGD

    def __init__(self, *, rank: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.rank = rank

    def initial_arrays(self, grid: Grid, *, timeout: float) -> ArrayRecord:
        """Method-of-Moments ``B`` and a zero head."""
        initial = moments_representation(self, grid, self.rank, timeout=timeout)
        return ArrayRecord(
            {
                BODY: Array(np.ascontiguousarray(initial.T)),
                HEAD: Array(np.zeros((1, self.rank))),
            }
        )
