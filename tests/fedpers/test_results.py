"""The results directory contract."""

import json
import math
import re
from pathlib import Path

import pytest

from fedpers.reports import plot_rounds, read_config, read_rounds, read_summary
from fedpers.results import ROUNDS_FILE, ResultsExistError, RoundRecord, RunRecorder, final_mean


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
    recorder.finish({"final_accuracy": 0.6}, plots=["evaluate.accuracy"], plot=plot_rounds)
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


def test_a_round_without_evaluation_shows_the_last_value_not_nan(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path / "run")
    recorder.record(RoundRecord(round=1, seconds=1.0))
    assert recorder.progress_line(recorder.records[-1]).endswith("accuracy not evaluated yet")
    recorder.record(RoundRecord(round=2, seconds=1.0, evaluate={"accuracy": 0.5}))
    recorder.record(RoundRecord(round=3, seconds=1.0))
    line = recorder.progress_line(recorder.records[-1])
    assert line.endswith("accuracy 0.5 (round 2)")
    assert "nan" not in line


def test_per_client_rows_go_to_their_own_file_and_resume_keeps_them_in_step(
    tmp_path: Path,
) -> None:
    from fedpers.reports import final_client_metric, read_clients
    from fedpers.results import CLIENTS_FILE

    directory = tmp_path / "run"
    recorder = _recorder(directory)
    for r in (1, 2, 3):
        clients = {str(p): {"accuracy": r / 10 + p / 100} for p in range(3)}
        recorder.record(RoundRecord(round=r, seconds=1.0, clients=clients if r != 2 else {}))
    assert [row["round"] for row in read_clients(directory)] == [1, 3]
    assert final_client_metric(directory) == pytest.approx({"0": 0.3, "1": 0.31, "2": 0.32})
    assert all("clients" not in json.loads(line) for line in (directory / ROUNDS_FILE).open())
    assert read_rounds(directory)[0].clients == {}  # rounds.jsonl alone: no per-client data
    recorder.release()
    RunRecorder(
        directory,
        json.loads((directory / "config.json").read_text()),
        name="fedrep",
        total_rounds=3,
        progress_metric="evaluate.accuracy",
        resume_after=2,
    ).release()
    assert [row["round"] for row in read_clients(directory)] == [1]
    assert (directory / CLIENTS_FILE).exists()


def test_tensorboard_export_holds_every_round_metric(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedpers.results import TENSORBOARD_DIR

    directory = tmp_path / "run"
    recorder = RunRecorder(
        directory,
        {"seed": 1},
        name="fedrep",
        total_rounds=3,
        progress_metric="evaluate.accuracy",
        tensorboard=True,
    )
    for r in (1, 2, 3):
        recorder.record(
            RoundRecord(
                round=r,
                seconds=0.5 * r,
                train={"loss": 1.0 / r},
                evaluate={"accuracy": 0.25 * r} if r != 2 else {},
                server={"bytes-sent": 1000.0 * r, "bytes-received": float("nan")},
            )
        )
    recorder.finish({"final_accuracy": 0.75})
    events = EventAccumulator(str(directory / TENSORBOARD_DIR))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "evaluate/accuracy", "server/bytes-sent", "round/seconds"} <= tags
    assert "server/bytes-received" not in tags  # non-finite values are not written

    def series(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert series("evaluate/accuracy") == [(1, 0.25), (3, 0.75)]
    steps, values = zip(*series("train/loss"), strict=True)
    assert steps == (1, 2, 3)
    assert values == pytest.approx([1.0, 0.5, 1 / 3])  # stored as float32
    assert series("server/bytes-sent") == [(1, 1000.0), (2, 2000.0), (3, 3000.0)]
    # without the key nothing is written
    plain = _recorder(tmp_path / "plain")
    plain.record(RoundRecord(round=1, seconds=1.0))
    assert not (tmp_path / "plain" / TENSORBOARD_DIR).exists()


@pytest.mark.parametrize(
    ("rounds", "defect"),
    [
        ([1, 1, 2], "round 1 appears twice"),
        ([1, 3], "round 2 is missing"),
        ([2, 1], "round 2 comes before round 1"),
        ([1, 2, 3, 4], r"rounds \[4\] follow round 3"),
        ([1], "it ends after round 1"),
    ],
)
def test_resume_refuses_rounds_that_do_not_lead_to_its_checkpoint(
    tmp_path: Path, rounds: list[int], defect: str
) -> None:
    # Prepare: a run directory whose rounds.jsonl holds `rounds`; its checkpoint: round 2
    directory = tmp_path / "run"
    recorder = _recorder(directory)
    for r in rounds:
        recorder.record(RoundRecord(round=r, seconds=1.0))
    recorder.release()
    before = (directory / ROUNDS_FILE).read_text()
    # Execute, Assert: refused, named in failure.json, rounds.jsonl left as it was
    with pytest.raises(ValueError, match=defect):
        RunRecorder(
            directory,
            read_config(directory),
            name="fedrep",
            total_rounds=3,
            progress_metric="evaluate.accuracy",
            resume_after=2,
        )
    assert re.search(defect, json.loads((directory / "failure.json").read_text())["reason"])
    assert (directory / ROUNDS_FILE).read_text() == before
