"""FedMuscle (Setayesh, Beitollahi, Khalil and Li, "Toward Enhancing Representation
Learning in Federated Multi-Task Settings", ICLR 2026, arXiv 2602.01626), between
Sheaf-FRL's agents: encoders of any architecture with one latent dimension ``d``; no
model parameter leaves an agent.

Each round every agent sends the unit-norm latents ``Z^n`` (B x d, eval mode) of the
round's batch of B shared pilots (the same B on every agent, drawn from the run's
seed and the round; B = ``sheaf-pilot-batch``), and receives those of M other agents
(``fedmuscle-others``, drawn by the relay). It trains its whole model for the round's
epochs on its task loss, then takes one gradient step of its encoder (the run's lr,
``sheaf-clip``) on the Muscle loss of its latents against theirs, held fixed:

    L^n = mean_i [ logsumexp_j (s_ij + log alpha_j) - (s_i(i..i) + log alpha_(i..i)) ],
    s_ij    = sum_k z_i^n . z_(j_k)^(m_k) / tau,
    alpha_j = exp(-gamma sum_(k < k') z_(j_k)^(m_k) . z_(j_k')^(m_k')),
    gamma   = 1 / tau_others - 1 / tau,

over every tuple ``j = (j_1..j_M)`` of pilot indices, the positive tuple (i, ..., i)
included. With one other agent alpha = 1 and L^n is InfoNCE. The formula is the paper's
as third-party notes of it give it (its method section could not be read here; see
docs/reproducing.md): a reconstruction, tested against a direct enumeration of that
formula, not against the authors' code. Agents are tested with their own head (private
accuracy) and, after the last round, aligned on the pilots as Sheaf-FRL's baselines
are (communication accuracy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from fedpers import protocol
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import PENALTY, REPRESENTATIONS
from fedpers.seeding import rng
from fedpers.settings import ConfigError, at_least, positive, setting

if TYPE_CHECKING:
    import torch

    from fedpers.agents_update import Agents
    from fedpers.cohort import Cohort, Reply
    from fedpers.config import RunConfig
    from fedpers.training import Stack

MUSCLE_TUPLES_LIMIT = 2**26  # logits of one FedMuscle step: batch^(others + 1)


@dataclass(frozen=True)
class FedMuscleSettings:
    """The Muscle loss of FedMuscle (the row `fedmuscle`)."""

    HEADING: ClassVar[str] = "fedmuscle"

    fedmuscle_tau: float = setting(
        0.2,
        "FedMuscle: temperature of the anchor's similarities to the other agents' "
        "representations (the paper's tau^(N), 0.2)",
    )
    fedmuscle_tau_others: float = setting(
        0.15,
        "FedMuscle: temperature tau^(N-1) among the other agents' representations, which "
        "weighs each negative tuple (the paper's 0.15; unused with two agents)",
    )
    fedmuscle_others: int = setting(
        3, "FedMuscle: other agents M whose representations an agent is sent each round"
    )

    def check(self) -> None:
        positive("fedmuscle-tau", self.fedmuscle_tau)
        positive("fedmuscle-tau-others", self.fedmuscle_tau_others)
        at_least("fedmuscle-others", self.fedmuscle_others, 1)
        if not self.fedmuscle_tau_others < self.fedmuscle_tau:
            raise ConfigError(
                f"run-config key 'fedmuscle-tau-others' = {self.fedmuscle_tau_others} must be "
                f"below 'fedmuscle-tau' = {self.fedmuscle_tau}: the Muscle loss weighs each "
                "negative tuple by exp(-gamma ...), gamma = 1/tau-others - 1/tau, which must "
                "be positive; lower 'fedmuscle-tau-others'."
            )


def check_muscle(run: RunConfig) -> None:
    """FedMuscle compares latents across agents (one dimension), and its loss sums over
    every tuple of the other agents' pilots: at most ``MUSCLE_TUPLES_LIMIT`` of them."""
    dims = {spec.latent for spec in sheaf_family.run_agent_specs(run)}
    if len(dims) > 1:
        raise ConfigError(
            f"algorithm '{run.algorithm}' compares the agents' latents directly, which needs "
            f"equal latent dimensions, found {sorted(dims)}: set 'sheaf-latent-dims' to one "
            "value per agent, all equal."
        )
    others = min(run.group(FedMuscleSettings).fedmuscle_others, run.num_clients - 1)
    batch = sheaf_family.settings(run).sheaf_pilot_batch
    if batch ** (others + 1) > MUSCLE_TUPLES_LIMIT:
        raise ConfigError(
            f"FedMuscle's loss with 'sheaf-pilot-batch' = {batch} and {others} other agents "
            f"sums {batch}^{others + 1} terms per step, more than {MUSCLE_TUPLES_LIMIT}: "
            "lower 'fedmuscle-others' or 'sheaf-pilot-batch'."
        )


def pilot_batch(run: RunConfig, server_round: int, count: int) -> np.ndarray:
    """The round's B indices among ``count`` pilots: the same on every agent."""
    size = min(sheaf_family.settings(run).sheaf_pilot_batch, count)
    return np.sort(rng(run.seed, "fedmuscle-batch", server_round).permutation(count)[:size])


def representations_message(cohort: Cohort) -> list[Reply]:
    """``Z^n`` of the round's pilot batch (float32, rows of norm 1)."""
    import torch

    from fedpers import agents_update

    local = agents_update.Agents(cohort)
    index = pilot_batch(local.run, local.round, len(local.pilots[1]))

    def one(group: list[int], stack: Stack) -> list[Reply]:
        with torch.no_grad():
            latents = unit_latents(local, stack, index, local.pilot_inputs(stack.size))
        return [({REPRESENTATIONS: z.cpu().numpy().astype(np.float32)}, {}) for z in latents]

    return local.each(one)


def unit_latents(
    local: Agents, stack: Stack, index: np.ndarray, pilots: torch.Tensor, *others: torch.Tensor
) -> torch.Tensor:
    """Each member's encoder latents of the pilots ``index`` (evaluation mode), each
    scaled to norm 1 (K, B, d); with ``others`` (K, M, B, d), each member's Muscle loss
    of them instead (K,)."""
    import torch
    import torch.nn.functional as F

    from fedpers import training

    rows = torch.as_tensor(index, device=pilots.device)
    muscle = local.run.group(FedMuscleSettings)

    def one(
        tensors: dict[str, torch.Tensor], x: torch.Tensor, *theirs: torch.Tensor
    ) -> torch.Tensor:
        with training.training_mode(stack.template, False):
            z = training.View(stack.template, tensors).part(protocol.BODY, x[rows])
        z = F.normalize(z, dim=1)
        if not theirs:
            return z
        given = list(theirs[0].unbind(0))
        return muscle_loss(
            z, given, tau=muscle.fedmuscle_tau, tau_others=muscle.fedmuscle_tau_others
        )

    return training.per_client(one, stack.tensors, pilots, *others, size=stack.size)


def fit(cohort: Cohort) -> list[Reply]:
    """The round's epochs on the task loss, then one encoder step on the Muscle loss
    against the representations received (none: no step, a penalty of 0)."""
    from fedpers import agents_update

    local = agents_update.Agents(cohort)

    def one(group: list[int], stack: Stack) -> list[Reply]:
        metrics = local.train_private(group, stack)
        received = [
            [a[n] for n in sorted(a) if sheaf_family.agent_of(n)[0] == REPRESENTATIONS]
            for a in (local.members[k].arrays for k in group)
        ]
        for count in sorted({len(r) for r in received} - {0}):
            chosen = [i for i, r in enumerate(received) if len(r) == count]
            losses = _step(local, stack, chosen, [received[i] for i in chosen])
            for i, loss in zip(chosen, losses, strict=True):
                metrics[i][PENALTY] = loss
        local.keep(group, stack)
        return [({}, m) for m in metrics]

    replies = local.each(one, training=True)
    local.commit()
    return replies


def _step(
    local: Agents, stack: Stack, chosen: list[int], received: list[list[np.ndarray]]
) -> list[float]:
    """One encoder step of the members ``chosen`` of the stack (each sent as many
    representations) on their Muscle losses; the losses."""
    import torch

    index = pilot_batch(local.run, local.round, len(local.pilots[1]))
    sub = stack.select(torch.tensor(chosen, device=next(iter(stack.tensors.values())).device))
    theirs = local.floats([np.stack([r.astype(np.float32) for r in own]) for own in received])
    names = sub.names((protocol.BODY,))
    tensors = [sub.tensors[n] for n in names]
    for t in tensors:
        t.requires_grad_(True)
    try:
        loss = unit_latents(local, sub, index, local.pilot_inputs(sub.size), theirs)
        grads = torch.autograd.grad(loss.sum(), tensors)
    finally:
        for t in tensors:
            t.requires_grad_(False)
    with torch.no_grad():
        for i, k in enumerate(chosen):
            norm = float(np.sqrt(sum(float((g[i].double() ** 2).sum()) for g in grads)))
            scale = local.clip / norm if local.clip > 0 and norm > local.clip else 1.0
            for name, gradient in zip(names, grads, strict=True):
                stack.tensors[name][k] = sub.tensors[name][i] - local.lr * scale * gradient[i]
    return [float(v) for v in loss.detach().to(torch.float64).cpu()]


def muscle_loss(
    anchor: torch.Tensor, others: list[torch.Tensor], *, tau: float, tau_others: float
) -> torch.Tensor:
    """The Muscle loss of ``anchor`` (B x d) against ``others`` (M matrices B x d) over
    all B^M tuples (module docstring); the mean over the B anchors."""
    import torch

    batch, count = anchor.shape[0], len(others)
    gamma = 1.0 / tau_others - 1.0 / tau
    logits = torch.zeros((batch,) * (count + 1), dtype=anchor.dtype, device=anchor.device)
    for k, other in enumerate(others):
        shape = [batch] + [1] * count
        shape[k + 1] = batch
        logits = logits + (anchor @ other.T / tau).reshape(shape)
    for k in range(count):
        for q in range(k + 1, count):
            shape = [1] * (count + 1)
            shape[k + 1] = shape[q + 1] = batch
            logits = logits - gamma * (others[k] @ others[q].T).reshape(shape)
    flat = logits.reshape(batch, -1)
    diagonal = torch.arange(batch, device=anchor.device)
    positive = logits[(diagonal,) * (count + 1)]
    return (torch.logsumexp(flat, dim=1) - positive).mean()


ROWS = (
    AlgorithmSpec(
        name="fedmuscle",
        family=Family.SHEAF,
        shared=(),
        strategy="fedpers.strategies.fedmuscle:FedMuscle",
        settings=(FedMuscleSettings,),
        checks=(check_muscle,),
        paper="Setayesh et al., ICLR 2026",
    ),
)
