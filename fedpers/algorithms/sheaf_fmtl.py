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

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from flwr.app import Array, ArrayRecord

from fedpers import records, sheaf
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import PENALTY, PROJECTION
from fedpers.seeding import rng
from fedpers.settings import ConfigError, at_least, setting, step_size, within

if TYPE_CHECKING:
    from fedpers.agents_update import Agents
    from fedpers.cohort import Cohort, Member, Reply
    from fedpers.config import RunConfig
    from fedpers.training import Stack

STATE_FMTL_MAPS = "sheaf-fmtl.maps"  # context.state: P_ij by neighbour j
MAP_SCALE = 0.01  # the authors' initial maps: N(0, 0.01^2) entries
MAP_BYTES_LIMIT = 2**30  # the restriction maps one Sheaf-FMTL agent may hold (float32)


@dataclass(frozen=True)
class SheafFMTLSettings:
    """The restriction maps of Sheaf-FMTL between parameter spaces (the row `sheaf-fmtl`)."""

    HEADING: ClassVar[str] = "sheaf-fmtl"

    sheaf_fmtl_lambda: float = setting(
        0.001,
        "Sheaf-FMTL: weight of the sheaf penalty sum ||P_ij theta_i - P_ji theta_j||^2 "
        "over an agent's edges (the authors' 0.001)",
    )
    sheaf_fmtl_gamma: float = setting(
        0.005,
        "Sheaf-FMTL: an edge's interaction space has floor(gamma x the smaller agent's "
        "parameter count) dimensions (chosen on validation; the authors' 0.01)",
    )
    sheaf_fmtl_map_lr: float = setting(
        1e-5,
        "Sheaf-FMTL: step size eta of the restriction maps (chosen on validation; the "
        "authors' 1e-4)",
    )

    def check(self) -> None:
        at_least("sheaf-fmtl-lambda", self.sheaf_fmtl_lambda, 0.0)
        within("sheaf-fmtl-gamma", self.sheaf_fmtl_gamma, "(0, 1]")
        step_size("sheaf-fmtl-map-lr", self.sheaf_fmtl_map_lr, zero=True)


def interaction_dims(run: RunConfig) -> dict[tuple[int, int], int]:
    """The interaction-space dimension of each edge, both orientations."""
    counts = sheaf_family.parameter_counts(run)
    gamma = run.group(SheafFMTLSettings).sheaf_fmtl_gamma
    dims = {}
    for a, b in sheaf_family.run_graph(run):
        dims[a, b] = dims[b, a] = sheaf.interaction_dim(counts[a], counts[b], gamma)
    return dims


def check_map_memory(run: RunConfig) -> None:
    """The maps ``P_ij`` are ``d_ij x n_i`` floats per edge: refuse a run whose largest
    agent would hold more than ``MAP_BYTES_LIMIT`` of them, before anything starts (the
    parameter spaces' size is the method's known cost)."""
    counts = sheaf_family.parameter_counts(run)
    held = [0] * run.num_clients
    for (i, _), d in interaction_dims(run).items():
        held[i] += 4 * d * counts[i]
    largest = max(range(run.num_clients), key=lambda agent: held[agent])
    if held[largest] > MAP_BYTES_LIMIT:
        raise ConfigError(
            f"Sheaf-FMTL's restriction maps of agent {largest} ({counts[largest]} "
            f"parameters) would take {held[largest] / 2**30:.1f} GiB, more than "
            f"{MAP_BYTES_LIMIT / 2**30:.0f} GiB: lower 'sheaf-fmtl-gamma' (now "
            f"{run.group(SheafFMTLSettings).sheaf_fmtl_gamma}) or the agents' widths."
        )


def restriction_maps(run: RunConfig, member: Member, count: int) -> dict[int, np.ndarray]:
    """``P_ij`` for each neighbour ``j`` of an agent of ``count`` parameters: as it
    stored them, or drawn from the run's seed."""
    record = member.state.get(STATE_FMTL_MAPS)
    if isinstance(record, ArrayRecord) and len(record) > 0:
        return {int(j): records.values(p) for j, p in record.items()}
    i = member.partition
    edge_dims = interaction_dims(run)
    return {
        j: (
            MAP_SCALE
            * rng(run.seed, "sheaf-fmtl-map", i, j).standard_normal((edge_dims[i, j], count))
        ).astype(np.float32)
        for j in sheaf.neighbours(sheaf_family.run_graph(run), i)
    }


def _kept(maps: dict[int, np.ndarray]) -> ArrayRecord:
    return ArrayRecord(
        {str(j): Array(np.ascontiguousarray(p, dtype=np.float32)) for j, p in maps.items()}
    )


def projections_message(cohort: Cohort) -> list[Reply]:
    """``P_ij theta_i`` for each neighbour ``j`` (float32); the maps kept."""
    from fedpers import agents_update

    local = agents_update.Agents(cohort)
    thetas = local.each(lambda group, stack: local.parameter_vectors(stack))
    replies: list[Reply] = []
    for k, member in enumerate(local.members):
        theta = thetas[k].astype(np.float64)
        maps = restriction_maps(local.run, member, len(theta))
        local.writes[k][STATE_FMTL_MAPS] = _kept(maps)
        sent = {
            sheaf_family.from_agent(PROJECTION, j): (p.astype(np.float64) @ theta).astype(
                np.float32
            )
            for j, p in maps.items()
        }
        replies.append((sent, {}))
    local.commit()
    return replies


def fit(cohort: Cohort) -> list[Reply]:
    """The round's epochs on the private loss, then the sheaf steps on ``theta_i`` and
    the maps with the neighbours' projections that arrived."""
    from fedpers import agents_update

    local = agents_update.Agents(cohort)

    def one(group: list[int], stack: Stack) -> list[Reply]:
        metrics = local.train_private(group, stack)
        thetas = local.parameter_vectors(stack)
        for i, k in enumerate(group):
            metrics[i][PENALTY] = _step(local, stack, i, k, thetas[i].astype(np.float64))
        local.keep(group, stack)
        return [({}, m) for m in metrics]

    replies = local.each(one, training=True)
    local.commit()
    return replies


def _step(local: Agents, stack: Stack, i: int, k: int, theta: np.ndarray) -> float:
    """Member ``k``'s (``i``-th of the stack) sheaf steps; its maps kept."""
    member = local.members[k]
    received = {
        j: member.arrays[name].astype(np.float64)
        for j in sheaf.neighbours(sheaf_family.run_graph(local.run), member.partition)
        if (name := sheaf_family.from_agent(PROJECTION, j)) in member.arrays
    }
    settings = local.run.group(SheafFMTLSettings)
    theta, maps, disagreement = sheaf_step(
        theta,
        restriction_maps(local.run, member, len(theta)),
        received,
        lr=local.lr,
        lam=settings.sheaf_fmtl_lambda,
        eta=settings.sheaf_fmtl_map_lr,
        clip=local.clip,
    )
    local.set_parameters(stack, i, theta)
    local.writes[k][STATE_FMTL_MAPS] = _kept(maps)
    return disagreement


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


ROWS = (
    AlgorithmSpec(
        name="sheaf-fmtl",
        family=Family.SHEAF,
        shared=(),
        strategy="fedpers.strategies.sheaf_fmtl:SheafFMTL",
        settings=(SheafFMTLSettings,),
        checks=(check_map_memory,),
        paper="Ben Issaid et al., 2025",
    ),
)
