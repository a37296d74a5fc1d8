"""Clustered FL against Sattler et al.'s Algorithm 1: two rounds of a tiny problem
through the in-process grid (the real ClientApp and the clustered server), every client
a round, the split criteria set so that round 1 splits the one cluster: the split must
be the complete-linkage bipartition of the cosine distances of the clients' updates
(computed here with scipy, not scikit-learn), and every cluster's model the FedAvg of
its members' full-batch gradient steps, in plain torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import pdist

from fedpers.algorithms.clustered_fl import ASSIGNMENT, CLUSTER
from fedpers.config import RunConfig, load_run_config
from fedpers.settings import ConfigError
from tests.clients.test_fedprox import _forward, tiny_rounds, training_tensors

Params = dict[str, torch.Tensor]
# Criteria that hold at once: round 1 splits the one cluster in two
SPLIT_AT_ONCE = {
    "algorithm": "clustered-fl",
    "clustered_fl_eps1": 1e9,
    "clustered_fl_eps2": 0.0,
    "clustered_fl_max_clusters": 2,
}


def _local(config: RunConfig, partition: int, start: Params) -> Params:
    """``epochs`` full-batch gradient steps of the client's loss from ``start``."""
    x, y = training_tensors(config, partition)
    w = dict(start)
    for _ in range(config.epochs):
        p = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        grads = torch.autograd.grad(F.cross_entropy(_forward(p, x), y), list(p.values()))
        w = {k: v - config.lr * g for (k, v), g in zip(w.items(), grads, strict=True)}
    return w


def _fedavg(config: RunConfig, models: list[tuple[int, Params]]) -> Params:
    sizes = [len(training_tensors(config, p)[1]) for p, _ in models]
    return {
        k: sum(n * m[k] for n, (_, m) in zip(sizes, models, strict=True)) / sum(sizes)
        for k in models[0][1]
    }


def _clustered_oracle(
    config: RunConfig, start: dict[str, np.ndarray], *, split: bool = True
) -> tuple[dict[int, Params], list[int]]:
    initial = {k: torch.tensor(v, dtype=torch.float64) for k, v in start.items()}
    clients = list(range(config.num_clients))
    trained = [(p, _local(config, p, initial)) for p in clients]
    assignment = [0] * len(clients)
    if split:
        updates = np.stack(
            [
                torch.cat([(m[k] - initial[k]).reshape(-1) for k in sorted(m)]).numpy()
                for _, m in trained
            ]
        )
        labels = fcluster(linkage(pdist(updates, "cosine"), "complete"), 2, "maxclust")
        assignment = [0 if label == labels[0] else 1 for label in labels]
    models = {
        c: _fedavg(config, [t for t, a in zip(trained, assignment, strict=True) if a == c])
        for c in sorted(set(assignment))
    }
    # round 2: each client from its cluster's model
    trained = [(p, _local(config, p, models[assignment[p]])) for p in clients]
    models = {
        c: _fedavg(config, [t for t, a in zip(trained, assignment, strict=True) if a == c])
        for c in sorted(set(assignment))
    }
    return models, assignment


def _cluster(result: dict[str, np.ndarray], c: int) -> dict[str, np.ndarray]:
    prefix = f"{CLUSTER}{c}."
    return {k.removeprefix(prefix): v for k, v in result.items() if k.startswith(prefix)}


def _gap(a: dict[str, np.ndarray], b: Params) -> float:
    return max(float(np.max(np.abs(a[k] - b[k].numpy()))) for k in b)


def test_a_cluster_splits_by_complete_linkage_and_each_half_averages_its_own() -> None:
    config, start, result, _, _ = tiny_rounds(2, **SPLIT_AT_ONCE)
    models, assignment = _clustered_oracle(config, _cluster(start, 0))
    assert sorted(set(assignment)) == [0, 1]  # the oracle split the four clients
    assert result[ASSIGNMENT].tolist() == assignment
    for c, model in models.items():
        assert _gap(_cluster(result, c), model) < 1e-6
    # The test can fail: without the split, cluster 0 is FedAvg's model
    unsplit, _ = _clustered_oracle(config, _cluster(start, 0), split=False)
    assert _gap(_cluster(result, 0), unsplit[0]) > 1e-4


def test_no_split_while_the_mean_update_is_large_is_fedavg() -> None:
    config, start, result, _, _ = tiny_rounds(
        2, algorithm="clustered-fl", clustered_fl_eps1=0.0, clustered_fl_eps2=0.0
    )
    models, _ = _clustered_oracle(config, _cluster(start, 0), split=False)
    assert result[ASSIGNMENT].tolist() == [0.0] * config.num_clients
    assert _gap(_cluster(result, 0), models[0]) < 1e-6


def test_clustered_fl_refuses_dp_and_keeps_its_clusters_on_the_server() -> None:
    assert not load_run_config({"algorithm": "clustered-fl"}).spec.keeps_state
    with pytest.raises(ConfigError, match="keeps a model per cluster"):
        load_run_config({"algorithm": "clustered-fl", "dp": "central"})


def test_under_the_trimmed_mean_a_cluster_too_small_to_trim_keeps_its_model() -> None:
    # Round 1 splits the four clients; trim 0.25 cuts 1 value of k at each end, so a half
    # of one or two replies would be cut to nothing and keeps the model it started from,
    # and a half of three becomes the coordinate-wise median of its three models.
    config, start, result, _, _ = tiny_rounds(
        1, **SPLIT_AT_ONCE, aggregation="trimmed-mean", aggregation_trim=0.25
    )
    initial = {k: torch.tensor(v, dtype=torch.float64) for k, v in _cluster(start, 0).items()}
    trained = [_local(config, p, initial) for p in range(config.num_clients)]
    updates = np.stack(
        [torch.cat([(m[k] - initial[k]).reshape(-1) for k in sorted(m)]).numpy() for m in trained]
    )
    labels = fcluster(linkage(pdist(updates, "cosine"), "complete"), 2, "maxclust")
    assignment = [0 if label == labels[0] else 1 for label in labels]
    assert result[ASSIGNMENT].tolist() == assignment
    assert sorted(assignment.count(c) for c in (0, 1)) == [1, 3]  # both branches taken
    for c in (0, 1):
        members = [m for m, a in zip(trained, assignment, strict=True) if a == c]
        expected = (
            {k: torch.stack([m[k] for m in members]).median(dim=0).values for k in initial}
            if len(members) == 3
            else initial
        )
        assert _gap(_cluster(result, c), expected) < 1e-6, (c, len(members))
    # The test can fail: a small half's plain mean is not its starting model
    small = min((0, 1), key=assignment.count)
    members = [
        (p, m) for p, (m, a) in enumerate(zip(trained, assignment, strict=True)) if a == small
    ]
    assert _gap(_cluster(result, small), _fedavg(config, members)) > 1e-4
