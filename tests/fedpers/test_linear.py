"""Linear FedRep math against independent oracles (scipy, numpy least squares)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose
from scipy.linalg import orth, subspace_angles

from fedpers import linear
from fedpers.data.synthetic import LinearTasks


def _random(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def test_orthonormalize_keeps_column_space_and_is_orthonormal() -> None:
    matrix = _random((10, 3), 0)
    q = linear.orthonormalize(matrix)
    assert_allclose(q.T @ q, np.eye(3), atol=1e-12)
    # Same column space: the projection of the original columns onto Q is exact.
    assert_allclose(q @ (q.T @ matrix), matrix, atol=1e-12)
    # Signs fixed: diag(Q^T M) = diag(R) >= 0.
    assert np.all(np.diag(q.T @ matrix) >= 0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), d=st.integers(3, 12), k=st.integers(1, 3))
def test_principal_angle_distance_is_sine_of_largest_scipy_angle(seed: int, d: int, k: int) -> None:
    a, b = _random((d, k), seed), _random((d, k), seed + 1)
    expected = np.sin(subspace_angles(a, b).max())
    assert linear.principal_angle_distance(a, b) == pytest.approx(expected, abs=1e-10)


def test_principal_angle_distance_extremes() -> None:
    basis = orth(_random((8, 2), 3))
    assert linear.principal_angle_distance(basis @ _random((2, 2), 4), basis) < 1e-12
    e = np.eye(4)
    assert linear.principal_angle_distance(e[:, :2], e[:, 2:]) == pytest.approx(1.0)


def test_least_squares_head_matches_normal_equations() -> None:
    x, y, b = _random((30, 6), 5), _random((30,), 6), _random((6, 2), 7)
    features = x @ b
    expected = np.linalg.solve(features.T @ features, features.T @ y)
    assert_allclose(linear.least_squares_head(x, y, b), expected, atol=1e-10)


def test_gradients_match_finite_differences() -> None:
    x, y, b, w = (
        _random((7, 5), 8),
        _random((7,), 9),
        _random((5, 2), 10),
        _random((2,), 11),
    )

    def loss(bb: np.ndarray, ww: np.ndarray) -> float:
        return 0.5 * float(np.mean((y - x @ bb @ ww) ** 2))

    eps = 1e-6
    grad_b = np.zeros_like(b)
    for i in np.ndindex(b.shape):
        step = np.zeros_like(b)
        step[i] = eps
        grad_b[i] = (loss(b + step, w) - loss(b - step, w)) / (2 * eps)
    grad_w = np.array(
        [(loss(b, w + eps * e) - loss(b, w - eps * e)) / (2 * eps) for e in np.eye(2)]
    )
    assert_allclose(linear.representation_gradient(x, y, b, w), grad_b, atol=1e-7)
    assert_allclose(linear.head_gradient(x, y, b, w), grad_w, atol=1e-7)


def test_many_head_gradient_steps_converge_to_least_squares() -> None:
    x, y, b = (
        _random((50, 6), 12),
        _random((50,), 13),
        linear.orthonormalize(_random((6, 2), 14)),
    )
    head = linear.gradient_descent_head(x, y, b, np.zeros(2), lr=0.5, steps=500)
    assert_allclose(head, linear.least_squares_head(x, y, b), atol=1e-8)


def test_method_of_moments_recovers_the_subspace_with_many_samples() -> None:
    tasks = LinearTasks(dim=10, rank=2, noise_std=0.0, seed=0)
    generator = np.random.default_rng(1)
    stats = [linear.moment_statistic(*tasks.sample(i, 2000, generator)) for i in range(20)]
    estimate = linear.method_of_moments(stats, rank=2)
    assert linear.principal_angle_distance(estimate, tasks.representation) < 0.1
    assert_allclose(estimate.T @ estimate, np.eye(2), atol=1e-12)


def test_linear_tasks_are_deterministic_and_normalized() -> None:
    tasks = LinearTasks(dim=10, rank=2, noise_std=0.0, seed=3)
    again = LinearTasks(dim=10, rank=2, noise_std=0.0, seed=3)
    assert_allclose(tasks.representation, again.representation)
    assert_allclose(tasks.representation.T @ tasks.representation, np.eye(2), atol=1e-12)
    assert np.linalg.norm(tasks.head(5)) == pytest.approx(1.0)
    x, y = tasks.sample(5, 4, np.random.default_rng(0))
    assert_allclose(y, x @ tasks.representation @ tasks.head(5))  # noise-free labels
