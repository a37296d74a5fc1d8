"""FedGMM (Wu et al., "Personalized Federated Learning under Mixture of
Distributions", ICML 2023).

Shared Gaussian components over an embedding of the inputs and shared learners,
personal weights ``pi_c(m1, m2)``. The server

- initializes, once, the components every client starts from: a pooled PCA (when the
  embedding asks for one), k-means++ over the clients' local centroids, then the
  covariances of the points nearest each mean, all from client summaries;
- aggregates the learners weighted by the clients' responsibilities
  ``gamma_c(m2) = sum_m1 gamma_c(m1, m2)`` (the paper's rule);
- updates the components by exact federated EM: it pools the clients' centred
  sufficient statistics (``gmm-aggregation = "exact"``, equal to centralized EM for one
  client or clients sharing their weights), or, to reproduce the paper,
  averages the clients' local means and covariances weighted by ``gamma_c(m1)``
  (``"average"``).
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedpers import gmm, protocol
from fedpers.config import Embedding, GmmAggregation, GmmCovariance, RunConfig
from fedpers.protocol import (
    PCA_COUNT,
    PCA_OUTER,
    PCA_SUM,
    SUMMARY_CENTROIDS,
    SUMMARY_COUNTS,
)
from strategies import screening
from strategies.fedem import FedEM


class FedGMM(FedEM):
    """FedEM plus federated Gaussian components.

    Reads ``gmm-components`` (M1), ``gmm-covariance``, ``gmm-ridge``,
    ``gmm-aggregation`` and ``gmm-embedding``/``gmm-embedding-dim`` besides what
    ``FedEM`` reads.
    """

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.num_components = run.gmm_components
        self.covariance = run.gmm_covariance
        self.ridge = run.gmm_ridge
        self.aggregation = run.gmm_aggregation
        self.embedding = run.embedding
        self.embedding_dim = run.gmm_embedding_dim

    @property
    def components(self) -> int:
        return self.num_components

    def expected_arrays(self) -> dict[str, screening.ArraySpec]:
        """FedEM's, and the statistics of the embeddings, shaped as the components."""
        means = self.sent_arrays[protocol.GMM_MEANS][0]
        covariances = self.sent_arrays[protocol.GMM_COVARIANCES][0]
        return {
            **super().expected_arrays(),
            protocol.STATS_COUNT: ((means[0],), "float64"),
            protocol.STATS_FIRST: (means, "float64"),
            protocol.STATS_SECOND: (covariances, "float64"),
        }

    def checks(self) -> list[screening.Check]:
        """FedEM's, then the statistics' invariants."""
        return [*super().checks(), self.statistics_defect]

    def statistics_defect(self, reply: Message) -> str | None:
        """The statistics ``(sum r, sum r (z - c), sum r (z - c)(z - c)^T)`` must be those
        of some data: counts non-negative and equal to ``gamma_c(m1)``, second moments
        symmetric positive semi-definite, and the implied covariances too."""
        arrays = screening.arrays_of(reply)
        count = arrays[protocol.STATS_COUNT]
        first, second = arrays[protocol.STATS_FIRST], arrays[protocol.STATS_SECOND]
        if np.any(count < 0):
            return "negative statistics counts"
        expected = arrays[protocol.GAMMA].sum(axis=1)
        if not np.allclose(count, expected, rtol=1e-6, atol=1e-6):
            return "statistics counts differ from the responsibilities"
        safe = np.maximum(count, 1e-12)
        if self.covariance == GmmCovariance.FULL:
            if reason := screening.symmetric_psd_defect(protocol.STATS_SECOND, second):
                return reason
            implied = second - np.einsum("ki,kj->kij", first, first) / safe[:, None, None]
            return screening.symmetric_psd_defect("implied covariance", implied, tolerance=1e-5)
        if np.any(second < 0):
            return f"'{protocol.STATS_SECOND}' has negative variances"
        implied = second - first**2 / safe[:, None]
        if np.any(implied < -1e-5 * max(1.0, float(np.max(np.abs(second), initial=0.0)))):
            return "implied variances are negative"
        return None

    def state_defect(self, new: ArrayRecord, previous: ArrayRecord) -> str | None:
        """FedEM's, and every covariance positive definite."""
        reason = super().state_defect(new, previous)
        if reason is not None:
            return reason
        covariances = new[protocol.GMM_COVARIANCES].numpy()
        if self.covariance == GmmCovariance.FULL:
            try:
                np.linalg.cholesky(covariances)
            except np.linalg.LinAlgError:
                return "a global covariance is not positive definite"
        elif np.any(covariances <= 0):
            return "a global variance is not positive"
        return None

    def learner_weights(self, content: RecordDict) -> np.ndarray:
        """``gamma_c(m2)``: a client's responsibility for each learner."""
        gamma = content.array_records[protocol.ARRAYS][protocol.GAMMA].numpy()
        return np.asarray(gamma.sum(axis=0))

    # ------------------------------------------------------------ initialization
    def initial_arrays(self, grid: Grid, *, timeout: float) -> ArrayRecord:
        """Learners and uniform weights (FedEM), then the shared initial components."""
        arrays = super().initial_arrays(grid, timeout=timeout)
        if self.embedding != Embedding.IDENTITY:
            moments = self._ask(grid, protocol.QUERY_PCA, RecordDict(), timeout)
            mean, directions = gmm.pca_from_moments(
                float(sum(m[PCA_COUNT].numpy()[0] for m in moments)),
                np.sum([m[PCA_SUM].numpy() for m in moments], axis=0),
                np.sum([m[PCA_OUTER].numpy() for m in moments], axis=0),
                self.embedding_dim,
            )
            arrays[protocol.PCA_MEAN] = Array(mean)
            arrays[protocol.PCA_DIRECTIONS] = Array(np.ascontiguousarray(directions))
        records = self._ask(
            grid, protocol.QUERY_SUMMARY, RecordDict({protocol.ARRAYS: arrays}), timeout
        )
        means = gmm.initial_means(
            np.concatenate([r[SUMMARY_CENTROIDS].numpy() for r in records]),
            np.concatenate([r[SUMMARY_COUNTS].numpy() for r in records]),
            self.num_components,
            self.run.seed,
        )
        arrays[protocol.GMM_MEANS] = Array(np.ascontiguousarray(means))
        assigned = self._ask(
            grid, protocol.QUERY_ASSIGN, RecordDict({protocol.ARRAYS: arrays}), timeout
        )
        pooled = _pooled(assigned, means)
        start = gmm.components_from_statistics(
            pooled, ridge=self.ridge, previous=_fallback(means, self.covariance)
        )
        arrays[protocol.GMM_COVARIANCES] = Array(np.ascontiguousarray(start.covariances))
        return arrays

    def _ask(
        self, grid: Grid, query: str, content: RecordDict, timeout: float
    ) -> list[ArrayRecord]:
        """Every seen client's answer to an initialization query, in partition order."""
        replies = self.federation.broadcast(
            grid, query, self.seen, content, timeout=timeout
        ).require_all()
        return [replies[p].array_records[protocol.ARRAYS] for p in self.seen]

    # ---------------------------------------------------------------- aggregation
    def aggregate_components(
        self, arrays: list[ArrayRecord], gammas: list[np.ndarray]
    ) -> dict[str, np.ndarray]:
        """New means and covariances from the clients' centred statistics."""
        previous = gmm.Components(
            self.current[protocol.GMM_MEANS].numpy(),
            self.current[protocol.GMM_COVARIANCES].numpy(),
        )
        if self.aggregation == GmmAggregation.EXACT:
            new = gmm.components_from_statistics(
                _pooled(arrays, previous.means), ridge=self.ridge, previous=previous
            )
        else:
            local = [
                gmm.components_from_statistics(
                    _pooled([a], previous.means), ridge=self.ridge, previous=previous
                )
                for a in arrays
            ]
            component_weights = np.stack([g.sum(axis=1) for g in gammas])  # (C, M1)
            new = gmm.average_components(local, component_weights, previous=previous)
        return {protocol.GMM_MEANS: new.means, protocol.GMM_COVARIANCES: new.covariances}


def _pooled(arrays: list[ArrayRecord], center: np.ndarray) -> gmm.Statistics:
    """Sum of the clients' statistics, all centred on ``center``."""
    total: gmm.Statistics | None = None
    for record in arrays:
        stats = gmm.Statistics(
            record[protocol.STATS_COUNT].numpy(),
            record[protocol.STATS_FIRST].numpy(),
            record[protocol.STATS_SECOND].numpy(),
            np.asarray(center, dtype=float),
        )
        total = stats if total is None else total + stats
    if total is None:
        raise ValueError("no statistics to pool")
    return total


def _fallback(means: np.ndarray, covariance: str) -> gmm.Components:
    """Unit covariances, for a component no client sample is nearest to."""
    d = means.shape[1]
    unit = (
        np.stack([np.eye(d)] * len(means))
        if covariance == GmmCovariance.FULL
        else np.ones_like(means)
    )
    return gmm.Components(means, unit)
