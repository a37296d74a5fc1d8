"""Real `flwr run` simulations on the Ray backend; assertions on what the runs wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpers.reports import read_config, read_rounds, read_summary
from fedpers.simulations.launch import LocalSimulation, processes_with_home

pytestmark = pytest.mark.flower


def test_fedrep_runs_with_100_virtual_clients(simulation: LocalSimulation, tmp_path: Path) -> None:
    directory = simulation.run(
        {
            "algorithm": "fedrep",
            "num-clients": 100,
            "num-rounds": 3,
            "results-dir": str(tmp_path),
            "run-name": "fedrep-100",
        }
    )
    records = read_rounds(directory)
    assert [r.round for r in records] == [1, 2, 3]
    # 10% of 100 clients trained each round; ALL 100 evaluated each round.
    assert all(r.sampled == 10 and r.replies == 10 and r.failures == 0 for r in records)
    assert all(r.evaluated == 100 for r in records)
    accuracies = [r.evaluate["accuracy"] for r in records]
    assert accuracies[-1] > accuracies[0]
    assert accuracies[-1] > 0.2  # 10-class chance is 0.1; trained heads see 2 classes
    summary = read_summary(directory)
    assert summary["final_accuracy"] == pytest.approx(sum(accuracies) / 3)  # < 10 rounds
    assert read_config(directory)["num-clients"] == 100
    assert Path(read_config(directory)["results-dir"]).is_absolute()
    assert (directory / "evaluate_accuracy.png").stat().st_size > 1000
    assert (directory / "final_arrays.npz").exists()


def test_a_stopped_simulation_leaves_no_process(tmp_path: Path) -> None:
    with LocalSimulation(echo=lambda line: None) as sim:
        superlink = sim.process
        assert superlink is not None
        assert processes_with_home(sim.home) != []
    assert processes_with_home(sim.home) == []
    assert superlink.poll() is not None
