"""A run directory is written only by the process holding its lock, stays inside
results-dir, and a failed write leaves neither a temporary file nor a held lock."""

from __future__ import annotations

import errno
import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedpers import atomic
from fedpers.config import ConfigError, load_run_config
from fedpers.results import (
    FAILURE_FILE,
    LOCK_FILE,
    ROUNDS_FILE,
    SUMMARY_FILE,
    RoundRecord,
    RunRecorder,
    run_directory,
    write_failure,
)


def _recorder(directory: Path) -> RunRecorder:
    return RunRecorder(
        directory, {"seed": 1}, name="fedrep", total_rounds=3, progress_metric="train.loss"
    )


def _lock_is_free(directory: Path) -> bool:
    """Whether another process could take the directory's lock now."""
    handle = os.open(directory / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(handle)  # closing drops the lock, if it was taken
    return True


def _temporary_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*.tmp"))


# ------------------------------------------------------------------ failure.json
def test_write_failure_leaves_a_finished_run_alone(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _recorder(run).finish({"final_accuracy": 0.9})
    summary = (run / SUMMARY_FILE).read_text()

    written = write_failure(run, "CheckpointError: a later resume failed")

    assert not written
    assert not (run / FAILURE_FILE).exists()
    assert (run / SUMMARY_FILE).read_text() == summary


def test_write_failure_does_not_write_into_a_run_another_recorder_holds(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    holder = _recorder(run)

    written = write_failure(run, "CheckpointError: not this run's")

    assert not written
    assert not (run / FAILURE_FILE).exists()
    holder.release()


def test_write_failure_writes_under_the_lock_and_releases_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    held_while_writing: list[bool] = []
    write_text = atomic.write_text

    def observing(path: Path, text: str) -> None:
        held_while_writing.append(not _lock_is_free(path.parent))
        write_text(path, text)

    monkeypatch.setattr("fedpers.results.write_text", observing)

    written = write_failure(run, "CheckpointError: no checkpoint")

    assert written
    assert held_while_writing == [True]
    assert json.loads((run / FAILURE_FILE).read_text())["reason"] == (
        "CheckpointError: no checkpoint"
    )
    assert _lock_is_free(run)


def test_fail_after_finish_does_not_overwrite_the_finished_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    recorder = _recorder(run)
    recorder.finish({"final_accuracy": 0.9})

    recorder.fail("RuntimeError: raised after the summary was written")

    assert not (run / FAILURE_FILE).exists()
    assert _lock_is_free(run)


def test_a_recorder_that_fails_to_start_releases_the_lock(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _recorder(run).fail("RuntimeError: round 1")  # a run to resume: rounds.jsonl absent
    with pytest.raises(ValueError, match="differ"):
        RunRecorder(
            run,
            {"seed": 2},  # another configuration than the interrupted run's
            name="fedrep",
            total_rounds=3,
            progress_metric="train.loss",
            resume_after=1,
        )
    assert _lock_is_free(run)


# ---------------------------------------------------------- disk full, read-only
class _FullDisk:
    """A file handle whose writes put half their data on disk, then fail (ENOSPC)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def write(self, data: Any) -> int:
        self._handle.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _fail_writes(monkeypatch: pytest.MonkeyPatch, point: str, names: Callable[[str], bool]) -> None:
    """Make the writes of files whose name ``names`` accepts fail at ``point``."""

    def no_space(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    if point == "fsync":
        monkeypatch.setattr(atomic.os, "fsync", no_space)
    elif point == "replace":

        def read_only(*_: object) -> None:
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(atomic.os, "replace", read_only)
    else:
        real_open = Path.open

        def opening(self: Path, *args: Any, **kwargs: Any) -> Any:
            handle = real_open(self, *args, **kwargs)
            writing = any(m in (args[0] if args else kwargs.get("mode", "r")) for m in "wa")
            return _FullDisk(handle) if writing and names(self.name) else handle

        monkeypatch.setattr(Path, "open", opening)


@pytest.fixture(params=["write", "fsync", "replace"])
def full_disk(request: pytest.FixtureRequest) -> str:
    """The point where every atomic write fails: the data, its fsync, or the rename."""
    return str(request.param)


def test_a_summary_that_cannot_be_written_leaves_no_temporary_file_and_frees_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full_disk: str
) -> None:
    run = tmp_path / "run"
    recorder = _recorder(run)
    recorder.record(RoundRecord(round=1, seconds=0.1))
    _fail_writes(monkeypatch, full_disk, lambda name: name.endswith(".tmp"))

    with pytest.raises(OSError, match=r"No space left|Read-only"):
        recorder.finish({"final_accuracy": 0.9})

    assert _temporary_files(tmp_path) == []
    assert not (run / SUMMARY_FILE).exists()
    assert not (run / FAILURE_FILE).exists()  # the disk is still full: no half file
    assert _lock_is_free(run)


def test_a_summary_write_that_fails_once_is_recorded_as_the_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    recorder = _recorder(run)
    fsync = os.fsync
    calls: list[int] = []

    def full_once(fd: int) -> None:  # the disk has room again after the first failure
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", full_once)

    with pytest.raises(OSError, match="No space left"):
        recorder.finish({"final_accuracy": 0.9})

    failure = json.loads((run / FAILURE_FILE).read_text())
    assert "No space left on device" in failure["reason"]
    assert _temporary_files(tmp_path) == []
    assert _lock_is_free(run)


def test_a_round_that_cannot_be_appended_leaves_the_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    recorder = _recorder(run)
    recorder.record(RoundRecord(round=1, seconds=0.1))
    before = (run / ROUNDS_FILE).read_bytes()
    _fail_writes(monkeypatch, "write", lambda name: name == ROUNDS_FILE)

    with pytest.raises(OSError, match="No space left"):
        recorder.record(RoundRecord(round=2, seconds=0.1))

    assert (run / ROUNDS_FILE).read_bytes() == before  # no half line for resume to trip on
    recorder.fail("OSError: round 2")
    assert json.loads((run / FAILURE_FILE).read_text())["rounds_completed"] == 1
    assert _lock_is_free(run)


def test_a_failure_that_cannot_be_written_still_frees_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full_disk: str
) -> None:
    run = tmp_path / "run"
    recorder = _recorder(run)
    _fail_writes(monkeypatch, full_disk, lambda name: name.endswith(".tmp"))

    recorder.fail("RuntimeError: round 1")  # logs that failure.json could not be written

    assert _temporary_files(tmp_path) == []
    assert not (run / FAILURE_FILE).exists()
    assert _lock_is_free(run)


# --------------------------------------------------------------------- run names
@pytest.mark.parametrize(
    "name", ["../x", "/tmp/x", ".", "..", "a\nb", "a\x00b", "", "a/b", ".hidden", "x" * 129]
)
def test_run_directory_refuses_a_name_that_is_not_one_safe_segment(
    tmp_path: Path, name: str
) -> None:
    with pytest.raises(ValueError, match="run-name") as error:
        run_directory(str(tmp_path), name)
    assert "A-Za-z0-9" in str(error.value)
    assert list(tmp_path.iterdir()) == []


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=140), st.from_regex(r"[A-Za-z0-9._/+-]{1,12}", fullmatch=True)))
def test_a_run_name_the_check_accepts_is_a_direct_child_of_results_dir(name: str) -> None:
    results = Path("/srv/results")
    try:
        load_run_config({"run-name": name})
    except ConfigError:
        with pytest.raises(ValueError, match="run-name"):
            run_directory(str(results), name)
        return
    if not name:  # the default name, made by the ServerApp
        return
    directory = run_directory(str(results), name)
    assert directory.parent == results
    assert directory.name == name
