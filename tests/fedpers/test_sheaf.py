"""Sheaf-FRL math against independent oracles (scipy's Procrustes, networkx's spanning
tree) and by-construction ground truths."""

import networkx as nx
import numpy as np
import pytest
from numpy.testing import assert_allclose
from scipy.linalg import orthogonal_procrustes
from scipy.stats import ortho_group

from fedpers import sheaf
from fedpers.data.partition import partition_shift, target_classes


def _pilots(k: int, d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((k, d))


def test_procrustes_recovers_a_known_rotation_and_agrees_with_scipy() -> None:
    small = _pilots(64, 6, 0)
    rotation = ortho_group.rvs(6, random_state=1)
    large = small @ rotation.T  # z_b = R z_a
    recovered = sheaf.procrustes(small, large)
    assert np.max(np.abs(recovered - rotation)) < 1e-10
    omega, _ = orthogonal_procrustes(small, large)  # min ||small @ omega - large||
    assert np.max(np.abs(recovered - omega.T)) < 1e-10


def test_procrustes_recovers_a_known_stiefel_embedding() -> None:
    small = _pilots(64, 4, 2)
    embedding = np.linalg.qr(np.random.default_rng(3).standard_normal((9, 4)))[0]
    large = small @ embedding.T
    recovered = sheaf.procrustes(small, large)
    assert np.max(np.abs(recovered - embedding)) < 1e-10
    assert_allclose(recovered.T @ recovered, np.eye(4), atol=1e-12)
    with pytest.raises(ValueError, match="d_small <= d_large"):
        sheaf.procrustes(large, small)


def test_penalty_is_zero_exactly_when_aligned_and_invariant_to_common_rotations() -> None:
    small = _pilots(50, 5, 4)
    embedding = np.linalg.qr(np.random.default_rng(5).standard_normal((7, 5)))[0]
    aligned = small @ embedding.T
    assert sheaf.gluing_penalty(small, aligned, sheaf.procrustes(small, aligned)) < 1e-25
    noisy = aligned + 0.1 * _pilots(50, 7, 6)
    base = sheaf.gluing_penalty(small, noisy, sheaf.procrustes(small, noisy))
    assert base > 1e-4
    # Rotating either latent space (and refitting the map) changes nothing.
    q_small, q_large = ortho_group.rvs(5, random_state=7), ortho_group.rvs(7, random_state=8)
    turned_small, turned_large = small @ q_small, noisy @ q_large
    refit = sheaf.procrustes(turned_small, turned_large)
    assert sheaf.gluing_penalty(turned_small, turned_large, refit) == pytest.approx(base, rel=1e-9)


def test_torch_penalty_of_a_pilot_batch_equals_the_numpy_penalty_of_each_edge() -> None:
    """The training penalty (torch, one agent's batch) against ``gluing_penalty``: the
    agent ``i`` (d = 5) is the small side of one edge and the large side of two."""
    import torch

    k, batch = 40, 16
    own = _pilots(k, 5, 20)
    larger = _pilots(k, 7, 21)  # i -> larger
    smaller = [_pilots(k, 3, 22), _pilots(k, 5, 23)]  # smaller -> i (a tie: same dims)
    up = sheaf.procrustes(own, larger)
    downs = [sheaf.procrustes(s, own) for s in smaller]
    index = np.random.default_rng(24).permutation(k)[:batch]
    expected = sheaf.gluing_penalty(own[index], larger[index], up) + sum(
        sheaf.gluing_penalty(s[index], own[index], v) for s, v in zip(smaller, downs, strict=True)
    )
    for dtype, rel in ((torch.float64, 1e-12), (torch.float32, 1e-5)):

        def as_t(array: np.ndarray, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.from_numpy(array).to(dtype)

        mine = as_t(own[index]).requires_grad_()
        edges: list[tuple[torch.Tensor, torch.Tensor | None]] = [
            (as_t(sheaf.transport_down(larger, up)[index]), None),  # small side
            *((as_t(s[index]), as_t(v)) for s, v in zip(smaller, downs, strict=True)),
        ]
        total = sheaf.gluing_penalty_torch(mine, edges)
        assert total.shape == ()
        assert float(total) == pytest.approx(expected, rel=rel)
        total.backward()  # differentiable in the agent's own pilots
        assert mine.grad is not None
        assert float(mine.grad.abs().sum()) > 0
    assert float(sheaf.gluing_penalty_torch(torch.zeros(batch, 5), [])) == 0.0


def test_whitening_and_colouring_are_inverse_and_whiten() -> None:
    latents = _pilots(500, 6, 9) @ np.random.default_rng(10).standard_normal((6, 6)) + 3.0
    whitening = sheaf.Whitening.fit(latents)
    whitened = whitening.whiten(latents)
    assert_allclose(np.cov(whitened, rowvar=False), np.eye(6), atol=1e-8)
    assert_allclose(whitening.colour(whitened), latents, atol=1e-10)


def test_whitening_floors_small_eigenvalues() -> None:
    flat = np.c_[_pilots(200, 2, 11), np.zeros(200)]  # a degenerate direction
    whitening = sheaf.Whitening.fit(flat)
    assert np.all(np.isfinite(whitening.whiten_matrix))
    assert_allclose(whitening.colour(whitening.whiten(flat)), flat, atol=1e-10)


def test_graph_is_connected_deterministic_dense_enough_and_oriented() -> None:
    targets = target_classes(15, 10, seed=0)
    dims = [s.latent for s in sheaf.agent_specs(15, scale=0.125, latent_dims=None, hidden=None)]
    edges = sheaf.class_overlap_graph(targets, dims, density=0.4)
    assert edges == sheaf.class_overlap_graph(targets, dims, density=0.4)
    assert len(edges) == 42  # floor(0.4 * 15 * 14 / 2)
    assert len(set(edges)) == 42
    assert all((dims[a], a) <= (dims[b], b) for a, b in edges)
    graph = nx.Graph(edges)
    assert nx.is_connected(graph)
    assert graph.number_of_nodes() == 15
    # It contains a maximum-weight spanning tree of the class-overlap weights.
    full = nx.Graph()
    for i in range(15):
        for j in range(i + 1, 15):
            full.add_edge(i, j, weight=len(targets[i] & targets[j]))
    best = nx.maximum_spanning_tree(full).size(weight="weight")
    ours = nx.Graph()
    ours.add_weighted_edges_from((a, b, len(targets[a] & targets[b])) for a, b in edges)
    assert nx.maximum_spanning_tree(ours).size(weight="weight") == best


def test_shift_partition_concentrates_on_targets() -> None:
    labels = np.random.default_rng(12).integers(0, 10, 6000)
    targets = [frozenset({0, 1, 2}), frozenset({3, 4, 5, 6}), frozenset({7, 8, 9})]
    uniform = partition_shift(labels, targets, 0.0, seed=0)
    skewed = partition_shift(labels, targets, 0.9, seed=0)
    for parts in (uniform, skewed):
        joined = np.concatenate(parts)
        assert len(joined) == len(np.unique(joined)) == len(labels)
    share = [np.isin(labels[p], sorted(t)).mean() for p, t in zip(skewed, targets, strict=True)]
    assert min(share) > 0.85  # theta puts 0.9 + 0.1 * |T| / 10 on the targets
    share0 = [np.isin(labels[p], sorted(t)).mean() for p, t in zip(uniform, targets, strict=True)]
    assert max(abs(s - len(t) / 10) for s, t in zip(share0, targets, strict=True)) < 0.05
