"""The mixture family: FedEM and FedGMM, shared learners and personal mixture weights.

The server keeps M2 learners (and, for FedGMM, M1 Gaussian components of an embedding
of the inputs) and aggregates them by the clients' summed responsibilities; each client
keeps its mixture weights pi on the device (``strategies/fedem.py``,
``strategies/fedgmm.py``, ``clients/fedem.py``, ``clients/fedgmm.py``; the math is
``fedpers.gmm``). This module holds the family's settings and enums, its checks, its
wire names, FedGMM's three start-up queries and the summary. The synthetic mixtures
of FedGMM's Section 4.1 (the data set ``mixture``) are the family's data set; every
algorithm may run on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from flwr.app import ConfigRecord

from fedpers import families, protocol
from fedpers.data.mixture import (  # the data set's settings, declared here for the docs
    DATASET,
    MixtureDataSettings,
)
from fedpers.families import Arrays, Faults, Metrics, QuerySpec, RunSummary, personalized
from fedpers.faults import FaultTargets
from fedpers.settings import ConfigError, at_least, setting

if TYPE_CHECKING:
    from fedpers.config import RunConfig

NAME = "mixture"
GMM_ALGORITHM = "fedgmm"  # the one algorithm whose Gaussians model an embedding (gmm-*)


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


@runtime_checkable
class MixtureInitializer(Protocol):
    """FedGMM's start-up queries (``query.pca``, ``query.summary``, ``query.assign``)."""

    def pca_moments(self) -> Arrays:
        """Moment statistics of the embedding inputs."""
        ...

    def summary(self, arrays: Arrays) -> Arrays:
        """Local k-means centroids and counts."""
        ...

    def assignment_statistics(self, arrays: Arrays) -> Arrays:
        """Statistics of the samples assigned to the nearest initial mean."""
        ...


def _pca(
    client: Any, run: RunConfig, arrays: Arrays, config: ConfigRecord
) -> tuple[Arrays, Metrics]:
    return client.pca_moments(), {}


def _summary(
    client: Any, run: RunConfig, arrays: Arrays, config: ConfigRecord
) -> tuple[Arrays, Metrics]:
    return client.summary(arrays), {}


def _assign(
    client: Any, run: RunConfig, arrays: Arrays, config: ConfigRecord
) -> tuple[Arrays, Metrics]:
    return client.assignment_statistics(arrays), {}


# ------------------------------------------------------------------------- checks
def check_embedding(run: RunConfig) -> None:
    """FedGMM's embedding: weights on this machine for ``resnet18``, images for it, and a
    PCA no wider than the inputs."""
    if run.algorithm != GMM_ALGORITHM:
        return
    values = settings(run)
    chosen = embedding(run)
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
        checks=(check_embedding,),
        fault_targets=FaultTargets(responsibilities=(GAMMA,), second_moments=(STATS_SECOND,)),
        queries=(
            QuerySpec(
                MixtureQuery.PCA,
                MixtureInitializer,
                _pca,
                Faults.STARTUP,
                "FedGMM: moment statistics of the embedding inputs (pooled PCA)",
            ),
            QuerySpec(
                MixtureQuery.SUMMARY,
                MixtureInitializer,
                _summary,
                Faults.STARTUP,
                "FedGMM: local k-means centroids of the embeddings (k-means++)",
            ),
            QuerySpec(
                MixtureQuery.ASSIGN,
                MixtureInitializer,
                _assign,
                Faults.STARTUP,
                "FedGMM: statistics of the embeddings nearest each initial mean",
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
    )
)
