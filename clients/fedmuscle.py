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

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, RecordDict

from fedpers import protocol
from fedpers.clients.common import Arrays, Metrics, config_float, config_int
from fedpers.clients.sheaf import SheafClient
from fedpers.config import RunConfig
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import PENALTY, REPRESENTATIONS, FedMuscleSettings
from fedpers.seeding import rng


class FedMuscleClient(SheafClient):
    """A Sheaf-FRL agent aligned to others by the Muscle loss on shared pilots."""

    cooperative = False  # no gluing of pilots through maps

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        self.muscle = run.group(FedMuscleSettings)

    def pilot_batch(self, server_round: int) -> np.ndarray:
        """The round's B pilot indices: the same on every agent."""
        count = len(self.pilots_y)
        size = min(sheaf_family.settings(self.run).sheaf_pilot_batch, count)
        return np.sort(
            rng(self.run.seed, "fedmuscle-batch", server_round).permutation(count)[:size]
        )

    def unit_latents(self, index: np.ndarray) -> torch.Tensor:
        """The encoder's latents of those pilots (eval mode), each scaled to norm 1,
        with gradient."""
        self.model.eval()
        return F.normalize(self.model.body(self.tensor(self.pilots_x[index])), dim=1)

    def representations_message(self, config: ConfigRecord) -> Arrays:
        """``Z^n`` of the round's pilot batch (float32, rows of norm 1)."""
        index = self.pilot_batch(config_int(config, protocol.ROUND))
        with torch.no_grad():
            latents = self.unit_latents(index).cpu().numpy().astype(np.float32)
        return {REPRESENTATIONS: latents}

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """Local epochs on the task loss, then one encoder step on the Muscle loss."""
        _, metrics = super().fit({}, config)  # lambda = 0: the task loss alone
        others = [
            torch.from_numpy(arrays[name].astype(np.float32)).to(self.device)
            for name in sorted(arrays)
            if sheaf_family.agent_of(name)[0] == REPRESENTATIONS
        ]
        if not others:
            metrics[PENALTY] = 0.0
            return {}, metrics
        index = self.pilot_batch(config_int(config, protocol.ROUND))
        params = list(self.model.body.parameters())
        loss = muscle_loss(
            self.unit_latents(index),
            others,
            tau=self.muscle.fedmuscle_tau,
            tau_others=self.muscle.fedmuscle_tau_others,
        )
        gradients = torch.autograd.grad(loss, params)
        clip = sheaf_family.settings(self.run).sheaf_clip
        norm = float(np.sqrt(sum(float((g.double() ** 2).sum()) for g in gradients)))
        scale = clip / norm if clip > 0 and norm > clip else 1.0
        lr = config_float(config, protocol.LR)
        with torch.no_grad():
            for param, gradient in zip(params, gradients, strict=True):
                param.sub_(lr * scale * gradient)
        self.save()
        metrics[PENALTY] = float(loss.detach())
        return {}, metrics


def muscle_loss(
    anchor: torch.Tensor, others: list[torch.Tensor], *, tau: float, tau_others: float
) -> torch.Tensor:
    """The Muscle loss of ``anchor`` (B x d) against ``others`` (M matrices B x d) over
    all B^M tuples (module docstring); the mean over the B anchors."""
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
