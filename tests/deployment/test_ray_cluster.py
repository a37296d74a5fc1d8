"""A simulation on a real two-node Ray cluster equals the single-machine run.

Two ``ray start`` processes form the cluster (one CPU each): the head in a network
namespace the test makes, the worker on the host side of a veth pair to it
(``simulations.ray_cluster``); a fedpers simulation reaches it through ``RAY_ADDRESS``
in the SuperLink's environment.
Checked: Ray placed ClientApp actors on both nodes, every round's metrics equal the
single-machine run with the same seed (rtol 1e-9), and no process of the cluster or of
the simulation is left afterwards.

Marked ``cluster``: ``make cluster-test`` runs it, and ``.ci/run`` after ``make test``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from fedpers.reports import read_rounds
from fedpers.simulations.launch import LocalSimulation, processes_with_home
from fedpers.simulations.ray_cluster import RayCluster

# Namespaces like test_deployment.py: never beside it (one xdist worker for both).
pytestmark = [pytest.mark.flower, pytest.mark.cluster, pytest.mark.xdist_group("netns")]

SETTINGS = {
    "algorithm": "fedrep",
    "dataset": "digits",
    "num-clients": 8,
    "fraction-train": 1.0,
    "num-rounds": 3,
    "seed": 3,
}


def test_simulation_on_a_two_node_ray_cluster_matches_one_machine(tmp_path: Path) -> None:
    with LocalSimulation(echo=lambda line: None) as alone:
        single = alone.run({**SETTINGS, "results-dir": str(tmp_path), "run-name": "alone"})
    with RayCluster(cpus_per_node=1) as ray_cluster:
        nodes = ray_cluster.state()["nodes"]
        assert len(nodes) == 2
        with LocalSimulation(
            echo=lambda line: None, environment=ray_cluster.driver_environment()
        ) as on_cluster:
            clustered = on_cluster.run(
                {**SETTINGS, "results-dir": str(tmp_path), "run-name": "cluster"}
            )
        placed = ray_cluster.client_actor_nodes()
        cluster_pids = ray_cluster.pids()
        assert cluster_pids  # the cluster outlives the simulation that used it
    assert ray_cluster.pids() == []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert ray_cluster.namespace not in namespaces
    assert processes_with_home(on_cluster.home) == []
    # one ClientApp actor per CPU of the cluster: one on each node
    assert sorted(placed) == sorted(nodes), placed
    assert all(count >= 1 for count in placed.values())
    mine, theirs = read_rounds(clustered), read_rounds(single)
    assert [r.round for r in mine] == [1, 2, 3] == [r.round for r in theirs]
    for a, b in zip(mine, theirs, strict=True):
        assert a.replies == b.replies == 8
        assert a.evaluated == b.evaluated == 8
        for key in ("accuracy", "loss"):
            np.testing.assert_allclose(a.evaluate[key], b.evaluate[key], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(a.train["loss"], b.train["loss"], rtol=1e-9, atol=1e-12)
