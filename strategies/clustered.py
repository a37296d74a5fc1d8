"""Clustered FL (Sattler, Mueller and Samek, "Clustered Federated Learning: Model-
Agnostic Distributed Multitask Optimization Under Privacy Constraints", IEEE TNNLS 2020,
Algorithm 1, as FedEM's code runs it for FedGMM's and FedEM's tables).

The server keeps one model per cluster; every client starts in cluster 0. Each round a
sampled client trains, from its cluster's model, FedAvg's local update (the clients
are FedAvg's), and each cluster's model becomes the run's ``aggregation`` of its
members' replies. Then, for each cluster with more than two replies, with the updates
``dw_i`` (reply less the cluster's model):

    if ||weighted mean dw_i|| < eps1 and max ||dw_i|| > eps2:
        split the replies in two by complete linkage on the cosine distances of the
        dw_i (the paper's bipartition that minimizes the largest similarity across),

each half's model the aggregation of its own replies. The half holding the lowest
partition keeps the cluster's id, and so do the cluster's members not sampled this
round: the paper has every client in every round, so with ``fraction-train < 1`` they
stay where they were until a later split moves them (FedEM's code refuses partial
participation instead). A cluster splits only while fewer than
``clustered-fl-max-clusters`` exist. Under ``aggregation = "trimmed-mean"`` a cluster
(or half) with too few replies to trim keeps its model that round (the round records
``clusters-unchanged``): no model is set by one or two replies the trim cannot check.

The global state, checkpointed with the run, is every cluster's model
(``cluster.<c>.<parameter>``, all ``max-clusters`` of them, the unused ones copies of
the initial model) and each seen client's cluster (``clusters.assignment``). Clients are
sent, and tested with, their cluster's model; each reply's update is measured from the
model its client was sent (``sent_to``). ``rounds.jsonl`` records ``clusters``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from sklearn.cluster import AgglomerativeClustering

from fedpers import protocol, records
from fedpers.aggregation import Aggregation, trim_count
from fedpers.algorithms.clustered_fl import (
    ASSIGNMENT,
    CLUSTER,
    CLUSTERS,
    CLUSTERS_UNCHANGED,
    ClusteredFLSettings,
)
from fedpers.strategies import screening
from fedpers.strategies.base import FedpersStrategy, mean_metrics

Model = dict[str, np.ndarray]


class ClusteredFL(FedpersStrategy):
    """A model per cluster; a cluster splits when its clients' updates disagree."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = self.run.group(ClusteredFLSettings)
        self.models: dict[int, Model] = {}  # the clusters' models this round started from
        self.assignment = np.zeros(len(self.seen), dtype=np.float64)
        self.sent: dict[int, Model] = {}  # what each sampled partition was sent
        self.unchanged = 0  # this round's clusters too small for the trimmed mean

    @property
    def clusters(self) -> int:
        """Clusters in use."""
        return int(self.assignment.max(initial=0)) + 1

    def initial_arrays(self, grid: Grid, *, timeout: float) -> ArrayRecord:
        """The seeded initial model (as a majority of the nodes build it) for every
        cluster, every client in cluster 0."""
        model = {
            k: records.values(v) for k, v in super().initial_arrays(grid, timeout=timeout).items()
        }
        models = dict.fromkeys(range(self.settings.clustered_fl_max_clusters), model)
        return _record(models, np.zeros(len(self.seen), dtype=np.float64))

    def state_defect(self, new: ArrayRecord, previous: ArrayRecord) -> str | None:
        """The base checks, and every client's cluster one of the state's clusters (a
        checkpoint's assignment is read on resume: a cluster id beyond them ended in a
        raw KeyError)."""
        if reason := super().state_defect(new, previous):
            return reason
        models, assignment = _state(new)
        known = np.isin(assignment, np.array(sorted(models), dtype=np.float64))
        if not np.all(known):
            bad = sorted({float(v) for v in assignment[~known]})[:5]
            return f"its cluster assignment names clusters {bad}, not among 0..{len(models) - 1}"
        return None

    def load(self, arrays: ArrayRecord) -> None:
        """Read the clusters' models and the assignment from the global state."""
        self.models, self.assignment = _state(arrays)

    def cluster_of(self, partition: int) -> int:
        return int(self.assignment[partition])

    def train_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> dict[int, RecordDict]:
        """Each sampled client its cluster's model."""
        self.load(arrays)
        self.round_config(server_round, config)
        sampled = self.sample(server_round)
        self.sent = {p: self.models[self.cluster_of(p)] for p in sampled}
        first = self.models[0]
        self.current_shared = first
        self.sent_arrays = screening.array_specs(_model_record(first))
        return {
            p: RecordDict({protocol.ARRAYS: _model_record(model), protocol.CONFIG: config})
            for p, model in self.sent.items()
        }

    def sent_to(self, reply: Message) -> dict[str, np.ndarray]:
        """The model of the cluster the reply's client trained in."""
        return self.sent.get(self.federation.partition(reply), self.current_shared)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Each cluster's model from its members' replies; clusters split as the
        criteria say."""
        valid = [r for r in replies if screening.num_examples(r) > 0]
        if not valid:
            return None, None
        members: dict[int, list[tuple[int, Model, float]]] = {}
        for reply in valid:
            partition = self.federation.partition(reply)
            members.setdefault(self.cluster_of(partition), []).append(
                (partition, screening.arrays_of(reply), screening.num_examples(reply))
            )
        models = dict(self.models)
        assignment = self.assignment.copy()
        self.unchanged = 0
        for cluster, replies_of in sorted(members.items()):
            start = self.models[cluster]
            halves = self.split(start, replies_of, int(assignment.max()) + 1)
            if halves is None:
                models[cluster] = self.aggregated(replies_of, start)
                continue
            kept, moved = halves
            new = int(assignment.max()) + 1
            models[cluster] = self.aggregated(kept, start)
            models[new] = self.aggregated(moved, start)
            for partition, _, _ in moved:
                assignment[partition] = new
        self.assignment = assignment  # for this round's record (``round_metrics``)
        metrics = mean_metrics([r.content for r in valid])
        return _record(models, assignment), metrics

    def aggregated(self, replies: list[tuple[int, Model, float]], start: Model) -> Model:
        """The run's aggregation of the replies, weighted by their examples; ``start``
        (the cluster's model, unchanged) where a trimmed mean would cut every reply, as
        it does a cluster of one or two replies at any trim: a cluster's replies are
        not known before the run, so the check before start cannot cover them."""
        if self.trims_every_reply(len(replies)):
            self.unchanged += 1
            return start
        return self.combine([m for _, m, _ in replies], [w for _, _, w in replies], start)

    def split(
        self, start: Model, replies: list[tuple[int, Model, float]], clusters: int
    ) -> tuple[list[tuple[int, Model, float]], list[tuple[int, Model, float]]] | None:
        """The two halves of a cluster's replies when its criteria hold (the half with
        the lowest partition first), or None."""
        if len(replies) <= 2 or clusters >= self.settings.clustered_fl_max_clusters:
            return None
        if self.trims_every_reply(len(replies)):  # no robust statistic of so few replies
            return None
        updates = np.stack([_flat(model, start) for _, model, _ in replies])
        weights = np.array([w for _, _, w in replies], dtype=np.float64)
        mean_norm, max_norm = self.split_statistics(start, replies, updates, weights)
        if not (
            mean_norm < self.settings.clustered_fl_eps1
            and max_norm > self.settings.clustered_fl_eps2
        ):
            return None
        labels = bipartition(updates)
        first = labels[int(np.argmin([p for p, _, _ in replies]))]
        kept = [r for r, label in zip(replies, labels, strict=True) if label == first]
        moved = [r for r, label in zip(replies, labels, strict=True) if label != first]
        return kept, moved

    def split_statistics(
        self,
        start: Model,
        replies: list[tuple[int, Model, float]],
        updates: np.ndarray,
        weights: np.ndarray,
    ) -> tuple[float, float]:
        """The norm of the cluster's mean update and its largest update norm, the split
        criteria's statistics (Sattler et al.: the weighted mean, the maximum). Under a
        robust aggregation the decision is robust too: the mean is the run's own
        aggregate (the trimmed mean, the median, the clipped mean) and the "largest"
        norm is the (k + 1)-th largest, k being the replies the aggregation resists at
        each end (``trim_count`` under the trimmed mean, fewer than half under the
        median), so that k replies cannot force a split; under the clipped mean the
        largest of the norms as it clips them (at most aggregation-clip x their median).
        Under the plain mean, as in the paper, one reply can (its norm is the maximum):
        the docs say so."""
        norms = np.sort(np.linalg.norm(updates, axis=1))[::-1]
        aggregation = self.run.aggregation
        if aggregation == Aggregation.MEAN:
            return float(np.linalg.norm(weights @ updates / weights.sum())), float(norms[0])
        if aggregation == Aggregation.TRIMMED_MEAN:
            resisted = trim_count(len(replies), self.run.aggregation_trim)
        elif aggregation == Aggregation.MEDIAN:  # fewer than half of the replies
            resisted = (len(replies) - 1) // 2
        else:  # the clipped mean: the norms as it clips them (to c x their median)
            resisted = 0
            norms = np.minimum(norms, self.run.aggregation_clip * float(np.median(norms)))
        combined = self.combine([m for _, m, _ in replies], list(weights), start)
        mean_norm = float(np.linalg.norm(_flat(combined, start)))
        return mean_norm, float(norms[min(resisted, len(norms) - 1)])

    def evaluate_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> dict[int, RecordDict]:
        """Every seen client its cluster's model."""
        if not self.evaluate_nodes:
            return {}
        self.load(arrays)
        config[protocol.ROUND] = server_round
        return {
            p: RecordDict(
                {
                    protocol.ARRAYS: _model_record(self.models[self.cluster_of(p)]),
                    protocol.CONFIG: config,
                }
            )
            for p in self.seen
        }

    def round_metrics(self, server_round: int) -> dict[str, float]:
        """The clusters in use after the round (``clusters``) and, under the trimmed
        mean, those left unchanged because it would cut all their replies
        (``clusters-unchanged``)."""
        metrics = {**super().round_metrics(server_round), CLUSTERS: float(self.clusters)}
        if self.run.aggregation == Aggregation.TRIMMED_MEAN:
            metrics[CLUSTERS_UNCHANGED] = float(self.unchanged)
        return metrics


def bipartition(updates: np.ndarray) -> np.ndarray:
    """Labels 0/1 of the rows of ``updates``: complete linkage on their cosine
    distances (a zero update is at distance 1 from every other)."""
    norms = np.linalg.norm(updates, axis=1)
    unit = updates / np.where(norms > 0, norms, 1.0)[:, None]
    distances = np.clip(1.0 - unit @ unit.T, 0.0, 2.0)
    np.fill_diagonal(distances, 0.0)
    clustering = AgglomerativeClustering(n_clusters=2, metric="precomputed", linkage="complete")
    return np.asarray(clustering.fit_predict(distances))


def _flat(model: Model, start: Model) -> np.ndarray:
    return np.concatenate(
        [(model[k].astype(np.float64) - start[k].astype(np.float64)).ravel() for k in sorted(start)]
    )


def _model_record(model: Model) -> ArrayRecord:
    return ArrayRecord({k: Array(records.contiguous(v)) for k, v in model.items()})


def _record(models: dict[int, Model], assignment: np.ndarray) -> ArrayRecord:
    arrays = {
        f"{CLUSTER}{c}.{name}": Array(records.contiguous(v))
        for c, model in sorted(models.items())
        for name, v in model.items()
    }
    arrays[ASSIGNMENT] = Array(np.ascontiguousarray(assignment, dtype=np.float64))
    return ArrayRecord(arrays)


def _state(arrays: ArrayRecord) -> tuple[dict[int, Model], np.ndarray]:
    models: dict[int, Model] = {}
    assignment = np.zeros(0)
    for name, array in arrays.items():
        if name == ASSIGNMENT:
            assignment = records.values(array).astype(np.float64)
            continue
        cluster, _, parameter = name.removeprefix(CLUSTER).partition(".")
        models.setdefault(int(cluster), {})[parameter] = records.values(array)
    return models, assignment
