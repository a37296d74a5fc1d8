"""Resume is exact or refuses; checkpoints, snapshots and results directories survive
damage and concurrent runs. The ServerApp's ``main`` runs in process against an
in-process grid of real ClientApps (no Ray)."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, MessageType, RecordDict

from fedpers import protocol
from fedpers.checkpoint import CHECKPOINT_FILE, CheckpointError, load_checkpoint, save_checkpoint
from fedpers.clients import device_state
from fedpers.clients.client_app import app as client_app
from fedpers.config import ConfigError, RunConfig, load_run_config
from fedpers.reports import read_rounds, read_summary
from fedpers.results import FAILURE_FILE, ROUNDS_FILE, ResultsExistError, RunRecorder
from fedpers.strategies import server_app
from fedpers.strategies.rounds import RoundFailedError
from tests.helpers import InProcessGrid, run_config

SETTINGS = {"dataset": "digits", "num_clients": 4, "fraction_train": 0.5, "epochs": 1}


def _serve(tmp_path: Path, grid: InProcessGrid | None = None, **overrides: Any) -> Path:
    values = run_config(
        **{**SETTINGS, "results_dir": str(tmp_path), "run_name": "run", **overrides}
    )
    grid = grid or InProcessGrid(client_app, values, values["num-clients"])
    for context in grid.contexts.values():
        context.run_config = dict(values)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=values)
    server_app.main(grid, context)  # type: ignore[arg-type]
    return tmp_path / "run"


def test_resume_without_client_state_refuses_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="'client-state-dir' is empty"):
        load_run_config({"algorithm": "fedrep", "resume": True})
    for algorithm in ("fedgmm", "sheaf-frl", "ditto", "fedbabu"):
        with pytest.raises(ConfigError, match="keeps state on its clients"):
            load_run_config({"algorithm": algorithm, "resume": True, "dataset": "digits"})
    # FedAvg keeps nothing on its clients: its checkpoint alone resumes it exactly
    assert load_run_config({"algorithm": "fedavg", "resume": True}).resume


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    # Prepare: the same run straight, and interrupted in round 3 (every node fails, so
    # round 2's checkpoint is the last), then resumed on fresh nodes (empty state)
    state = {"num_rounds": 4, "num_clients": 10, "client_state_dir": str(tmp_path / "s")}

    def killed_from_round_3(node: int, message: Any) -> str | None:
        config = message.content.config_records.get(protocol.CONFIG)
        training = message.metadata.message_type == MessageType.TRAIN
        late = config is not None and int(config.get(protocol.ROUND, 0)) >= 3
        return "killed" if training and late else None

    straight = _serve(tmp_path / "a", **state)
    values = run_config(**{**SETTINGS, **state, "results_dir": str(tmp_path), "run_name": "run"})
    with pytest.raises(RoundFailedError):
        _serve(tmp_path, InProcessGrid(client_app, values, 10, fail=killed_from_round_3), **state)
    # Execute
    resumed = _serve(tmp_path, resume=True, **state)
    # Assert: every round's metrics as in the uninterrupted run
    for a, b in zip(read_rounds(straight), read_rounds(resumed), strict=True):
        assert (a.round, a.train, a.evaluate) == (b.round, b.train, b.evaluate)


def test_a_damaged_checkpoint_is_named_with_its_fix_and_recorded(tmp_path: Path) -> None:
    state = str(tmp_path / "s")
    _serve(tmp_path, num_rounds=3, client_state_dir=state)
    path = tmp_path / "run" / CHECKPOINT_FILE
    path.write_bytes(path.read_bytes()[:100])  # cut short, as a crash would leave it
    with pytest.raises(CheckpointError, match=r"checkpoint\.npz cannot be read"):
        _serve(tmp_path, num_rounds=3, resume=True, client_state_dir=state)
    failure = json.loads((tmp_path / "run" / FAILURE_FILE).read_text())
    assert "cannot be read" in failure["reason"]
    assert "start afresh" in failure["reason"]


@pytest.mark.parametrize("stored_round", [-3, 1_000_000, 3])
def test_a_checkpoint_round_outside_the_run_is_refused(tmp_path: Path, stored_round: int) -> None:
    save_checkpoint(tmp_path, stored_round, {"body.w": np.zeros(2)})
    with pytest.raises(CheckpointError, match=f"at round {stored_round}, not in 1..2"):
        load_checkpoint(tmp_path, num_rounds=3)


def test_a_checkpoint_of_another_model_is_refused_before_any_round(tmp_path: Path) -> None:
    _serve(tmp_path, num_rounds=3, algorithm="fedavg")
    (tmp_path / "run" / "summary.json").unlink()
    save_checkpoint(tmp_path / "run", 1, {"renamed.weight": np.zeros((3, 3), np.float32)})
    with pytest.raises(CheckpointError, match="does not fit this run"):
        _serve(tmp_path, num_rounds=3, resume=True, algorithm="fedavg")
    assert "does not fit" in json.loads((tmp_path / "run" / FAILURE_FILE).read_text())["reason"]


def test_a_half_written_last_round_is_dropped_and_resume_rewrites_the_file(
    tmp_path: Path,
) -> None:
    _serve(tmp_path, num_rounds=3, algorithm="fedavg")
    rounds_file = tmp_path / "run" / ROUNDS_FILE
    whole = rounds_file.read_text().splitlines()
    (tmp_path / "run" / "summary.json").unlink()
    save_checkpoint(tmp_path / "run", 2, dict(np.load(tmp_path / "run" / "final_arrays.npz")))
    rounds_file.write_text("\n".join(whole[:2]) + "\n" + whole[2][:25])  # round 3 cut short
    assert [r.round for r in read_rounds(tmp_path / "run")] == [1, 2]
    _serve(tmp_path, num_rounds=3, resume=True, algorithm="fedavg")
    assert [r.round for r in read_rounds(tmp_path / "run")] == [1, 2, 3]
    assert read_summary(tmp_path / "run")["rounds"] == 3


def test_a_damaged_line_before_the_last_is_an_error(tmp_path: Path) -> None:
    (tmp_path / ROUNDS_FILE).write_text('{"round": 1, "seconds": 1.0}\nnot json\n{}\n')
    with pytest.raises(ValueError, match="line 2, is not a round record"):
        read_rounds(tmp_path)


def test_two_runs_of_one_name_cannot_write_the_same_directory(tmp_path: Path) -> None:
    config = {"algorithm": "fedrep"}
    first = RunRecorder(
        tmp_path / "run", config, name="a", total_rounds=2, progress_metric="train.loss"
    )
    with pytest.raises(ResultsExistError, match="another run is writing"):
        RunRecorder(tmp_path / "run", config, name="b", total_rounds=2, progress_metric="x.y")
    first.release()


def test_runs_started_together_do_not_interleave(tmp_path: Path) -> None:
    outcomes: list[str] = []

    def start() -> None:
        try:
            RunRecorder(
                tmp_path / "run", {}, name="r", total_rounds=1, progress_metric="train.loss"
            )
            outcomes.append("claimed")
        except ResultsExistError:
            outcomes.append("refused")

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["claimed", "refused", "refused", "refused"]


def test_a_stale_failure_is_removed_when_a_run_starts(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / FAILURE_FILE).write_text('{"reason": "old"}')
    _serve(tmp_path, num_rounds=1, algorithm="fedavg")
    assert not (tmp_path / "run" / FAILURE_FILE).exists()
    assert (tmp_path / "run" / "summary.json").exists()


# ------------------------------------------------------------------ device snapshots
def _node(tmp_path: Path, run_name: str = "run") -> tuple[RunConfig, Context]:
    values = run_config(run_name=run_name, client_state_dir=str(tmp_path))
    context = Context(
        run_id=1,
        node_id=5,
        node_config={"partition-id": 2},
        state=RecordDict(),
        run_config=values,
    )
    return RunConfig.from_mapping(values), context


def _store(run: RunConfig, context: Context, value: float, server_round: int, token: str) -> None:
    from flwr.app import Array, ArrayRecord

    context.state["fedpers.personal"] = ArrayRecord({"head.weight": Array(np.full(3, value))})
    device_state.persist(run, context, server_round=server_round, token=token)


def _head(context: Context) -> np.ndarray:
    return context.state["fedpers.personal"]["head.weight"].numpy()


def test_a_damaged_newest_snapshot_falls_back_to_the_one_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a run in this process routed fedpers' loggers to Flower's (route_to_flower): let
    # them reach caplog again
    monkeypatch.setattr(logging.getLogger("fedpers"), "propagate", True)
    run, node = _node(tmp_path)
    _store(run, node, 1.0, 1, "t")
    _store(run, node, 2.0, 2, "t")
    newest = device_state.snapshots(run, node, "t")[2]
    newest.write_bytes(newest.read_bytes()[:50])
    fresh_run, fresh = _node(tmp_path)
    assert device_state.restore(fresh_run, fresh, before_round=3, token="t")
    np.testing.assert_array_equal(_head(fresh), np.full(3, 1.0))
    assert "is damaged" in caplog.text


def test_a_new_run_of_the_same_name_never_sees_the_old_runs_state(tmp_path: Path) -> None:
    run, old = _node(tmp_path)
    for server_round in range(1, 6):  # the old run was longer
        _store(run, old, 9.0, server_round, "old-run")
    _, new = _node(tmp_path)
    assert not device_state.restore(run, new, before_round=3, token="new-run")
    _store(run, new, 1.0, 1, "new-run")
    _store(run, new, 2.0, 2, "new-run")
    _store(run, new, 3.0, 3, "new-run")
    # the clean-up keeps the new run's last two, and never touches the old run's
    assert sorted(device_state.snapshots(run, new, "new-run")) == [2, 3]
    assert sorted(device_state.snapshots(run, old, "old-run")) == [4, 5]
