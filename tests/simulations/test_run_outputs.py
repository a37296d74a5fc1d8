"""What a FedRep run over 100 virtual clients writes: rounds, sampling, evaluation of
every client, the summary, the configuration, the plot and the final arrays.

In process (``InProcessSimulation``: the ServerApp's main on a grid of real ClientApps,
which writes what `flwr run` writes, to 1e-9; tests/simulations/conftest.py). It was a
real `flwr run` (44 s in make test); the real runs that remain cover what Flower adds:
the first run of one script of each path through Flower (``through_flower``), 200
virtual nodes in the scale benchmark's quick form, the faults, the killed server and the
stopped simulation.
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


def test_a_run_reports_its_start_up_apart_and_ends_with_its_results_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: 'wall s' in the tables counted the start-up (61 s for 3 rounds of 3 s), no
    # line said what the run did before round 1, and none where its results went.
    from types import SimpleNamespace

    from fedpers import results
    from fedpers.simulations.tables import method_summary, method_table

    logged: list[str] = []  # the recorder's log lines (Flower's handler prints them)
    monkeypatch.setattr(results, "logger", SimpleNamespace(info=logged.append))
    lines: list[str] = []
    directory = InProcessSimulation(echo=lines.append).run(
        {
            "algorithm": "fedavg",
            "dataset": "digits",
            "num-clients": 4,
            "num-rounds": 2,
            "results-dir": str(tmp_path),
            "run-name": "timed",
        }
    )
    assert [line.split(" | ")[2] for line in logged if " | start-up | " in line] == [
        "waiting for 4 nodes and their partitions",
        "nodes registered, partitions known; choosing the initial model",
        "initial model ready; round 1 starts",
    ]
    summary = read_summary(directory)
    assert 0 < summary["startup_seconds"] < summary["wall_seconds"]
    started = summary["startup_unix"]
    assert summary["startup_seconds"] == pytest.approx(
        started["rounds_started"] - started["serverapp_started"]
    )
    startup, rounds = (
        summary["startup_seconds"],
        summary["wall_seconds"] - summary["startup_seconds"],
    )
    assert lines == [
        f"timed | done | results in {directory} | start-up {startup:.1f} s, rounds {rounds:.1f} s"
    ]
    table_summary = method_summary(
        ["fedavg"], [0], {"final_accuracy": {("fedavg", 0): 0.5}}, {}, {("fedavg", 0): directory}
    )
    assert table_summary["rounds_seconds"]["fedavg"] == pytest.approx(rounds)
    header = method_table(table_summary, [("final_accuracy", "final accuracy")]).splitlines()[0]
    assert header.endswith("| MB trained | rounds s | start-up s |")
