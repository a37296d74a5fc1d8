"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020,
Algorithm 2).

The server runs FedAvg. Each sampled client starts from the round's global model
``w^t`` and minimizes its own loss plus the proximal term ``(mu / 2) ||w - w^t||^2``
with the same local SGD as FedAvg (``epochs`` passes, the run's mini-batches), which
keeps the local model near the global one on heterogeneous data. ``mu = 0`` is
FedAvg's update, to the bit. FedProx+FT (``fedprox-ft``) is the same training, then
``finetune-epochs`` of head training on every client before its test, as FedAvg+FT.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import RecordDict

from fedpers.clients.base import Penalty, PersonalizedClient
from fedpers.clients.common import Arrays
from fedpers.config import RunConfig
from fedpers.families.personalized import FedProxSettings


class FedProxClient(PersonalizedClient):
    """FedAvg's local update with FedProx's proximal term toward the received model."""

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        self.mu = run.group(FedProxSettings).fedprox_mu

    def penalty(self, arrays: Arrays) -> Penalty:
        """``(mu / 2) ||w - w^t||^2`` over the shared parameters, ``w^t`` a copy of the
        arrays the server sent this round."""
        anchored = [
            (p, self.tensor(np.array(arrays[name], copy=True)))
            for name, p in self.model.named_parameters()
            if name in arrays
        ]
        mu = self.mu

        def proximal(_: torch.Generator) -> torch.Tensor:
            terms = [(p - anchor).pow(2).sum() for p, anchor in anchored]
            return 0.5 * mu * torch.stack(terms).sum()

        return proximal
