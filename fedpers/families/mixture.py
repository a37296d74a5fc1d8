"""The mixture family: FedEM and FedGMM, shared learners and personal mixture weights.

The server keeps M2 learners (and, for FedGMM, M1 Gaussian components of an embedding
of the inputs) and aggregates them by the clients' summed responsibilities; each client
keeps its mixture weights pi on the device (``strategies/fedem.py``,
``strategies/fedgmm.py``, the rows ``fedpers/algorithms/fedem.py`` and
``fedpers/algorithms/fedgmm.py``; the math is ``fedpers.gmm``). This module holds the
family's settings and enums, its wire names, FedGMM's three start-up queries, the
summary, and the densities a row models on the inputs (``Densities``: FedEM none,
FedGMM Gaussians over an embedding); it never imports torch. The family's local update
of a cohort (``fit``, ``evaluate``, ``initial_arrays``) is ``fedpers.mixture_update``,
which the family names as its update module (``FamilySpec.update``) and a row
specializes by its ``Densities``. The synthetic mixtures of FedGMM's Section 4.1
(the data set ``mixture``) are the family's data set; every algorithm may run on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np

from fedpers import families, protocol
from fedpers.data.mixture import (  # the data set's settings, declared here for the docs
    DATASET,
    MixtureDataSettings,
)
from fedpers.families import Arrays, Faults, QuerySpec, RunSummary, personalized
from fedpers.faults import FaultTargets
from fedpers.settings import at_least, setting

if TYPE_CHECKING:
    from fedpers.config import RunConfig

NAME = "mixture"


# --------------------------------------------------------------------------- modes
class GmmCovariance(StrEnum):
    """Covariance of FedGMM's Gaussian components (``gmm-covariance``)."""

    FULL = "full"
    DIAG = "diag"


class GmmAggregation(StrEnum):
    """How the server combines the clients' Gaussian statistics (``gmm-aggregation``)."""

    EXACT = "exact"
    AVERAGE = "average"


class Embedding(StrEnum):
    """What FedGMM's Gaussians model (``gmm-embedding``)."""

    AUTO = "auto"
    IDENTITY = "identity"
    PCA = "pca"
    RESNET18 = "resnet18"


# ------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class MixtureSettings:
    """Mixtures of learners: FedEM and FedGMM."""

    mixture_learners: int = setting(3, "M2 learners of FedEM and FedGMM")
    gmm_components: int = setting(3, "M1 Gaussian components of FedGMM")
    gmm_covariance: GmmCovariance = setting(GmmCovariance.FULL, "covariance of every component")
    gmm_ridge: float = setting(0.01, "ridge added to every covariance")
    gmm_aggregation: GmmAggregation = setting(
        GmmAggregation.EXACT, "`exact`: from pooled statistics; `average`: the paper's"
    )
    gmm_shared_weights: bool = setting(
        False, "clients use the server's weights in their E-step (pure federated EM)"
    )
    gmm_embedding: Embedding = setting(
        Embedding.AUTO,
        "what the Gaussians model; `auto`: `identity` for the mixtures, `pca` for images",
    )
    gmm_embedding_dim: int = setting(16, "dimensions of the pooled PCA (`pca`, `resnet18`)")
    gmm_encoder_weights: str = setting(
        "", "path of a torchvision resnet18 state dict for `resnet18` (never downloaded)"
    )

    def check(self) -> None:
        at_least("mixture-learners", self.mixture_learners, 1)
        at_least("gmm-components", self.gmm_components, 1)
        at_least("gmm-embedding-dim", self.gmm_embedding_dim, 1)
        at_least("gmm-ridge", self.gmm_ridge, 0.0)


def settings(run: RunConfig) -> MixtureSettings:
    """The run's mixture settings, typed."""
    return run.group(MixtureSettings)


def data_settings(run: RunConfig) -> MixtureDataSettings:
    """The run's settings of the synthetic mixtures, typed."""
    return run.group(MixtureDataSettings)


def embedding(run: RunConfig) -> Embedding:
    """The GMM's input embedding, with ``auto`` resolved: raw vectors of the synthetic
    mixtures, PCA of the pixels for images."""
    chosen = settings(run).gmm_embedding
    if chosen != Embedding.AUTO:
        return Embedding(chosen)
    return Embedding.IDENTITY if run.dataset == DATASET else Embedding.PCA


# ---- Array and metric names --------------------------------------------------------
def learner_prefix(index: int) -> str:
    """Prefix of learner ``index``'s parameters: ``learner0.body.0.weight``."""
    return f"learner{index}."


MIXTURE_WEIGHTS = "mixture.weights"  # pi (M1, M2): personal on a device, global on the server
GAMMA = "gamma"  # a client's summed responsibilities (M1, M2)
GMM_MEANS = "gmm.means"
GMM_COVARIANCES = "gmm.covariances"
PCA_MEAN = "pca.mean"
PCA_DIRECTIONS = "pca.directions"
STATS_COUNT = "stats.count"
STATS_FIRST = "stats.first"
STATS_SECOND = "stats.second"
PCA_COUNT = "pca.count"  # query.pca: samples behind the moments
PCA_SUM = "pca.sum"
PCA_OUTER = "pca.outer"
SUMMARY_CENTROIDS = "summary.centroids"  # query.summary: local k-means centroids
SUMMARY_COUNTS = "summary.counts"
LOG_LIKELIHOOD = "log-likelihood"  # a client's mean log-likelihood of its data


# ---- Queries of FedGMM's initialization ---------------------------------------------
class MixtureQuery(StrEnum):
    """FedGMM's start-up queries (``query.<name>``)."""

    PCA = "pca"  # moment statistics of the embedding inputs (pooled PCA)
    SUMMARY = "summary"  # local k-means centroids for federated k-means++
    ASSIGN = "assign"  # statistics of hard assignments to the initial means


QUERY_PCA = protocol.query_type(MixtureQuery.PCA)
QUERY_SUMMARY = protocol.query_type(MixtureQuery.SUMMARY)
QUERY_ASSIGN = protocol.query_type(MixtureQuery.ASSIGN)


# ---- The densities a row models on the inputs ------------------------------------------
@dataclass(frozen=True)
class Densities:
    """What a row of the family models of the inputs ``x``, beside its learners'
    ``P(y | x)``: its M1 components, their log-densities and the statistics its
    clients send for the server's M-step.

    Parameters
    ----------
    components : callable
        ``components(run)``: the number of components M1.
    log_densities : callable
        ``log_densities(run, x, arrays)``: ``log N(z_i; m1)`` (n, M1), from the arrays
        the server sent.
    statistics : callable
        ``statistics(run, x, responsibilities, arrays)``: the arrays a client sends
        besides its learners and ``gamma`` (responsibilities of shape (n, M1, M2)).
    """

    components: Callable[[RunConfig], int]
    log_densities: Callable[[RunConfig, np.ndarray, Arrays], np.ndarray]
    statistics: Callable[[RunConfig, np.ndarray, np.ndarray, Arrays], Arrays]


def _one_component(run: RunConfig) -> int:
    return 1


def _no_density(run: RunConfig, x: np.ndarray, arrays: Arrays) -> np.ndarray:
    return np.zeros((len(x), 1))


def _no_statistics(
    run: RunConfig, x: np.ndarray, responsibilities: np.ndarray, arrays: Arrays
) -> Arrays:
    return {}


NO_DENSITY = Densities(_one_component, _no_density, _no_statistics)
"""FedEM's: one cell per learner, ``log N = 0``, nothing sent but learners and gamma."""


def summary(done: RunSummary) -> dict[str, object]:
    """The personalized family's summary, and the training log-likelihood per round."""
    result = personalized.summary(done)
    mixture = [r.train.get(LOG_LIKELIHOOD) for r in done.records]
    if any(v is not None for v in mixture):
        result["train_log_likelihood"] = [v for v in mixture if v is not None]
    return result


def _input_shape(run: RunConfig) -> tuple[int, ...] | None:
    return (data_settings(run).mixture_dim,) if run.dataset == DATASET else None


FAMILY = families.register(
    families.FamilySpec(
        name=NAME,
        summary=summary,
        groups=(MixtureDataSettings, MixtureSettings),
        fault_targets=FaultTargets(responsibilities=(GAMMA,), second_moments=(STATS_SECOND,)),
        queries=(
            QuerySpec(
                MixtureQuery.PCA,
                faults=Faults.STARTUP,
                doc="FedGMM: moment statistics of the embedding inputs (pooled PCA)",
                function="pca_moments",
            ),
            QuerySpec(
                MixtureQuery.SUMMARY,
                faults=Faults.STARTUP,
                doc="FedGMM: local k-means centroids of the embeddings (k-means++)",
                function="local_summary",
            ),
            QuerySpec(
                MixtureQuery.ASSIGN,
                faults=Faults.STARTUP,
                doc="FedGMM: statistics of the embeddings nearest each initial mean",
                function="assignment_statistics",
            ),
        ),
        input_shape=_input_shape,
        wire=(
            MIXTURE_WEIGHTS,
            GAMMA,
            GMM_MEANS,
            GMM_COVARIANCES,
            PCA_MEAN,
            PCA_DIRECTIONS,
            STATS_COUNT,
            STATS_FIRST,
            STATS_SECOND,
            PCA_COUNT,
            PCA_SUM,
            PCA_OUTER,
            SUMMARY_CENTROIDS,
            SUMMARY_COUNTS,
            LOG_LIKELIHOOD,
        ),
        update="fedpers.mixture_update",
    )
)
