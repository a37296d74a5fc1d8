"""FedGMM (Wu, Nguyen, Zhang, Wang, Zhang and Xu, "Personalized Federated Learning under
Mixture of Distributions", ICML 2023).

FedEM's mixture of learners (``fedpers.algorithms.fedem``), with M1 shared Gaussian
components over an embedding ``z`` of the inputs: the E-step runs over all M1 x M2
cells, ``q_i(m1, m2) ~ pi_c(m1, m2) N(z_i; mu_m1, Sigma_m1) P_m2(y_i | x_i)``. Besides
the learners and ``gamma_c``, the client sends the responsibility-weighted statistics
of its embeddings, centred on the current global means, from which the server
(``strategies/fedgmm.py``) computes the exact federated M-step. ``pi_c`` never leaves
the device.

The embedding ``z = phi(x)`` (``gmm-embedding``): the raw vectors, a pooled PCA of the
pixels, or a pooled PCA of a local ResNet18's features (``fedpers.embedding``). Before
the first round the server asks the clients three start-up queries (the family's
``query.pca``, ``query.summary``, ``query.assign``), answered here by
``pca_moments``, ``local_summary`` and ``assignment_statistics``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedpers import gmm
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.embedding import encode, flatten, project
from fedpers.families import mixture
from fedpers.families.mixture import Embedding
from fedpers.protocol import MODEL_PARTS
from fedpers.seeding import int_seed
from fedpers.settings import ConfigError

if TYPE_CHECKING:
    from fedpers.cohort import Arrays, Cohort, Metrics, Reply
    from fedpers.config import RunConfig


# ------------------------------------------------------------------------ embedding
def features(run: RunConfig, x: np.ndarray) -> np.ndarray:
    """What the embedding starts from: raw vectors, or encoder features."""
    if mixture.embedding(run) != Embedding.RESNET18:
        return flatten(x)
    shape = run.dataset_info.image_shape
    assert shape is not None
    return encode(x.reshape((len(x), *shape)), mixture.settings(run).gmm_encoder_weights)


def embed(run: RunConfig, x: np.ndarray, arrays: Arrays) -> np.ndarray:
    """``z = phi(x)``: identity, or the pooled PCA sent by the server."""
    if mixture.embedding(run) == Embedding.IDENTITY:
        return flatten(x)
    return project(features(run, x), arrays[mixture.PCA_MEAN], arrays[mixture.PCA_DIRECTIONS])


def components_of(arrays: Arrays) -> gmm.Components:
    """The server's Gaussian components."""
    return gmm.Components(arrays[mixture.GMM_MEANS], arrays[mixture.GMM_COVARIANCES])


def _components(run: RunConfig) -> int:
    return mixture.settings(run).gmm_components


def log_densities(run: RunConfig, x: np.ndarray, arrays: Arrays) -> np.ndarray:
    """``log N(z_i; mu_m1, Sigma_m1)`` (n, M1) of the embeddings."""
    return gmm.log_gaussian(embed(run, x, arrays), components_of(arrays))


def statistics(
    run: RunConfig, x: np.ndarray, responsibilities: np.ndarray, arrays: Arrays
) -> Arrays:
    """The responsibility-weighted statistics of the embeddings, centred on the global
    means (the server's exact M-step)."""
    components = components_of(arrays)
    stats = gmm.sufficient_statistics(
        embed(run, x, arrays),
        responsibilities.sum(axis=2),
        components.means,
        components.kind,
    )
    return _stats_arrays(stats)


GAUSSIANS = mixture.Densities(_components, log_densities, statistics)
"""FedGMM's densities: M1 Gaussian components over the embedding."""


def _stats_arrays(stats: gmm.Statistics) -> Arrays:
    return {
        mixture.STATS_COUNT: stats.count,
        mixture.STATS_FIRST: stats.first,
        mixture.STATS_SECOND: stats.second,
    }


# ----------------------------------------------------------------- local update
def fit(cohort: Cohort) -> list[Reply]:
    """The family's update over the M1 x M2 cells; replies the embeddings' statistics
    too."""
    from fedpers import mixture_update

    return mixture_update.fit(cohort, densities=GAUSSIANS)


def evaluate(cohort: Cohort) -> list[Metrics]:
    """The family's evaluation, with the Gaussians' ``p(m1 | x)`` in the prediction."""
    from fedpers import mixture_update

    return mixture_update.evaluate(cohort, densities=GAUSSIANS)


# ------------------------------------------------------------ start-up queries
def _training_inputs(cohort: Cohort) -> list[np.ndarray]:
    """Each member's training inputs."""
    from fedpers import update

    return [d.x_train for d in update.Local(cohort).data]


def pca_moments(cohort: Cohort) -> list[Reply]:
    """``query.pca``: each member's ``(n, sum f, sum f f^T)`` of its embedding inputs
    (the pooled PCA)."""
    replies: list[Reply] = []
    for x in _training_inputs(cohort):
        count, total, outer = gmm.moment_statistics(features(cohort.run, x))
        arrays = {
            mixture.PCA_COUNT: np.array([count]),
            mixture.PCA_SUM: total,
            mixture.PCA_OUTER: outer,
        }
        replies.append((arrays, {}))
    return replies


def local_summary(cohort: Cohort) -> list[Reply]:
    """``query.summary``: each member's local k-means centroids and sizes of its
    embeddings (the server's federated k-means++)."""
    run = cohort.run
    replies: list[Reply] = []
    for member, x in zip(cohort.members, _training_inputs(cohort), strict=True):
        centroids, counts = gmm.local_summary(
            embed(run, x, member.arrays),
            clusters=2 * mixture.settings(run).gmm_components,
            seed=int_seed(run.seed, "local-kmeans", member.partition),
        )
        replies.append(({mixture.SUMMARY_CENTROIDS: centroids, mixture.SUMMARY_COUNTS: counts}, {}))
    return replies


def assignment_statistics(cohort: Cohort) -> list[Reply]:
    """``query.assign``: each member's statistics of its embeddings' hard assignments
    to the initial means (the initial covariances)."""
    run = cohort.run
    replies: list[Reply] = []
    for member, x in zip(cohort.members, _training_inputs(cohort), strict=True):
        z = embed(run, x, member.arrays)
        means = member.arrays[mixture.GMM_MEANS]
        stats = gmm.sufficient_statistics(
            z, gmm.hard_responsibilities(z, means), means, mixture.settings(run).gmm_covariance
        )
        replies.append((_stats_arrays(stats), {}))
    return replies


# ------------------------------------------------------------------------ checks
def check_embedding(run: RunConfig) -> None:
    """FedGMM's embedding: weights on this machine for ``resnet18``, images for it, and a
    PCA no wider than the inputs."""
    values = mixture.settings(run)
    chosen = mixture.embedding(run)
    if chosen == Embedding.RESNET18:
        if not values.gmm_encoder_weights:
            raise ConfigError(
                "run-config key 'gmm-embedding' = 'resnet18' needs 'gmm-encoder-weights': "
                "the path of a torchvision resnet18 state dict on this machine "
                "(weights are never downloaded at run time)."
            )
        if not Path(values.gmm_encoder_weights).is_file():
            raise ConfigError(
                f"run-config key 'gmm-encoder-weights' = '{values.gmm_encoder_weights}' "
                "is not a file; save a resnet18 state dict there first."
            )
        if run.dataset_info.image_shape is None:
            raise ConfigError("run-config key 'gmm-embedding' = 'resnet18' needs image data.")
    if chosen == Embedding.PCA:
        flat = math.prod(run.input_shape)
        if values.gmm_embedding_dim > flat:
            raise ConfigError(
                f"run-config key 'gmm-embedding-dim' = {values.gmm_embedding_dim} exceeds "
                f"the {flat} input dimensions of dataset='{run.dataset}'."
            )


ROWS = (
    AlgorithmSpec(
        name="fedgmm",
        family=Family.MIXTURE,
        shared=MODEL_PARTS,
        strategy="fedpers.strategies.fedgmm:FedGMM",
        checks=(check_embedding,),
        unseen=True,
        paper="Wu et al., ICML 2023",
    ),
)
