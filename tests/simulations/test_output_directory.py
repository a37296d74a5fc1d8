"""A script's --out: --overwrite never deletes a run directory that a run is writing,
and a results-dir or data-root that cannot be a directory stops the script before
anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpers.results import RunRecorder
from fedpers.simulations.runs import MARKER, prepare_output, validate_runs


def test_overwrite_refuses_a_directory_whose_run_holds_its_lock(tmp_path: Path) -> None:
    out = prepare_output(tmp_path / "out", overwrite=False)
    running = out / "runs" / "fedrep-seed0"
    recorder = RunRecorder(
        running, {"seed": 0}, name="fedrep", total_rounds=2, progress_metric="train.loss"
    )

    with pytest.raises(SystemExit) as error:
        prepare_output(out, overwrite=True)

    message = str(error.value.code)
    assert str(running) in message
    assert "is writing" in message
    assert "choose another --out" in message
    assert (running / "config.json").is_file()  # nothing was deleted
    assert (out / MARKER).is_file()
    recorder.release()
    again = prepare_output(out, overwrite=True)  # once the run is over, it may go
    assert sorted(p.name for p in again.iterdir()) == [MARKER]


def test_a_results_dir_that_is_a_file_is_refused_before_any_run(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.write_text("not a directory")

    with pytest.raises(SystemExit) as error:
        validate_runs([{"results-dir": str(results), "run-name": "r"}])

    message = str(error.value.code)
    assert "'results-dir'" in message
    assert str(results) in message
    assert "not a directory" in message


def test_a_data_root_that_is_a_file_is_refused_before_any_run(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.write_text("not a directory")

    with pytest.raises(SystemExit) as error:  # digits: data-root holds its cache
        validate_runs([{"dataset": "digits", "data-root": str(root), "run-name": "r"}])

    message = str(error.value.code)
    assert "'data-root'" in message
    assert "not a directory" in message


def test_an_unreachable_target_epsilon_is_refused_before_any_run(tmp_path: Path) -> None:
    # 1,000 rounds of every client spend 0.019 even at noise multiplier 1000 (delta
    # 1/100^1.1): 0.01 cannot be reached. It was refused only when the ServerApp
    # started, after Flower and Ray.
    run = {
        "dp": "central",
        "dp-clip": 1.0,
        "dp-target-epsilon": 0.01,
        "fraction-train": 1.0,
        "num-rounds": 1000,
        "results-dir": str(tmp_path),
        "run-name": "r",
    }
    with pytest.raises(SystemExit) as error:
        validate_runs([run])

    message = str(error.value.code)
    assert "'dp-target-epsilon' = 0.01: no noise multiplier up to 1000" in message
    assert not (tmp_path / "r").exists()
