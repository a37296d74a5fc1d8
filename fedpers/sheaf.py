"""Sheaf-FRL (Sheaf-based Federated Representation Learning, 2026): pure math.

Agents on an undirected graph keep their own encoders with latent dimensions ``d_i``.
An edge ``(a, b)`` is oriented from the lower to the higher latent dimension (ties: from
the lower index), so ``d_a <= d_b``, and carries a restriction map
``V in St(d_b, d_a)`` (``V^T V = I``): an isometric embedding of ``a``'s latent space into
``b``'s. With equal dimensions ``V`` is orthogonal.

Pilots are labelled samples every agent holds. ``A_i`` is agent ``i``'s matrix of
*whitened* pilot latents, one row per pilot (K x d_i).

Gluing penalty (the authors' code's form, used here): for an edge ``a -> b``,

    P_ab = 1 / (2 K d_a) * sum_k || V^T w_b^k - w_a^k ||^2,

the pilots of the larger space projected onto the image of ``V`` and compared with the
smaller space. The paper writes ``||A_b - V A_a||_F^2 / (2K)`` instead; the two agree
when ``d_a = d_b`` and otherwise differ by ``||(I - V V^T) w_b||^2``, which would push
the larger agent's pilots into a ``d_a``-dimensional subspace and so shrink its own
representation. The code's form leaves those directions free, and the ``1 / d_a``
keeps ``lambda`` comparable across edges of different sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported only where the training penalty needs it
    import torch

EIGENVALUE_FLOOR = 1e-2


# ------------------------------------------------------------------- agents
# The paper's 15 agents (Table 2): latent dimensions and dropout rates. fedpers scales
# the dimensions to the data (x 1/8 for the 8x8 digits) and cycles the pattern for
# other numbers of agents.
PAPER_LATENT_DIMS = (128, 224, 64, 128, 192, 96, 256, 144, 160, 80, 120, 240, 80, 96, 160)
PAPER_DROPOUTS = (0.05, 0.3, 0.1, 0.2, 0.4, 0.15, 0.25, 0.35, 0.05, 0.1, 0.2, 0.3, 0.15, 0.25, 0.4)


@dataclass(frozen=True)
class AgentSpec:
    """An agent's architecture: latent dimension, encoder and head widths, dropout."""

    latent: int
    hidden: int
    head_hidden: int
    dropout: float


def agent_specs(
    count: int, *, scale: float, latent_dims: list[int] | None, hidden: list[int] | None
) -> list[AgentSpec]:
    """Heterogeneous agents: the paper's pattern scaled, or explicit dimensions."""
    dims = latent_dims or [
        max(2, round(scale * PAPER_LATENT_DIMS[i % len(PAPER_LATENT_DIMS)])) for i in range(count)
    ]
    if len(dims) != count:
        raise ValueError(f"{len(dims)} latent dimensions for {count} agents")
    widths = hidden or [max(32, 4 * d) for d in dims]
    if len(widths) != count:
        raise ValueError(f"{len(widths)} hidden widths for {count} agents")
    return [
        AgentSpec(
            latent=d,
            hidden=w,
            head_hidden=max(16, 2 * d),
            dropout=PAPER_DROPOUTS[i % len(PAPER_DROPOUTS)],
        )
        for i, (d, w) in enumerate(zip(dims, widths, strict=True))
    ]


def parameter_count(spec: AgentSpec, dataset: str, num_classes: int) -> int:
    """Trainable parameters of ``fedpers.models.agents.build_agent(spec, dataset, ...)``,
    counted without torch (a server sizes Sheaf-FMTL's messages from it).

    Digits: Linear(64, h), Linear(h, d). MNIST: Conv3x3(1, h) + BatchNorm(h),
    Conv3x3(h, d) + BatchNorm(d). Head: Linear(d, hh), Linear(hh, classes).
    """
    h, d, hh = spec.hidden, spec.latent, spec.head_hidden
    if dataset == "digits":
        body = 64 * h + h + h * d + d
    elif dataset == "mnist":
        body = (9 * h + h) + 2 * h + (9 * h * d + d) + 2 * d
    else:
        raise ValueError(f"no Sheaf-FRL agent for dataset '{dataset}'")
    return body + d * hh + hh + hh * num_classes + num_classes


def interaction_dim(count_i: int, count_j: int, gamma: float) -> int:
    """Sheaf-FMTL's edge stalk: ``floor(gamma min(n_i, n_j))`` dimensions (at least 1)
    for agents of ``n_i`` and ``n_j`` parameters (Ben Issaid et al. 2025)."""
    return max(1, int(gamma * min(count_i, count_j)))


def class_means(
    latents: np.ndarray, labels: np.ndarray, classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """The mean latent of each class (zeros for a class without samples) and the samples
    behind each (float64): FedProto's and CoMFed's class prototypes."""
    counts = np.bincount(labels, minlength=classes).astype(np.float64)
    sums = np.zeros((classes, latents.shape[1]))
    np.add.at(sums, labels, latents)
    return sums / np.maximum(counts, 1.0)[:, None], counts


# ---------------------------------------------------------------------- graph
def class_overlap_graph(
    targets: list[frozenset[int]], dims: list[int], density: float
) -> list[tuple[int, int]]:
    """The paper's communication graph, as oriented edges ``(a, b)`` with ``d_a <= d_b``.

    Weight ``w_ij = |T_i & T_j|`` (shared target classes). Start from the maximum-weight
    spanning tree (connected), then add the other pairs by decreasing weight until
    ``floor(density * N (N - 1) / 2)`` edges; ties broken by index (the pair ``(i, j)``
    with smaller ``i``, then smaller ``j``, first). Deterministic.
    """
    n = len(targets)
    if len(dims) != n:
        raise ValueError("one latent dimension per agent is needed")
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    ranked = sorted(pairs, key=lambda p: (-len(targets[p[0]] & targets[p[1]]), p))
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    chosen: list[tuple[int, int]] = []
    for i, j in ranked:  # Kruskal on decreasing weights = maximum-weight spanning tree
        ri, rj = root(i), root(j)
        if ri != rj:
            parent[ri] = rj
            chosen.append((i, j))
    target = max(int(np.floor(density * n * (n - 1) / 2)), n - 1)
    for pair in ranked:
        if len(chosen) >= target:
            break
        if pair not in chosen:
            chosen.append(pair)
    return sorted(orient(i, j, dims) for i, j in chosen)


def orient(i: int, j: int, dims: list[int]) -> tuple[int, int]:
    """The edge ``{i, j}`` from the lower to the higher dimension (ties: lower index)."""
    return (i, j) if (dims[i], i) <= (dims[j], j) else (j, i)


def neighbours(edges: list[tuple[int, int]], agent: int) -> list[int]:
    """Agents sharing an edge with ``agent``, sorted."""
    return sorted({b for a, b in edges if a == agent} | {a for a, b in edges if b == agent})


# -------------------------------------------------------------- restriction maps
def procrustes(small: np.ndarray, large: np.ndarray) -> np.ndarray:
    """The restriction map ``V`` (d_b x d_a, orthonormal columns) of an edge ``a -> b``.

    ``small`` (K x d_a) and ``large`` (K x d_b), ``d_a <= d_b``, are the two endpoints'
    pilot matrices. ``V`` maximizes ``tr(V^T C)`` with ``C = large^T small`` over the
    Stiefel manifold, i.e. minimizes ``||small V^T - large||_F``: from the thin SVD
    ``C = U S W^T``, ``V = U W^T`` (orthogonal Procrustes; unique when ``C`` has full
    rank, so both endpoints computing it get the same map).
    """
    if small.shape[1] > large.shape[1]:
        raise ValueError("procrustes(small, large) needs d_small <= d_large")
    u, _, wt = np.linalg.svd(large.T @ small, full_matrices=False)
    return np.asarray(u @ wt)


def transport_up(small_latents: np.ndarray, restriction: np.ndarray) -> np.ndarray:
    """Latents of the smaller space embedded in the larger: ``z V^T`` (rows)."""
    return small_latents @ restriction.T


def transport_down(large_latents: np.ndarray, restriction: np.ndarray) -> np.ndarray:
    """Latents of the larger space projected into the smaller: ``z V`` (rows)."""
    return large_latents @ restriction


def gluing_penalty(small: np.ndarray, large: np.ndarray, restriction: np.ndarray) -> float:
    """``1 / (2 K d_a) * sum_k ||V^T w_b^k - w_a^k||^2`` (the code's form, see module doc)."""
    k, d_small = small.shape
    residual = transport_down(large, restriction) - small
    return float(np.sum(residual**2) / (2 * k * d_small))


def gluing_penalty_torch(
    own: torch.Tensor, edges: Sequence[tuple[torch.Tensor, torch.Tensor | None]]
) -> torch.Tensor:
    """An agent's summed gluing penalty on a batch of pilots, differentiable in ``own``.

    ``own`` (B x d) are this agent's whitened latents of a batch of pilots; each edge is
    ``(target, restriction)`` with ``target`` (B x d_t) the neighbour's pilots of the same
    batch already in the frame they are compared in. The edge's term is
    ``||own R - target||_F^2 / (2 B d_t)`` with ``R = restriction`` (or the identity when
    None), so it equals ``gluing_penalty``: on the small side of ``a -> b``, ``own = w_a``
    with ``target = w_b V`` and no restriction; on the large side ``own = w_b`` with
    ``R = V`` and ``target = w_a``. Terms are added in ``edges``' order to a float32 zero.
    """
    import torch

    total = torch.zeros(())
    for target, restriction in edges:
        mine = own if restriction is None else own @ restriction
        residual = mine - target
        total = total + residual.pow(2).sum() / (2 * len(residual) * residual.shape[1])
    return total


# ------------------------------------------------------------------ whitening
@dataclass(frozen=True)
class Whitening:
    """ZCA whitening ``w = (z - mu) W`` with ``W = Sigma^(-1/2)``, and its inverse
    colouring ``z = w C + mu`` with ``C = Sigma^(1/2)`` (eigenvalues floored)."""

    mean: np.ndarray
    whiten_matrix: np.ndarray
    colour_matrix: np.ndarray

    @classmethod
    def fit(cls, latents: np.ndarray, floor: float = EIGENVALUE_FLOOR) -> Whitening:
        """Fit on latents (n x d); eigenvalues of the covariance floored at ``floor``."""
        mean = latents.mean(axis=0)
        centred = latents - mean
        covariance = centred.T @ centred / max(len(latents) - 1, 1)
        eigenvalues, eigenvectors = np.linalg.eigh((covariance + covariance.T) / 2)
        eigenvalues = np.maximum(eigenvalues, floor)
        whiten = (eigenvectors / np.sqrt(eigenvalues)) @ eigenvectors.T
        colour = (eigenvectors * np.sqrt(eigenvalues)) @ eigenvectors.T
        return cls(mean, whiten, colour)

    def whiten(self, latents: np.ndarray) -> np.ndarray:
        """Whitened latents (rows)."""
        return np.asarray((latents - self.mean) @ self.whiten_matrix)

    def colour(self, whitened: np.ndarray) -> np.ndarray:
        """The inverse of ``whiten``."""
        return np.asarray(whitened @ self.colour_matrix + self.mean)
