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

from fedpers import records
from fedpers.families import linear as linear_family
from fedpers.families.linear import BODY as LINEAR_BODY
from fedpers.families.linear import HEAD as LINEAR_HEAD
from fedpers.strategies.base import FedpersStrategy
from fedpers.strategies.fedrep import moments_representation


class FedSGD(FedpersStrategy):
    """Average the whole linear model after one local gradient step."""

    def step_size(self) -> float:
        """The step on the whole model (``linear-lr``)."""
        return linear_family.settings(self.run).linear_lr

    def initial_arrays(self, grid: Grid, *, timeout: float) -> ArrayRecord:
        """Method-of-Moments ``B`` and a zero head."""
        initial = moments_representation(self, grid, timeout=timeout)
        return ArrayRecord(
            {
                LINEAR_BODY: Array(records.contiguous(initial.T)),
                LINEAR_HEAD: Array(np.zeros((1, linear_family.settings(self.run).linear_rank))),
            }
        )
