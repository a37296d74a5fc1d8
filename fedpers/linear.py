"""Linear representation learning (FedRep, Section 4): pure numpy.

Notation as in the paper: ``B`` is the d x k representation, ``w`` a client's k-vector
head, a client's loss on m samples is ``f(w, B) = 1/(2m) ||y - X B w||^2``.
"""

from __future__ import annotations

import numpy as np


def orthonormalize(matrix: np.ndarray) -> np.ndarray:
    """Q of the thin QR decomposition, signs fixed so that diag(R) >= 0.

    FedRep's server step after averaging (Algorithm 1, linear case). Fixing the signs
    makes the result a function of the column space and the column order only.
    """
    q, r = np.linalg.qr(matrix)
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1.0
    return q * signs


def principal_angle_distance(estimate: np.ndarray, truth: np.ndarray) -> float:
    """``dist(B, B*) = ||(I - B_hat B_hat^T) B*_hat||_2`` (Definition 1 of the paper).

    ``B_hat`` and ``B*_hat`` are orthonormal bases of the column spaces; the value is
    the sine of the largest principal angle between the two subspaces (0: equal
    subspaces, 1: an orthogonal direction).
    """
    b_hat = orthonormalize(estimate)
    star_hat = orthonormalize(truth)
    residual = star_hat - b_hat @ (b_hat.T @ star_hat)
    return float(np.linalg.norm(residual, ord=2))


def moment_statistic(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """A client's Method-of-Moments message ``(1/m) sum_j y_j^2 x_j x_j^T`` (d x d)."""
    return (x * (y**2)[:, None]).T @ x / len(y)


def method_of_moments(statistics: list[np.ndarray], rank: int) -> np.ndarray:
    """Initial representation: top-``rank`` eigenvectors of the averaged statistics.

    With ``x ~ N(0, I)``, ``E[y^2 x x^T] = ||B* w||^2 I + 2 B* w w^T B*^T``, so the top
    eigenvectors of the average over clients span the column space of ``B*``
    (Tripuraneni et al. 2020, used by FedRep's Theorem 1).
    """
    average = np.mean(statistics, axis=0)
    eigenvalues, eigenvectors = np.linalg.eigh((average + average.T) / 2)
    top = eigenvectors[:, np.argsort(eigenvalues)[::-1][:rank]]
    return orthonormalize(top)


def least_squares_head(x: np.ndarray, y: np.ndarray, representation: np.ndarray) -> np.ndarray:
    """FedRep's exact head update ``argmin_w ||y - X B w||^2`` (minimum-norm solution)."""
    features = x @ representation
    head, *_ = np.linalg.lstsq(features, y, rcond=None)
    return np.asarray(head)


def head_gradient(
    x: np.ndarray, y: np.ndarray, representation: np.ndarray, head: np.ndarray
) -> np.ndarray:
    """``grad_w f(w, B) = -(1/m) B^T X^T (y - X B w)``."""
    residual = y - x @ (representation @ head)
    return -(representation.T @ (x.T @ residual)) / len(y)


def representation_gradient(
    x: np.ndarray, y: np.ndarray, representation: np.ndarray, head: np.ndarray
) -> np.ndarray:
    """``grad_B f(w, B) = -(1/m) X^T (y - X B w) w^T``."""
    residual = y - x @ (representation @ head)
    return -np.outer(x.T @ residual, head) / len(y)


def gradient_descent_head(
    x: np.ndarray,
    y: np.ndarray,
    representation: np.ndarray,
    head: np.ndarray,
    *,
    lr: float,
    steps: int,
) -> np.ndarray:
    """``steps`` gradient steps on the head (the GD-GD and 10GD-GD variants)."""
    for _ in range(steps):
        head = head - lr * head_gradient(x, y, representation, head)
    return head


def mean_squared_error(
    x: np.ndarray, y: np.ndarray, representation: np.ndarray, head: np.ndarray
) -> float:
    """Mean of ``(y - x^T B w)^2``."""
    return float(np.mean((y - x @ (representation @ head)) ** 2))
