"""IFCA's server step (Ghosh et al., NeurIPS 2020, Algorithm 2, model averaging): each
of the k models becomes the plain mean of the models trained on it this round, a model
no client chose stays. The exchange and its screening are FedEM's
(``fedpers/algorithms/ifca.py``)."""

from __future__ import annotations

import numpy as np
from flwr.app import Message, RecordDict

from fedpers import protocol
from fedpers.families import mixture as mixture_family
from fedpers.strategies import screening
from fedpers.strategies.fedem import FedEM


class IFCA(FedEM):
    """FedEM's strategy with each model weighted 1 by the clients that chose it (the
    column of their ``gamma_c`` that holds their samples), 0 by the others."""

    def checks(self) -> list[screening.Check]:
        """FedEM's, then IFCA's rule: a client trained one model."""
        return [*super().checks(), self.one_choice_defect]

    def one_choice_defect(self, reply: Message) -> str | None:
        """``gamma_c`` must put all the client's samples on one model (FedEM's check
        already made it non-negative and sum to them)."""
        gamma = screening.arrays_of(reply)[mixture_family.GAMMA]
        chosen = int(np.count_nonzero(gamma.sum(axis=0)))
        if chosen > 1:
            return f"gamma spreads its samples over {chosen} models; IFCA trains one"
        return None

    def learner_weights(self, content: RecordDict) -> np.ndarray:
        """1 for the model the client trained (its ``gamma_c``'s non-zero column), 0
        for the others (M2,)."""
        gamma = content.array_records[protocol.ARRAYS][mixture_family.GAMMA].numpy()
        return (gamma.sum(axis=0) > 0).astype(float)
