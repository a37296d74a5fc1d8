"""What a FedRep run over 100 virtual clients writes: rounds, sampling, evaluation of
every client, the summary, the configuration, the plot and the final arrays.

In process (``InProcessSimulation``: the ServerApp's main on a grid of real ClientApps,
which writes what `flwr run` writes, to 1e-9; tests/simulations/conftest.py). It was a
real `flwr run` (44 s in make test); the real runs that remain cover what Flower adds:
every script's first run (``through_flower``), 200 virtual nodes in the scale
benchmark's quick form, the faults, the killed server and the stopped simulation.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpers.reports import read_config, read_rounds, read_summary
from tests.simulations.conftest import InProcessSimulation


def test_fedrep_runs_with_100_virtual_clients(tmp_path: Path) -> None:
    directory = InProcessSimulation().run(
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
