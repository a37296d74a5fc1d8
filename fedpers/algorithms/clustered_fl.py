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
from typing import ClassVar

from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.families import personalized
from fedpers.protocol import MODEL_PARTS
from fedpers.settings import at_least, setting

# The server's state is a model per cluster under this prefix and each seen client's
# cluster (float64, one entry per partition) under ASSIGNMENT.
CLUSTER = "cluster."
ASSIGNMENT = "clusters.assignment"
# ... and records, each round, the clusters in use and (under the trimmed mean) those
# too small to trim, which kept their model.
CLUSTERS = "clusters"
CLUSTERS_UNCHANGED = "clusters-unchanged"


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
        16,
        "Clustered FL: the most clusters a run may hold (the state keeps a model for each; "
        "chosen on validation)",
    )

    def check(self) -> None:
        at_least("clustered-fl-eps1", self.clustered_fl_eps1, 0.0)
        at_least("clustered-fl-eps2", self.clustered_fl_eps2, 0.0)
        at_least("clustered-fl-max-clusters", self.clustered_fl_max_clusters, 1)


ROWS = (
    AlgorithmSpec(
        name="clustered-fl",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        strategy="fedpers.strategies.clustered:ClusteredFL",
        settings=(ClusteredFLSettings,),
        checks=(personalized.refuses_dp("whose server keeps a model per cluster"),),
        wire=(CLUSTER, ASSIGNMENT, CLUSTERS, CLUSTERS_UNCHANGED),
        paper="Sattler et al., IEEE TNNLS 2020",
    ),
)
