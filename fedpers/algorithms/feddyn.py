"""FedDyn (Acar, Zhao, Matas, Mattina, Whatmough and Saligrama, "Federated Learning Based
on Dynamic Regularization", ICLR 2021, Algorithm 1).

Each client k keeps the linear term ``g_k`` of its dynamic regularizer (zero at first)
in ``context.state``. A sampled client receives the server's model ``theta`` and
minimizes, for the round's ``epochs`` passes of its mini-batches,

    L_k(w) - <g_k, w> + (alpha / 2) ||w - theta||^2

(the linear term as a constant added to every gradient, ``-g_k``; the proximal term in
the objective, so the loss a client reports is its cross-entropy plus that term, as
FedProx's). Then the first-order condition of that minimum gives its new gradient
estimate, kept for its next round,

    g_k <- g_k - alpha (w_k - theta),

and it replies ``w_k``. The server (``strategies/feddyn.py``) keeps ``h`` (zero at
first) beside ``theta`` and, over the replies ``S`` kept and the ``N`` clients,

    h <- h - alpha (|S| / N) mean_S(w_k - theta)        theta <- mean_S(w_k) - h / alpha

with the paper's unweighted mean (the run's ``aggregation`` with equal weights). ``h``
is part of the global state (checkpointed under ``feddyn.h.<parameter>``) but is never
sent: clients receive ``theta`` alone, so a round costs what FedAvg's does.

The authors' code divides ``alpha`` by each client's share of the mean sample count
(``alpha / (n_k / mean n)``); Algorithm 1 has one ``alpha``, which this row uses (the
two agree where every client holds as many samples as the mean).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.cohort import Member
from fedpers.families import personalized
from fedpers.protocol import MODEL_PARTS
from fedpers.settings import finite, setting

if TYPE_CHECKING:
    from fedpers.cohort import Arrays, Cohort, Reply

# The server's h, in the global state beside theta: each parameter's under this prefix.
H = "feddyn.h."
STATE_GRADIENT = "fedpers.feddyn.gradient"  # a client's g_k, in context.state


@dataclass(frozen=True)
class FedDynSettings:
    """The dynamic regularizer of FedDyn (the row `feddyn`)."""

    HEADING: ClassVar[str] = "feddyn"

    # Chosen on validation (docs/reproducing.md): FedRep's Table 1 setting, seeds 0-2,
    # over the paper's grid and 0.03: 0.1 / 0.03 / 0.01 / 0.001 -> 57.33 / 58.21 /
    # 57.69 / 56.59 %.
    feddyn_alpha: float = setting(
        0.03,
        "FedDyn: the weight alpha of the dynamic regularizer (alpha/2)||w - theta||^2 - "
        "<g_k, w>, and of the server's h (the paper's grid 0.1, 0.01, 0.001)",
    )

    def check(self) -> None:
        finite("feddyn-alpha", self.feddyn_alpha, 0.0, strict=True)


def is_h(name: str) -> bool:
    """Whether the global array ``name`` is part of the server's ``h``."""
    return name.startswith(H)


def initial_arrays(cohort: Cohort) -> Arrays:
    """The seeded model and the server's first ``h``, zero."""
    model = personalized.initial_arrays(cohort)
    return {**model, **{H + k: np.zeros_like(v) for k, v in model.items()}}


def fit(cohort: Cohort) -> list[Reply]:
    """Each member's steps on its dynamically regularized loss from ``theta``; replies
    ``w_k`` and keeps ``g_k - alpha (w_k - theta)``."""
    from fedpers import update

    alpha = cohort.run.group(FedDynSettings).feddyn_alpha
    local = update.Personalized(cohort)
    received = local.received()
    names = [n for n, _ in local.model.named_parameters() if n in received[0]]
    gradients = [_gradient(m, x, names) for m, x in zip(local.members, received, strict=True)]
    linear = [{n: (-g[n]).astype(np.float32) for n in names} for g in gradients]
    stack = local.models(received)
    stats = local.train_phases(
        stack,
        objective=update.proximal(alpha),
        inputs=local.tensors(received, names),
        correction=local.tensors(linear, names),
    )
    local.keep_personal(stack)
    replies = update.fit_replies(local.shared_arrays(stack), stats)
    for member, theta, (w, _), g, s in zip(
        local.members, received, replies, gradients, stats, strict=True
    ):
        if s.steps:  # without a step nothing moved and g_k stays
            moved = {n: g[n] - alpha * (w[n].astype(np.float64) - theta[n]) for n in names}
            member.state[STATE_GRADIENT] = update.to_record(
                {n: v.astype(np.float32) for n, v in moved.items()}
            )
    return replies


def _gradient(member: Member, model: Arrays, names: list[str]) -> Arrays:
    """A member's ``g_k`` of the model's parameters ``names`` (float64): what it stored
    (``update.kept``), else zeros."""
    from fedpers import update

    stored = update.kept(member, STATE_GRADIENT)
    return {
        n: stored[n].astype(np.float64) if n in stored else np.zeros(model[n].shape) for n in names
    }


_DP = personalized.refuses_dp("whose server steps theta past the mean by h / alpha")

ROWS = (
    AlgorithmSpec(
        name="feddyn",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        strategy="fedpers.strategies.feddyn:FedDyn",
        settings=(FedDynSettings,),
        checks=(_DP,),
        wire=(H,),
        personal_state=True,  # g_k
        paper="Acar et al., ICLR 2021",
    ),
)
