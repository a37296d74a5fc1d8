"""fedpers-supernode: Flower's SuperNode with its waits set, and nothing else changed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import pytest
from flwr.supercore.inflatable import inflatable_utils
from flwr.supernode import start_client_internal as loop

from fedpers import flower_waits, supernode


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """What ``time.sleep`` was asked for, instead of sleeping."""
    calls: list[float] = []
    monkeypatch.setattr(time, "sleep", calls.append)
    return calls


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's modules as they were after the test."""
    monkeypatch.setattr(loop, "time", loop.time)
    pulls = [getattr(inflatable_utils, name) for name in flower_waits.PULLS]
    for function in (*pulls, loop.pull_objects):
        monkeypatch.setattr(function, "__kwdefaults__", dict(function.__kwdefaults__ or {}))


def test_the_two_flower_waits_are_replaced_and_nothing_else(slept: list[float]) -> None:
    waits = supernode.Waits(poll=0.2, reply_poll=0.05)
    for seconds in (3, 3.0, 0.5, 1.0, 0.25):
        waits.sleep(seconds)
    assert slept == [0.2, 0.2, 0.05, 1.0, 0.25]
    assert waits.monotonic is time.monotonic  # the rest of `time` is time's own


@pytest.mark.usefixtures("restored")
def test_install_sets_the_loop_and_object_waits(slept: list[float]) -> None:
    flower = dict(inflatable_utils.pull_objects.__kwdefaults__ or {})
    assert (flower["initial_backoff"], flower["backoff_cap"]) == (
        supernode.FLOWER_OBJECT_BACKOFF,
        supernode.FLOWER_OBJECT_BACKOFF_CAP,
    )  # the installed Flower has the values this module documents
    supernode.install(0.2, 0.05, 0.1, 1.0)
    loop.time.sleep(3)  # the SuperNode's "nothing to pull" wait
    loop.time.sleep(0.5)  # its wait for a reply or an object
    assert slept == [0.2, 0.05]
    pulls = [getattr(inflatable_utils, name) for name in flower_waits.PULLS]
    for function in (*pulls, loop.pull_objects):
        assert function.__kwdefaults__ is not None
        assert function.__kwdefaults__["initial_backoff"] == 0.1
        assert function.__kwdefaults__["backoff_cap"] == 1.0


def test_a_flower_without_those_waits_is_refused_by_name() -> None:
    changed = types.ModuleType("start_client_internal")
    changed.__file__ = "start_client_internal.py"

    def pull_objects(*, max_time: float = 1.0) -> None: ...

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(supernode.inspect, "getsource", lambda module: "time.sleep(5)")
        with pytest.raises(supernode.SuperNodeWaitError) as error:
            supernode._check_source(changed, pull_objects)
    message = str(error.value)
    for part in ("time.sleep(3)", "time.sleep(0.5)", "initial_backoff", "flower-supernode itself"):
        assert part in message


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "61", "soon"])
def test_a_wait_out_of_range_fails_before_flower_starts(value: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fedpers.supernode", "--poll-interval", value, "--insecure"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--poll-interval" in done.stderr
    assert "Starting Flower SuperNode" not in done.stderr + done.stdout


def test_the_superexec_inherits_the_task_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[list[str]] = []
    monkeypatch.setattr(supernode, "install", lambda *waits: started.append(list(waits)))
    monkeypatch.setattr(loop, "subprocess", loop.subprocess)  # the launcher's hook, restored
    for name in (supernode.TASK_POLL_ENV, supernode.ACTIVE_TASK_POLL_ENV):
        monkeypatch.setenv(name, "5")  # restored (unset) after the test
        monkeypatch.delenv(name)
    import flwr.supernode.cli as cli

    monkeypatch.setattr(cli, "flower_supernode", lambda: started.append(sys.argv[:]))
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    supernode.main(["--poll-interval", "0.2", "--insecure", "--superlink", "127.0.0.1:1"])
    assert started == [
        [0.2, supernode.REPLY_POLL, supernode.OBJECT_BACKOFF, supernode.OBJECT_BACKOFF_CAP],
        ["flower-supernode", "--insecure", "--superlink", "127.0.0.1:1"],
    ]
    assert os.environ[supernode.TASK_POLL_ENV] == str(supernode.TASK_POLL)
    assert os.environ[supernode.ACTIVE_TASK_POLL_ENV] == str(supernode.ACTIVE_TASK_POLL)
    supernode.main(["--flower-waits"])
    assert started[2] == [3.0, 0.5, 1.0, 10.0]
    assert supernode.ACTIVE_TASK_POLL_ENV not in os.environ  # Flower's task poll alone
    # An active poll no faster than the task poll, or Flower's launcher: no active poll
    for flags in (["--active-task-poll", "1"], ["--launcher", "flower"]):
        monkeypatch.setenv(supernode.ACTIVE_TASK_POLL_ENV, "0.1")
        supernode.main(flags)
        assert supernode.ACTIVE_TASK_POLL_ENV not in os.environ, flags
    supernode.main(["--active-task-poll", "0.2", "--task-poll-interval", "2"])
    assert os.environ[supernode.ACTIVE_TASK_POLL_ENV] == "0.2"
    assert os.environ[supernode.TASK_POLL_ENV] == "2.0"
