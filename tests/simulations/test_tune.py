"""simulations.tune (its runs in process, each message through Flower's encoding:
``on_the_wire``, tests/simulations/conftest.py), and a federation smaller than
num-clients, through Flower."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedpers.config import load_run_config
from fedpers.data.client import client_data
from fedpers.reports import read_clients, read_config, read_summary
from fedpers.simulations import tune
from fedpers.simulations.launch import FlowerRunError, LocalSimulation
from tests.simulations.conftest import InProcessSimulation, assert_on_the_wire


@pytest.mark.script
def test_tune_scores_each_value_on_validation_and_records_the_choice(
    tmp_path: Path, on_the_wire: list[InProcessSimulation]
) -> None:
    base = "algorithm='fedrep' dataset='digits' num-clients=6 num-rounds=3 final-rounds=2"
    summary = tune.main(
        ["--out", str(tmp_path), "--key", "lr", "--values", "0.001,0.05", "--run-config", base]
    )
    assert summary["split"] == "validation"
    assert summary["values"] == [0.001, 0.05]
    scores = {}
    for value in ("0.001", "0.05"):
        directory = tmp_path / "runs" / f"lr-{value}-seed0"
        config = read_config(directory)
        assert config["evaluate-split"] == "validation"
        assert config["lr"] == float(value)
        scores[value] = read_summary(directory)["final_accuracy"]
        # every evaluation counted the clients' validation samples, not their test samples
        run = load_run_config({k: v for k, v in config.items() if k not in ("run-name",)})
        sizes = {str(p): len(client_data(run, p).y_test) for p in range(6)}
        test = load_run_config({**config, "evaluate-split": "test"})
        assert sizes != {str(p): len(client_data(test, p).y_test) for p in range(6)}
        last = read_clients(directory)[-1]["clients"]
        assert {p: int(v["num-examples"]) for p, v in last.items()} == sizes
    assert summary["score"] == pytest.approx(scores)
    best = max(scores, key=lambda v: scores[v])
    assert summary["chosen"] == float(best)
    assert json.loads((tmp_path / "summary.json").read_text())["chosen"] == float(best)
    assert np.isfinite(list(summary["score"].values())).all()
    assert (tmp_path / "tune.png").stat().st_size > 1000
    assert_on_the_wire(on_the_wire, tmp_path)


@pytest.mark.flower
def test_too_few_virtual_nodes_fail_at_once_naming_the_fix(
    simulation: LocalSimulation, tmp_path: Path
) -> None:
    overrides = {
        "algorithm": "fedavg",
        "dataset": "digits",
        "num-clients": 5,
        "num-rounds": 1,
        "results-dir": str(tmp_path),
        "run-name": "short",
    }
    with pytest.raises(FlowerRunError) as error:
        simulation.run(overrides, num_supernodes=2)
    # the 5 s settle check, not the 120 s node-wait timeout ("within 120 s")
    assert "this simulation has 2 virtual nodes" in str(error.value)
    assert "num-supernodes=5" in str(error.value)
    failure = json.loads((tmp_path / "short" / "failure.json").read_text())
    assert "num-supernodes=5" in failure["reason"]
    assert "\x1b[" not in failure["reason"]


@pytest.mark.usefixtures("no_superlink")
@pytest.mark.long
def test_in_process_tuning_scores_what_an_in_process_run_gives(tmp_path: Path) -> None:
    from fedpers.simulations.inprocess import InProcessSimulation

    base = "algorithm='fedrep' dataset='digits' num-clients=4 num-rounds=2 final-rounds=1"
    summary = tune.main(
        ["--out", str(tmp_path / "tune"), "--key", "lr", "--values", "0.001,0.05",
         "--run-config", base, "--in-process", "--parallel", "2"]
    )  # fmt: skip
    # Oracle: each value's run again in this process, on validation as tune asks
    for value in ("0.001", "0.05"):
        config = read_config(tmp_path / "tune" / "runs" / f"lr-{value}-seed0")
        assert config["evaluate-split"] == "validation"
        again = InProcessSimulation().run(
            {**config, "results-dir": str(tmp_path / "again"), "run-name": f"lr-{value}"}
        )
        expected = read_summary(again)["final_accuracy"]
        assert summary["score"][value] == pytest.approx(expected, rel=1e-12)


def test_a_value_that_is_no_path_segment_names_its_runs_by_its_place() -> None:
    # server-strategy-args = "eta=0.01" was refused as a run name ('=' in it)
    assert tune._label(0.05, 3) == "0.05"
    assert tune._label("fedadam", 0) == "fedadam"
    labels = [tune._label(v, i) for i, v in enumerate(["eta=0.01", "eta:0.01", "eta 0.1"])]
    assert labels == ["eta_0.01-v0", "eta_0.01-v1", "eta_0.1-v2"]
    for label in labels:
        load_run_config({"run-name": f"server-strategy-args-{label}-seed0"})
