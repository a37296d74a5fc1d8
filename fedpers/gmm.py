"""Mixtures of Gaussian components and learners: FedGMM (Wu et al., ICML 2023) and
FedEM (Marfoq et al., NeurIPS 2021). Pure numpy.

Client ``c`` models its joint distribution as

    P_c(x, y) = sum_{m1, m2} pi_c(m1, m2) N(z; mu_m1, Sigma_m1) P_theta_m2(y | x),

with ``z`` an embedding of ``x``, shared components and learners, and personal
weights ``pi_c``. FedEM is the case without Gaussians (one cell per learner).

Conventions: ``log_weights`` is ``log pi`` of shape (M1, M2); ``log_gauss`` the
component log-densities (n, M1); ``log_lik`` the learners' ``log P(y | x)`` (n, M2).
Everything is computed in log space with log-sum-exp over all M1 x M2 cells.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import solve_triangular
from scipy.special import logsumexp

WEIGHT_FLOOR = 1e-8
LOG_2PI = float(np.log(2 * np.pi))


@dataclass(frozen=True)
class Components:
    """Gaussian components: means (M1, d), covariances (M1, d, d) or (M1, d) if diagonal."""

    means: np.ndarray
    covariances: np.ndarray

    @property
    def kind(self) -> str:
        """``full`` or ``diag``."""
        return "full" if self.covariances.ndim == 3 else "diag"

    @property
    def count(self) -> int:
        """Number of components M1."""
        return int(self.means.shape[0])


@dataclass(frozen=True)
class Statistics:
    """Responsibility-weighted sufficient statistics of each component, centred.

    ``count[k] = sum_i r_ik``, ``first[k] = sum_i r_ik (z_i - c_k)``, ``second[k] =
    sum_i r_ik (z_i - c_k)(z_i - c_k)^T`` (diagonal only: its diagonal), around centres
    ``c_k`` (the current global means). Centring keeps the covariance exact for data far
    from the origin, where the one-pass ``E[zz^T] - mu mu^T`` cancels catastrophically.
    """

    count: np.ndarray
    first: np.ndarray
    second: np.ndarray
    center: np.ndarray

    def __add__(self, other: Statistics) -> Statistics:
        if not np.array_equal(self.center, other.center):
            raise ValueError("statistics around different centres cannot be pooled")
        return Statistics(
            self.count + other.count,
            self.first + other.first,
            self.second + other.second,
            self.center,
        )


# --------------------------------------------------------------------- densities
def log_gaussian(z: np.ndarray, components: Components) -> np.ndarray:
    """``log N(z_i; mu_k, Sigma_k)`` for every sample and component, shape (n, M1).

    Full covariances go through their Cholesky factor (log-determinant from its
    diagonal, Mahalanobis distance by a triangular solve).
    """
    n, d = z.shape
    out = np.empty((n, components.count))
    for k in range(components.count):
        diff = z - components.means[k]
        if components.kind == "full":
            try:
                factor = np.linalg.cholesky(components.covariances[k])
            except np.linalg.LinAlgError as error:
                raise np.linalg.LinAlgError(
                    f"covariance of component {k} is not positive definite; raise the "
                    "ridge (run-config key 'gmm-ridge')"
                ) from error
            solved = solve_triangular(factor, diff.T, lower=True)
            mahalanobis = np.sum(solved**2, axis=0)
            log_det = 2.0 * np.sum(np.log(np.diag(factor)))
        else:
            variances = components.covariances[k]
            mahalanobis = np.sum(diff**2 / variances, axis=1)
            log_det = float(np.sum(np.log(variances)))
        out[:, k] = -0.5 * (d * LOG_2PI + log_det + mahalanobis)
    return out


# ------------------------------------------------------------------------ E-step
def e_step(
    log_weights: np.ndarray, log_gauss: np.ndarray, log_lik: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Responsibilities ``q_i(m1, m2)`` and ``log P_c(x_i, y_i)`` (FedGMM eq. E).

    ``log q_i(m1, m2) = log pi(m1, m2) + log N(z_i; m1) + log P_m2(y_i | x_i) - norm``,
    normalized by log-sum-exp over all M1 x M2 cells. FedEM is M1 = 1 with
    ``log_gauss = 0`` (no density on x).

    Returns
    -------
    responsibilities : np.ndarray
        Shape (n, M1, M2); each sample's cells sum to one.
    log_joint : np.ndarray
        Shape (n,): the log-likelihood of each sample under the client's mixture.
    """
    joint = log_weights[None, :, :] + log_gauss[:, :, None] + log_lik[:, None, :]
    log_norm = logsumexp(joint, axis=(1, 2))
    return np.exp(joint - log_norm[:, None, None]), log_norm


def update_weights(responsibilities: np.ndarray, floor: float = WEIGHT_FLOOR) -> np.ndarray:
    """M-step for the personal weights: ``pi(m) = mean_i q_i(m)``, clamped and renormalized.

    The floor keeps every cell reachable (``log pi`` finite) when a client holds no
    sample of it.
    """
    if len(responsibilities) == 0:
        raise ValueError("cannot update mixture weights from zero samples")
    weights = np.maximum(responsibilities.mean(axis=0), floor)
    return np.asarray(weights / weights.sum())


def adapt_weights(
    log_gauss: np.ndarray,
    log_lik: np.ndarray,
    initial: np.ndarray,
    *,
    iterations: int = 50,
    tolerance: float = 1e-8,
) -> np.ndarray:
    """EM on the weights alone, components and learners fixed (a new client's adaptation).

    Each step is an E-step then ``update_weights``; it stops when the weights move less
    than ``tolerance`` (max norm).
    """
    weights = initial
    for _ in range(iterations):
        responsibilities, _ = e_step(np.log(weights), log_gauss, log_lik)
        new = update_weights(responsibilities)
        if np.max(np.abs(new - weights)) < tolerance:
            return new
        weights = new
    return weights


# ------------------------------------------------------------------------ M-step
def sufficient_statistics(
    z: np.ndarray, responsibilities: np.ndarray, center: np.ndarray, kind: str
) -> Statistics:
    """Centred statistics of each component given ``r_ik`` (shape (n, M1))."""
    count = responsibilities.sum(axis=0)
    first = np.empty_like(center, dtype=float)
    d = z.shape[1]
    second = np.empty((center.shape[0], d, d) if kind == "full" else center.shape, dtype=float)
    for k in range(center.shape[0]):
        diff = z - center[k]
        weighted = diff * responsibilities[:, k : k + 1]
        first[k] = weighted.sum(axis=0)
        second[k] = weighted.T @ diff if kind == "full" else (weighted * diff).sum(axis=0)
    return Statistics(count, first, second, np.asarray(center, dtype=float))


def components_from_statistics(
    stats: Statistics, *, ridge: float, previous: Components | None = None
) -> Components:
    """Exact M-step from (pooled) statistics: the mean and covariance of each component.

    ``mu = c + S1 / S0`` and ``Sigma = S2 / S0 - (mu - c)(mu - c)^T + ridge I``. A
    component with no responsibility anywhere keeps its previous parameters.
    """
    kind = "full" if stats.second.ndim == 3 else "diag"
    means = np.empty_like(stats.first)
    covariances = np.empty_like(stats.second)
    d = stats.first.shape[1]
    for k in range(len(stats.count)):
        if stats.count[k] <= 0:
            if previous is None:
                raise ValueError(f"component {k} has no responsibility and no previous value")
            means[k], covariances[k] = previous.means[k], previous.covariances[k]
            continue
        shift = stats.first[k] / stats.count[k]
        means[k] = stats.center[k] + shift
        if kind == "full":
            covariance = stats.second[k] / stats.count[k] - np.outer(shift, shift)
            covariances[k] = (covariance + covariance.T) / 2 + ridge * np.eye(d)
        else:
            covariances[k] = stats.second[k] / stats.count[k] - shift**2 + ridge
    return Components(means, covariances)


def average_components(
    local: list[Components], weights: np.ndarray, *, previous: Components
) -> Components:
    """The paper's server step: per component, average the clients' local means and
    covariances weighted by ``gamma_c(m1)`` (weights of shape (C, M1)).

    Unlike ``components_from_statistics`` on pooled statistics this drops the
    between-client spread of the means from the covariance: it is kept for reproducing
    the paper, not as the default.
    """
    total = weights.sum(axis=0)
    means = previous.means.copy()
    covariances = previous.covariances.copy()
    for k in range(previous.count):
        if total[k] <= 0:
            continue
        share = weights[:, k] / total[k]
        means[k] = sum(s * c.means[k] for s, c in zip(share, local, strict=True))
        covariances[k] = sum(s * c.covariances[k] for s, c in zip(share, local, strict=True))
    return Components(means, covariances)


def weighted_average(arrays: list[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """``sum_c w_c a_c / sum_c w_c`` (learners aggregated by their responsibilities)."""
    weights = np.asarray(weights, dtype=float)
    total = weights.sum()
    if not total > 0:
        raise ValueError("weights of an average must have a positive sum")
    return np.asarray(np.tensordot(weights / total, np.stack(arrays), axes=1))


# ------------------------------------------------------------ prediction, scores
def learner_posterior(log_weights: np.ndarray, log_gauss: np.ndarray) -> np.ndarray:
    """``p(m2 | x)`` (n, M2) from ``p(m1, m2 | x) ~ pi(m1, m2) N(z; mu_m1, Sigma_m1)``."""
    log_cells = log_weights[None, :, :] + log_gauss[:, :, None]
    log_m2 = logsumexp(log_cells, axis=1)
    return np.exp(log_m2 - logsumexp(log_m2, axis=1, keepdims=True))


def predict_proba(
    log_weights: np.ndarray, log_gauss: np.ndarray, learner_probs: np.ndarray
) -> np.ndarray:
    """``P(y | x) = sum_m2 p(m2 | x) softmax(f_m2(x))``; ``learner_probs`` is (n, M2, K)."""
    posterior = learner_posterior(log_weights, log_gauss)
    return np.einsum("nm,nmk->nk", posterior, learner_probs)


def log_marginal(log_weights: np.ndarray, log_gauss: np.ndarray) -> np.ndarray:
    """``log p(x) = log sum_m1 pi(m1) N(z; mu_m1, Sigma_m1)`` with ``pi(m1) = sum_m2 pi``."""
    log_m1 = logsumexp(log_weights, axis=1)
    return np.asarray(logsumexp(log_m1[None, :] + log_gauss, axis=1))


def global_weights(gammas: list[np.ndarray]) -> np.ndarray:
    """The server's mixture weights: ``pi(m1, m2) ~ sum_c gamma_c(m1, m2)``."""
    total = np.sum(gammas, axis=0)
    weights = np.maximum(total / total.sum(), WEIGHT_FLOOR)
    return np.asarray(weights / weights.sum())


# ----------------------------------------------------------------- initialization
def local_summary(z: np.ndarray, clusters: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A client's summary for federated k-means++: local k-means centroids and sizes.

    Only ``clusters`` centroids and their counts leave the client, never samples.
    """
    from sklearn.cluster import KMeans

    clusters = min(clusters, len(z))
    model = KMeans(n_clusters=clusters, n_init=1, random_state=seed % 2**32).fit(z)
    counts = np.bincount(model.labels_, minlength=clusters).astype(float)
    return np.asarray(model.cluster_centers_), counts


def initial_means(
    centroids: np.ndarray, counts: np.ndarray, components: int, seed: int
) -> np.ndarray:
    """The server's k-means++ over all clients' centroids, weighted by their sizes."""
    from sklearn.cluster import KMeans

    if len(centroids) < components:
        raise ValueError(f"{len(centroids)} client centroids cannot seed {components} components")
    model = KMeans(n_clusters=components, init="k-means++", n_init=4, random_state=seed % 2**32)
    model.fit(centroids, sample_weight=counts)
    return np.asarray(model.cluster_centers_)


def hard_responsibilities(z: np.ndarray, means: np.ndarray) -> np.ndarray:
    """One-hot assignment of each sample to its nearest mean (n, M1): the statistics
    that turn k-means centres into initial covariances."""
    distances = ((z[:, None, :] - means[None, :, :]) ** 2).sum(axis=2)
    return np.eye(len(means))[np.argmin(distances, axis=1)]


# --------------------------------------------------------------- PCA embedding
def moment_statistics(x: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """A client's contribution to a pooled PCA: ``(n, sum x, sum x x^T)``."""
    flat = x.reshape(len(x), -1).astype(float)
    return float(len(flat)), flat.sum(axis=0), flat.T @ flat


def pca_from_moments(
    count: float, total: np.ndarray, outer: np.ndarray, dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """Mean and top-``dim`` principal directions (dim, D) of the pooled data."""
    mean = total / count
    covariance = outer / count - np.outer(mean, mean)
    eigenvalues, eigenvectors = np.linalg.eigh((covariance + covariance.T) / 2)
    order = np.argsort(eigenvalues)[::-1][:dim]
    directions = eigenvectors[:, order].T
    # A direction is defined up to sign; fix it so that runs agree.
    signs = np.sign(directions[np.arange(dim), np.argmax(np.abs(directions), axis=1)])
    return mean, directions * signs[:, None]
