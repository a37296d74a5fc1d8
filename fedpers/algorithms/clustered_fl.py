"""Clustered FL (Sattler, Mueller and Samek, "Clustered Federated Learning: Model-
Agnostic Distributed Multitask Optimization Under Privacy Constraints", IEEE TNNLS 2020,
Algorithm 1, as FedEM's code runs it for FedGMM's and FedEM's tables).

The server keeps one model per cluster and splits a cluster when its clients' updates
disagree (``strategies/clustered.py``); a sampled client is sent its cluster's model and
trains it with FedAvg's local update, the personalized family's
(``fedpers.families.personalized.fit``), and is tested with it. This module holds the
row, its split criteria and the names its server puts on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.families import personalized
from fedpers.protocol import MODEL_PARTS
from fedpers.settings import ConfigError, at_least, setting

if TYPE_CHECKING:
    from fedpers.config import RunConfig

# The server's state is a model per cluster under this prefix and each seen client's
# cluster (float64, one entry per partition) under ASSIGNMENT.
CLUSTER = "cluster."
ASSIGNMENT = "clusters.assignment"
# ... and records, each round, the clusters in use and (under the trimmed mean) those
# too small to trim, which kept their model.
CLUSTERS = "clusters"
CLUSTERS_UNCHANGED = "clusters-unchanged"


MAX_CLUSTERS = 16  # clustered-fl-max-clusters' default


@dataclass(frozen=True)
class ClusteredFLSettings:
    """The split criteria of Clustered FL (the row `clustered-fl`)."""

    HEADING: ClassVar[str] = "clustered-fl"

    clustered_fl_eps1: float = setting(
        0.4,
        "Clustered FL: a cluster may split only when the norm of its clients' mean update "
        "is below eps1 (near a stationary point of the cluster's objective; FedEM's 0.4)",
    )
    clustered_fl_eps2: float = setting(
        3.2,
        "Clustered FL: ... and the largest norm of its clients' updates is above eps2 "
        "(some client is far from one; chosen on validation, FedEM's 1.6)",
    )
    clustered_fl_max_clusters: int = setting(
        MAX_CLUSTERS,
        "Clustered FL: the most clusters a run may hold (the state keeps a model for each; "
        "chosen on validation)",
    )

    def check(self) -> None:
        at_least("clustered-fl-eps1", self.clustered_fl_eps1, 0.0)
        at_least("clustered-fl-eps2", self.clustered_fl_eps2, 0.0)
        at_least("clustered-fl-max-clusters", self.clustered_fl_max_clusters, 1)


def _clusters_fit_clients(run: RunConfig) -> None:
    """The state keeps a model per possible cluster, and a cluster needs a client: more
    than ``num-clients`` clusters (or than the default 16, for fewer clients) can never
    be used, only held (100,000 with 4 clients ended in MemoryError)."""
    most = run.group(ClusteredFLSettings).clustered_fl_max_clusters
    limit = max(run.num_clients, MAX_CLUSTERS)
    if most > limit:
        raise ConfigError(
            f"run-config key 'clustered-fl-max-clusters' = {most} is more clusters than "
            f"{run.num_clients} clients can form; give at most {limit}."
        )


ROWS = (
    AlgorithmSpec(
        name="clustered-fl",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        strategy="fedpers.strategies.clustered:ClusteredFL",
        settings=(ClusteredFLSettings,),
        checks=(
            personalized.refuses_dp("whose server keeps a model per cluster"),
            _clusters_fit_clients,
        ),
        wire=(CLUSTER, ASSIGNMENT, CLUSTERS, CLUSTERS_UNCHANGED),
        paper="Sattler et al., IEEE TNNLS 2020",
    ),
)
