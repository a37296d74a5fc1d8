"""A run that Flower stops (strategies/stopping.py): Flower's exit handlers, as
``flwr stop`` runs them, record the stop, nothing is written after it, and the
documented resume gives the uninterrupted run.

Flower's own stop path (its signal handler calling the registered exit handlers, then
exiting) is driven here in process: ``trigger_exit_handlers`` in the ServerApp's own
thread followed by ``SystemExit`` (a deployed ServerApp, whose main thread the handler
interrupts), or from another thread while the run goes on (a simulation, whose main
thread exits and takes the ServerApp's thread with it). The real ``flwr stop`` of a
deployed run: tests/deployment/test_by_hand.py."""

from __future__ import annotations

import json
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, MessageType, RecordDict
from flwr.supercore.exit import exit_handler

from fedpers import protocol
from fedpers.checkpoint import configuration_digest, load_checkpoint
from fedpers.clients.client_app import app as client_app
from fedpers.reports import read_config, read_rounds, read_summary
from fedpers.results import FAILURE_FILE, LOCK_FILE, SUMMARY_FILE, RunRecorder, read_token
from fedpers.strategies import server_app
from tests.helpers import InProcessGrid, run_config

STATE = {"algorithm": "fedrep", "num_rounds": 4, "num_clients": 4, "fraction_train": 1.0}


def _serve(tmp_path: Path, name: str, fail: Any = None, **overrides: Any) -> Path:
    values = run_config(
        **{
            **STATE,
            "results_dir": str(tmp_path),
            "run_name": name,
            "client_state_dir": str(tmp_path / "state"),
            **overrides,
        }
    )
    grid = InProcessGrid(client_app, values, values["num-clients"], fail=fail)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=values)
    server_app.main(grid, context)  # type: ignore[arg-type]
    return tmp_path / name


def _at_round_3(action: Any) -> Any:
    """A grid hook that runs ``action`` once, at round 3's first training message."""
    done = threading.Event()

    def hook(node: int, message: Any) -> str | None:
        config = message.content.config_records.get(protocol.CONFIG)
        training = message.metadata.message_type == MessageType.TRAIN
        third = config is not None and int(config.get(protocol.ROUND, 0)) == 3
        if training and third and not done.is_set():
            done.set()
            action()
        return None

    return hook


def _flower_stops() -> None:
    """What Flower's SIGINT handler does in a deployed ServerApp's main thread."""
    exit_handler.trigger_exit_handlers(run_before_force_exit=True)
    raise SystemExit(0)


def _flower_stops_from_another_thread() -> None:
    """What it does in a simulation: the handlers run in the main thread, the ServerApp's
    thread goes on until the process exits."""
    thread = threading.Thread(
        target=exit_handler.trigger_exit_handlers, kwargs={"run_before_force_exit": True}
    )
    thread.start()
    thread.join()


def _untimed(value: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in value.items() if not k.endswith(("seconds", "_unix"))}


def _check_stopped(directory: Path) -> None:
    failure = json.loads((directory / FAILURE_FILE).read_text())
    assert failure["interrupted"] is True
    assert failure["rounds_completed"] == 2
    assert "resume=true run-name='stopped'" in failure["reason"]
    assert [r.round for r in read_rounds(directory)] == [1, 2]
    checkpoint = load_checkpoint(
        directory,
        num_rounds=STATE["num_rounds"],
        token=read_token(directory),
        configuration=configuration_digest(read_config(directory)),
    )
    assert checkpoint.round == 2
    assert not (directory / SUMMARY_FILE).exists()
    assert not any(entry.exit_handler for entry in exit_handler.registered_exit_handlers)


@pytest.mark.parametrize(
    "stop", [_flower_stops, _flower_stops_from_another_thread], ids=["deployed", "simulated"]
)
def test_a_stopped_run_records_it_and_resumes_to_the_uninterrupted_run(
    tmp_path: Path, stop: Any
) -> None:
    straight = _serve(tmp_path, "straight")
    deployed = stop is _flower_stops
    if deployed:
        with pytest.raises(SystemExit):
            _serve(tmp_path, "stopped", fail=_at_round_3(stop))
    else:  # the run goes on around the stop, writing nothing, and returns
        _serve(tmp_path, "stopped", fail=_at_round_3(stop))
    directory = tmp_path / "stopped"
    _check_stopped(directory)
    # the lock is free: another recorder may take the directory (a resume)
    resumed = _serve(tmp_path, "stopped", resume=True)
    assert not (resumed / FAILURE_FILE).exists()
    for a, b in zip(read_rounds(straight), read_rounds(resumed), strict=True):
        assert _untimed(asdict(a)) == _untimed(asdict(b))
    assert _untimed(read_summary(straight)) == _untimed(read_summary(resumed))
    assert (resumed / LOCK_FILE).exists()
    # one clock: the whole run holds its start-up (done lines showed "rounds -0.5 s")
    for summary in (read_summary(straight), read_summary(resumed)):
        assert summary["wall_seconds"] >= summary["startup_seconds"] >= 0


def test_a_stop_after_the_end_changes_nothing(tmp_path: Path) -> None:
    """The handler is gone once the run ends: Flower's exit after a finished run (its
    normal path) writes no failure over it."""
    registered = list(exit_handler.registered_exit_handlers)
    directory = _serve(tmp_path, "done")
    assert exit_handler.registered_exit_handlers == registered  # the run's is gone
    exit_handler.trigger_exit_handlers(run_before_force_exit=True)
    assert (directory / SUMMARY_FILE).exists()
    assert not (directory / FAILURE_FILE).exists()


def test_stop_waits_for_a_write_and_then_writes_nothing(tmp_path: Path) -> None:
    """``RunRecorder.stop`` against a write in progress in another thread: it waits for
    it, and the writer's next round is not written."""
    recorder = RunRecorder(
        tmp_path / "r", {"a": 1}, name="r", total_rounds=3, progress_metric="evaluate.accuracy"
    )
    stopped: list[int | None] = []
    with recorder.writing() as running:
        assert running
        thread = threading.Thread(target=lambda: stopped.append(recorder.stop("test")))
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive()  # waits for the write
    thread.join(timeout=5)
    assert stopped == [0]
    with recorder.writing() as running:
        assert not running
    assert recorder.stop("again") is None
    assert json.loads((tmp_path / "r" / FAILURE_FILE).read_text())["rounds_completed"] == 0
