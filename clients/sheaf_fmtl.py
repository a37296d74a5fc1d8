"""Sheaf-FMTL (Ben Issaid, Cohen, Bennis et al., "Tackling Feature and Sample
Heterogeneity in Decentralized Multi-Task Learning: A Sheaf-Theoretic Approach", 2025),
between Sheaf-FRL's agents: restriction maps between the agents' *parameter* spaces.

Agent ``i`` keeps its whole model, ``theta_i`` (its ``n_i`` trainable parameters as one
vector, in ``model.parameters()`` order), and one map ``P_ij`` (``d_ij x n_i``,
``d_ij = floor(gamma min(n_i, n_j))``, drawn from N(0, 0.01^2) as the authors' code
draws it) per neighbour ``j``. The objective is

    sum_i f_i(theta_i) + (lambda / 2) sum_(i,j) ||P_ij theta_i - P_ji theta_j||^2.

A round:
1. ``query.projections``: the agent sends ``P_ij theta_i`` to each neighbour ``j`` (the
   only thing that leaves it; the relay forwards it to ``j``);
2. ``train``: with its neighbours' ``m_ji = P_ji theta_j`` it trains ``epochs`` local
   epochs on its private loss (the family's optimizer and clip), then, as the authors'
   code does after its local epochs,

       theta_i <- theta_i - lr lambda sum_j P_ij^T (P_ij theta_i - m_ji),
       P_ij    <- P_ij - eta lambda (P_ij theta_i - m_ji) theta_i^T   (the new theta_i).

With ``sheaf-clip`` > 0 each of those two gradients (the sum over edges for
``theta_i``, each edge's for ``P_ij``) is clipped to that norm, so whatever a neighbour
sends moves ``theta_i`` by at most ``lr x clip`` and each map by at most ``eta x clip``
a round. The steps are computed in float64 and stored in float32. Agents are tested
with their own head (private accuracy) and, after the last round, aligned on the
pilots as Sheaf-FRL's baselines are (communication accuracy).
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedpers import protocol, sheaf
from fedpers.clients.common import Arrays, Metrics, config_float
from fedpers.clients.sheaf import SheafClient
from fedpers.config import RunConfig
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import PENALTY, PROJECTION, SheafFMTLSettings
from fedpers.seeding import rng

STATE_FMTL_MAPS = "sheaf-fmtl.maps"
MAP_SCALE = 0.01  # the authors' initial maps: N(0, 0.01^2) entries


class SheafFMTLClient(SheafClient):
    """A Sheaf-FRL agent coupled to its neighbours through its parameters."""

    cooperative = False  # no pilots while training: no gluing of latents

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        self.fmtl = run.group(SheafFMTLSettings)
        self.neighbours = sheaf.neighbours(sheaf_family.run_graph(run), partition_id)
        self.edge_dims = sheaf_family.interaction_dims(run)

    # ------------------------------------------------------------------ state
    def parameters_vector(self) -> np.ndarray:
        """``theta_i``: every trainable parameter, in ``model.parameters()`` order."""
        with torch.no_grad():
            return torch.nn.utils.parameters_to_vector(self.model.parameters()).cpu().numpy()

    def set_parameters(self, theta: np.ndarray) -> None:
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(
                self.tensor(theta.astype(np.float32)), self.model.parameters()
            )

    def restriction_maps(self) -> dict[int, np.ndarray]:
        """``P_ij`` for each neighbour ``j``: as stored, or drawn from the run's seed."""
        stored = self._stored(STATE_FMTL_MAPS)
        if stored:
            return {int(j): p for j, p in stored.items()}
        n = int(sum(p.numel() for p in self.model.parameters()))
        i = self.partition_id
        return {
            j: (
                MAP_SCALE
                * rng(self.run.seed, "sheaf-fmtl-map", i, j).standard_normal(
                    (self.edge_dims[i, j], n)
                )
            ).astype(np.float32)
            for j in self.neighbours
        }

    def keep_maps(self, maps: dict[int, np.ndarray]) -> None:
        self.state[STATE_FMTL_MAPS] = ArrayRecord(
            {str(j): Array(np.ascontiguousarray(p, dtype=np.float32)) for j, p in maps.items()}
        )

    # -------------------------------------------------------------- exchanges
    def projections_message(self, config: ConfigRecord) -> Arrays:
        """``P_ij theta_i`` for each neighbour ``j`` (float32)."""
        theta = self.parameters_vector().astype(np.float64)
        maps = self.restriction_maps()
        self.keep_maps(maps)
        return {
            sheaf_family.from_agent(PROJECTION, j): (p.astype(np.float64) @ theta).astype(
                np.float32
            )
            for j, p in maps.items()
        }

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """Local epochs on the private loss, then the sheaf steps on ``theta_i`` and
        the maps with the neighbours' projections that arrived."""
        _, metrics = super().fit({}, config)  # lambda = 0: the private loss alone
        received = {
            j: arrays[name].astype(np.float64)
            for j in self.neighbours
            if (name := sheaf_family.from_agent(PROJECTION, j)) in arrays
        }
        maps = self.restriction_maps()
        theta, maps, disagreement = sheaf_step(
            self.parameters_vector().astype(np.float64),
            maps,
            received,
            lr=config_float(config, protocol.LR),
            lam=self.fmtl.sheaf_fmtl_lambda,
            eta=self.fmtl.sheaf_fmtl_map_lr,
            clip=sheaf_family.settings(self.run).sheaf_clip,
        )
        self.set_parameters(theta)
        self.keep_maps(maps)
        self.save()
        metrics[PENALTY] = disagreement
        return {}, metrics


def sheaf_step(
    theta: np.ndarray,
    maps: dict[int, np.ndarray],
    received: dict[int, np.ndarray],
    *,
    lr: float,
    lam: float,
    eta: float,
    clip: float,
) -> tuple[np.ndarray, dict[int, np.ndarray], float]:
    """Sheaf-FMTL's steps on ``theta`` and on the maps of the edges in ``received``
    (see the module docstring); returns them and the mean over those edges of
    ``||P_ij theta_i - m_ji||^2`` before the steps (0 without any)."""
    if not received:
        return theta, maps, 0.0
    p64 = {j: maps[j].astype(np.float64) for j in received}
    gaps = {j: p64[j] @ theta - m for j, m in received.items()}
    disagreement = float(np.mean([g @ g for g in gaps.values()]))
    gradient = _clipped(lam * sum(p64[j].T @ g for j, g in gaps.items()), clip)
    theta = theta - lr * gradient
    updated = dict(maps)
    theta_norm = float(np.linalg.norm(theta))
    for j, m in received.items():
        gap = p64[j] @ theta - m
        # the gradient lam gap theta^T has norm lam ||gap|| ||theta||: no need to form it
        norm = lam * float(np.linalg.norm(gap)) * theta_norm
        scale = clip / norm if clip > 0 and norm > clip else 1.0
        updated[j] = (p64[j] - np.outer((eta * lam * scale) * gap, theta)).astype(np.float32)
    return theta, updated, disagreement


def _clipped(gradient: np.ndarray, clip: float) -> np.ndarray:
    """``gradient`` scaled down to norm ``clip`` (Frobenius) if above it; ``clip`` 0:
    unchanged."""
    norm = float(np.linalg.norm(gradient))
    if clip > 0 and norm > clip:
        return gradient * (clip / norm)
    return gradient
