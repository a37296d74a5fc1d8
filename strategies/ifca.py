"""IFCA's server step (Ghosh et al., NeurIPS 2020, Algorithm 2, model averaging): each
of the k models becomes the plain mean of the models trained on it this round, a model
no client chose stays. The exchange and its screening are FedEM's
(``fedpers/algorithms/ifca.py``)."""

from __future__ import annotations

import numpy as np
from flwr.app import RecordDict

from fedpers import protocol
from fedpers.families import mixture as mixture_family
from fedpers.strategies.fedem import FedEM


class IFCA(FedEM):
    """FedEM's strategy with each model weighted 1 by the clients that chose it (the
    column of their ``gamma_c`` that holds their samples), 0 by the others."""

    def learner_weights(self, content: RecordDict) -> np.ndarray:
        """1 for the model the client trained (its ``gamma_c``'s non-zero column), 0
        for the others (M2,)."""
        gamma = content.array_records[protocol.ARRAYS][mixture_family.GAMMA].numpy()
        return (gamma.sum(axis=0) > 0).astype(float)
