"""The results directory contract."""

import json
import math
from pathlib import Path

import pytest

from fedpers.results import (
    ResultsExistError,
    RoundRecord,
    RunRecorder,
    final_mean,
    read_config,
    read_rounds,
    read_summary,
)


def _recorder(directory: Path) -> RunRecorder:
    return RunRecorder(
        directory,
        {"seed": 1},
        name="fedrep",
        total_rounds=3,
        progress_metric="evaluate.accuracy",
    )


def test_recorder_writes_config_rounds_summary_and_plot(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path / "run")
    for r, accuracy in enumerate((0.5, 0.7, math.nan), start=1):
        recorder.record(RoundRecord(round=r, seconds=0.1, evaluate={"accuracy": accuracy}))
    recorder.finish({"final_accuracy": 0.6}, plots=["evaluate.accuracy"])
    run = tmp_path / "run"
    assert read_config(run) == {"seed": 1}
    lines = (run / "rounds.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2, 3]
    assert json.loads(lines[2])["evaluate"]["accuracy"] is None  # NaN is written as null
    assert [r.evaluate.get("accuracy") for r in read_rounds(run)] == [0.5, 0.7, None]
    summary = read_summary(run)
    assert summary["final_accuracy"] == 0.6
    assert summary["rounds"] == 3
    assert (run / "evaluate_accuracy.png").stat().st_size > 1000


def test_recorder_refuses_to_overwrite_results(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path / "run")
    recorder.record(RoundRecord(round=1, seconds=0.1))
    with pytest.raises(ResultsExistError, match="already holds the results"):
        _recorder(tmp_path / "run")
    assert len((tmp_path / "run" / "rounds.jsonl").read_text().splitlines()) == 1


def test_final_mean_averages_the_last_rounds_that_report() -> None:
    records = [RoundRecord(round=r, seconds=0, evaluate={"accuracy": r / 10}) for r in range(1, 11)]
    assert final_mean(records, "evaluate.accuracy", last=3) == pytest.approx((0.8 + 0.9 + 1.0) / 3)
    assert math.isnan(final_mean(records, "train.loss", last=3))


def test_progress_line_has_round_eta_and_metric(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path / "run")
    recorder.record(RoundRecord(round=1, seconds=5.0, evaluate={"accuracy": 0.25}))
    recorder.record(RoundRecord(round=2, seconds=1.0, evaluate={"accuracy": 0.5}))
    line = recorder.progress_line(recorder.records[-1])
    assert line.startswith("fedrep | round 2/3 | elapsed ")
    assert "ETA 00:01" in line  # one round left at the steady 1 s per round
    assert line.endswith("accuracy 0.5")
