"""MOON (Li, He and Song, "Model-Contrastive Federated Learning", CVPR 2021, Algorithm 1).

The server runs FedAvg. A sampled client starts from the round's global model ``w^t``
and trains it for the round's ``epochs`` on its cross-entropy plus the model-contrastive
term, weighted by ``mu``:

    l_con = -log( exp(sim(z, z_glob) / tau)
                  / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) )

where ``sim`` is the cosine similarity and, for each sample, ``z`` is the representation
of the model being trained, ``z_glob`` that of the round's global model ``w^t`` and
``z_prev`` that of the client's own model after its last local training (kept in
``context.state``): the representation is pulled toward the global model's and pushed
from the client's previous one. The global and previous models run in evaluation mode
(no dropout) and are not trained, as in the authors' code.

What differs from the paper, and why:
- The representation ``z`` is the model's ``body`` output. The paper's networks add a
  two-layer projection head before the output layer and contrast its output; fedpers'
  models are FedRep's (body | head), so the body is the representation every row shares.
- A client's first participation has no previous model, so no negative: ``l_con`` is 0
  and its update is FedAvg's (the authors' code does the same in its first round, where
  its pool of previous models is empty).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.protocol import BODY, HEAD, MODEL_PARTS
from fedpers.settings import finite, setting

if TYPE_CHECKING:
    from fedpers.cohort import Cohort, Reply

STATE_PREVIOUS = "fedpers.moon.previous"  # the body after a client's last local training


@dataclass(frozen=True)
class MoonSettings:
    """The model-contrastive term of MOON (the row `moon`)."""

    HEADING: ClassVar[str] = "moon"

    # Chosen on validation (docs/reproducing.md): FedRep's Table 1 setting, seeds 0-2,
    # tau = 0.5, over the paper's grid {0.1, 1, 5, 10} and below its edge: 0.01 / 0.03 /
    # 0.1 / 1 / 5 / 10 -> 49.49 / 49.46 / 49.19 / 44.24 / 36.74 / 33.37 %.
    moon_mu: float = setting(
        0.01,
        "MOON: weight mu of the model-contrastive term added to each local step's "
        "cross-entropy (the paper's grid 0.1, 1, 5, 10)",
    )
    moon_tau: float = setting(
        0.5,
        "MOON: temperature tau of the cosine similarities in the contrastive term (the "
        "paper's value)",
    )

    def check(self) -> None:
        finite("moon-mu", self.moon_mu, 0.0, strict=True)
        finite("moon-tau", self.moon_tau, 0.0, strict=True)


def contrastive(mu: float, tau: float) -> Any:
    """The objective: each sample's cross-entropy plus ``mu`` times its ``l_con``;
    ``inputs`` holds the global body, the previous body and whether there is one (0/1)."""
    import torch
    import torch.nn.functional as F

    from fedpers.training import View, training_mode

    def objective(model: View, batch: tuple[Any, ...], inputs: Any) -> torch.Tensor:
        x, y, weight, count, _ = batch
        global_body, previous_body, has_previous = inputs
        z = model.part(BODY, x)
        losses = F.cross_entropy(model.part(HEAD, z), y, reduction="none")
        with training_mode(model.template, False):
            z_glob = View(model.template, global_body).part(BODY, x)
            z_prev = View(model.template, previous_body).part(BODY, x)
        positive_ = F.cosine_similarity(z, z_glob, dim=-1) / tau
        negative = F.cosine_similarity(z, z_prev, dim=-1) / tau
        term = has_previous * (torch.logaddexp(positive_, negative) - positive_)
        return ((losses + mu * term) * weight).sum() / count

    return objective


def fit(cohort: Cohort) -> list[Reply]:
    """FedAvg's local update from each member's ``w^t`` with the contrastive term;
    keeps each trained member's body as its next round's previous model."""
    import torch

    from fedpers import update

    settings = cohort.run.group(MoonSettings)
    local = update.Personalized(cohort)
    received = local.received()
    stack = local.models(received)
    body = stack.names((BODY,))
    kept = [update.kept(m, STATE_PREVIOUS) for m in local.members]
    previous = [
        k or {n: np.zeros_like(r[n]) for n in body} for k, r in zip(kept, received, strict=True)
    ]
    like = stack.tensors[body[0]]
    has_previous = torch.tensor(
        [float(bool(k)) for k in kept], dtype=like.dtype, device=like.device
    )
    inputs = (local.tensors(received, body), local.tensors(previous, body), has_previous)
    stats = local.train_phases(
        stack, objective=contrastive(settings.moon_mu, settings.moon_tau), inputs=inputs
    )
    for member, arrays, s in zip(local.members, stack.arrays((BODY,)), stats, strict=True):
        if s.steps:  # a member without a step holds its previous model still
            member.state[STATE_PREVIOUS] = update.to_record(arrays)
    return update.fit_replies(local.shared_arrays(stack), stats)


ROWS = (
    AlgorithmSpec(
        name="moon",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        settings=(MoonSettings,),
        unseen=True,
        personal_state=True,  # the previous model's body
        paper="Li et al., CVPR 2021",
    ),
)
