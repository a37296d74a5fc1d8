"""FedGMM client (Wu et al., "Personalized Federated Learning under Mixture of
Distributions", ICML 2023).

FedEM's mixture of learners, with M1 shared Gaussian components over an embedding
``z`` of the inputs: the E-step runs over all M1 x M2 cells,
``q_i(m1, m2) ~ pi_c(m1, m2) N(z_i; mu_m1, Sigma_m1) P_m2(y_i | x_i)``. Besides the
learners and ``gamma_c``, the client sends the responsibility-weighted statistics of
its embeddings, centred on the current global means, from which the server computes
the exact federated M-step. ``pi_c`` never leaves the device.
"""

from __future__ import annotations

import numpy as np

from fedpers import gmm
from fedpers.clients.common import Arrays
from fedpers.clients.fedem import FedEMClient
from fedpers.data.registry import DATASETS
from fedpers.embedding import encode, flatten, project
from fedpers.families import mixture as mixture_family
from fedpers.families.mixture import Embedding
from fedpers.seeding import int_seed


class FedGMMClient(FedEMClient):
    """Personal weights over (Gaussian component, learner) cells."""

    @property
    def components(self) -> int:
        return mixture_family.settings(self.run).gmm_components

    # ------------------------------------------------------------------- embedding
    def features(self, x: np.ndarray) -> np.ndarray:
        """What the embedding starts from: raw vectors, or encoder features."""
        if mixture_family.embedding(self.run) != Embedding.RESNET18:
            return flatten(x)
        shape = DATASETS[self.run.dataset].image_shape
        assert shape is not None
        return encode(
            x.reshape((len(x), *shape)), mixture_family.settings(self.run).gmm_encoder_weights
        )

    def embed(self, x: np.ndarray, arrays: Arrays) -> np.ndarray:
        """``z = phi(x)``: identity, or the pooled PCA sent by the server."""
        if mixture_family.embedding(self.run) == Embedding.IDENTITY:
            return flatten(x)
        return project(
            self.features(x), arrays[mixture_family.PCA_MEAN], arrays[mixture_family.PCA_DIRECTIONS]
        )

    def components_of(self, arrays: Arrays) -> gmm.Components:
        """The server's Gaussian components."""
        return gmm.Components(
            arrays[mixture_family.GMM_MEANS], arrays[mixture_family.GMM_COVARIANCES]
        )

    # -------------------------------------------------------------- FedEM hooks
    def log_densities(self, x: np.ndarray, arrays: Arrays) -> np.ndarray:
        return gmm.log_gaussian(self.embed(x, arrays), self.components_of(arrays))

    def statistics(self, x: np.ndarray, responsibilities: np.ndarray, arrays: Arrays) -> Arrays:
        components = self.components_of(arrays)
        stats = gmm.sufficient_statistics(
            self.embed(x, arrays),
            responsibilities.sum(axis=2),
            components.means,
            components.kind,
        )
        return _stats_arrays(stats)

    # ---------------------------------------------------------- initialization
    def pca_moments(self) -> Arrays:
        """``(n, sum f, sum f f^T)`` of this client's embedding inputs (pooled PCA)."""
        count, total, outer = gmm.moment_statistics(self.features(self.data.x_train))
        return {
            mixture_family.PCA_COUNT: np.array([count]),
            mixture_family.PCA_SUM: total,
            mixture_family.PCA_OUTER: outer,
        }

    def summary(self, arrays: Arrays) -> Arrays:
        """Local k-means centroids and sizes of the embeddings (federated k-means++)."""
        centroids, counts = gmm.local_summary(
            self.embed(self.data.x_train, arrays),
            clusters=2 * self.components,
            seed=int_seed(self.run.seed, "local-kmeans", self.partition_id),
        )
        return {mixture_family.SUMMARY_CENTROIDS: centroids, mixture_family.SUMMARY_COUNTS: counts}

    def assignment_statistics(self, arrays: Arrays) -> Arrays:
        """Statistics of hard assignments to the initial means (initial covariances)."""
        z = self.embed(self.data.x_train, arrays)
        means = arrays[mixture_family.GMM_MEANS]
        stats = gmm.sufficient_statistics(
            z,
            gmm.hard_responsibilities(z, means),
            means,
            mixture_family.settings(self.run).gmm_covariance,
        )
        return _stats_arrays(stats)


def _stats_arrays(stats: gmm.Statistics) -> Arrays:
    return {
        mixture_family.STATS_COUNT: stats.count,
        mixture_family.STATS_FIRST: stats.first,
        mixture_family.STATS_SECOND: stats.second,
    }
