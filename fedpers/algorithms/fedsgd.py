"""FedSGD: distributed SGD on one global model, the single-model baseline of FedRep's
linear experiments (Collins, Hassani, Mokhtari and Shakkottai, "Exploiting Shared
Representations for Personalized Federated Learning", ICML 2021, Figures 3 and 4).

It exists only for the linear model (``dataset = "linear"``): the global model
``(B, w)`` starts from the same Method-of-Moments ``B`` as FedRep and ``w = 0``
(``strategies/fedsgd.py``); each sampled client takes one gradient step on both parts
with its fresh samples, and the server averages both. What else a client answers (the
Method-of-Moments statistic, ``query.moments``) is the linear family's
(``fedpers.families.linear``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fedpers import linear
from fedpers.algorithms import AlgorithmSpec, Family, LinearVariant
from fedpers.families.linear import BODY, HEAD, LinearLocal
from fedpers.protocol import LOSS, MODEL_PARTS, NUM_EXAMPLES

if TYPE_CHECKING:
    from fedpers.cohort import Cohort, Metrics, Reply


def fit(cohort: Cohort) -> list[Reply]:
    """One gradient step on the whole model ``(B, w)`` for each member, on its fresh
    samples of the round."""
    local = LinearLocal(cohort)
    models = _models(local)
    lr = local.lr
    draws = local.samples("train", local.round)
    return [_step(model, sample, lr) for model, sample in zip(models, draws, strict=True)]


def _step(
    model: tuple[np.ndarray, np.ndarray], sample: tuple[np.ndarray, np.ndarray], lr: float
) -> Reply:
    """One member's step on ``B`` and ``w`` from the same model."""
    (representation, head), (x, y) = model, sample
    loss = linear.mean_squared_error(x, y, representation, head)
    new_representation = representation - lr * linear.representation_gradient(
        x, y, representation, head
    )
    new_head = head - lr * linear.head_gradient(x, y, representation, head)
    return {BODY: new_representation.T, HEAD: new_head[None, :]}, {
        NUM_EXAMPLES: float(len(y)),
        LOSS: loss,
    }


def evaluate(cohort: Cohort) -> list[Metrics]:
    """Each member's test error with the global model it was sent."""
    local = LinearLocal(cohort)
    return local.test(_models(local))


def _models(local: LinearLocal) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each member's ``(B, w)`` from the arrays it received (``B`` sent transposed)."""
    return [(arrays[BODY].T, arrays[HEAD][0]) for arrays in local.received((BODY, HEAD))]


ROWS = (
    AlgorithmSpec(
        name="fedsgd",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        linear=LinearVariant("fedpers.strategies.fedsgd:FedSGD", __name__),
        deep=False,
        paper="one global linear model (FedRep, Figures 3-4)",
    ),
)
