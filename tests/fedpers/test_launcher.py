"""fedpers' prestarted ClientApp launcher: Flower's arguments, one forked process per
task, a fallback to Flower's executor for everything else, and the two races it guards."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import subprocess_executor
from flwr.supercore.superexec.executor.types import ExecutionSpec, LaunchResultStatus
from flwr.supernode import start_client_internal as loop
from flwr.supernode.runtime import run_clientapp

from fedpers import flower_waits, launcher, supernode

SPEC = ExecutionSpec(
    task_type=TaskType.CLIENT_APP,
    runtime_api_address="127.0.0.1:9094",
    token="a-token",
    insecure=False,
    root_certificates_path=None,
    runtime_dependency_install=False,
    parent_pid=4321,
    suppress_output=False,
    task_id=7,
)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"insecure": True},
        {"root_certificates_path": "/c/ca.crt"},
        {"insecure": True, "root_certificates_path": "/c/ca.crt"},  # insecure wins, as in Flower
        {"parent_pid": None},
        {"runtime_dependency_install": True, "suppress_output": True},
    ],
)
def test_the_child_gets_the_arguments_flower_gives_its_clientapp(
    changes: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = replace(SPEC, **changes)
    started: list[list[str]] = []
    monkeypatch.setattr(
        subprocess_executor.subprocess, "Popen", lambda args, **kw: started.append(args)
    )
    subprocess_executor.SubprocessExecutor().launch(spec)
    (flower,) = started
    assert flower[0] == launcher.CLIENTAPP
    assert launcher.clientapp_args(spec) == flower[1:]


def _zygote(preload: str = "") -> tuple[subprocess.Popen[bytes], Any]:
    read, write = os.pipe()
    command = [sys.executable, "-m", "fedpers.launcher", "zygote", "--status-fd", str(write)]
    process = subprocess.Popen(
        [*command, "--preload", preload],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        pass_fds=(write,),
    )
    os.close(write)
    return process, os.fdopen(read, "r")


def _gone(pid: int) -> bool:
    """Ended and reaped: a zombie (an ended child nobody waited for) is still there."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_zygote_forks_one_flower_clientapp_per_request_and_reaps_it() -> None:
    process, status = _zygote(preload="json,does_not_exist")
    try:
        assert status.readline().strip() == launcher.READY  # a missing module is skipped
        assert process.stdin is not None
        pids = []
        for _ in range(2):
            process.stdin.write(json.dumps({"argv": ["--help"]}).encode() + b"\n")
            process.stdin.flush()
            pids.append(int(status.readline()))
        process.stdin.write(b"not json\n")
        process.stdin.flush()
        assert status.readline().startswith("error bad request")
        deadline = time.monotonic() + 30
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(pid) for pid in pids)
        assert len(set(pids)) == 2
        assert process.pid not in pids
    finally:
        # communicate() closes the requests pipe, as a SuperExec that ends does
        output = process.communicate(timeout=30)[0].decode()
        status.close()
    assert process.returncode == 0
    # Each child ran Flower's own flwr-clientapp main (argparse's --help), once.
    assert output.count("Run a Flower ClientApp") == 2


class _Fallback:
    """Flower's executor interface, recording what it was asked to launch."""

    def __init__(self) -> None:
        self.launched: list[ExecutionSpec] = []
        self.closed = False

    def launch(self, spec: ExecutionSpec) -> Any:
        from flwr.supercore.superexec.executor import LaunchResult

        self.launched.append(spec)
        return LaunchResult.accepted()

    def get_eligible_capacity(self, supported: Any, **kwargs: Any) -> Any:
        return supported, set()

    def wait_for_capacity(self, task_type: Any = None, **kwargs: Any) -> None: ...

    def reconcile(self) -> None: ...

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def executor(monkeypatch: pytest.MonkeyPatch) -> Iterator[launcher.PrestartedExecutor]:
    """A PrestartedExecutor whose children print flwr-clientapp's help and exit."""
    monkeypatch.setattr(launcher, "clientapp_args", lambda spec: ["--help"])
    made = launcher.PrestartedExecutor(preload=(), fallback=_Fallback())
    yield made
    made.close()


def test_clientapp_tasks_are_forked_and_the_rest_go_to_flower(
    executor: launcher.PrestartedExecutor,
) -> None:
    fallback = executor.fallback
    assert isinstance(fallback, _Fallback)
    assert executor._ready.wait(60)
    assert executor.launch(SPEC).status is LaunchResultStatus.ACCEPTED
    agent = replace(SPEC, task_type=TaskType.AGENT_APP)
    assert executor.launch(agent).status is LaunchResultStatus.ACCEPTED
    assert (executor.forked, executor.cold) == (1, 1)
    assert fallback.launched == [agent]
    executor.close()
    assert fallback.closed
    assert executor._zygote is None


def test_a_dead_zygote_costs_a_cold_start_and_is_started_again(
    executor: launcher.PrestartedExecutor,
) -> None:
    assert executor._ready.wait(60)
    first = executor._zygote
    assert first is not None
    first.kill()
    first.wait(timeout=10)
    assert executor.launch(SPEC).status is LaunchResultStatus.ACCEPTED
    assert (executor.forked, executor.cold) == (0, 1)  # Flower's executor launched it
    assert executor._zygote is not None
    assert executor._zygote is not first
    assert executor._ready.wait(60)
    executor.launch(SPEC)
    assert (executor.forked, executor.cold) == (1, 1)


def test_a_task_before_the_zygote_is_ready_starts_cold(monkeypatch: pytest.MonkeyPatch) -> None:
    fallback = _Fallback()
    made = launcher.PrestartedExecutor(preload=("time",), fallback=fallback)
    try:
        made._ready.clear()  # as while it imports torch
        made.launch(SPEC)
        assert fallback.launched == [SPEC]
        assert made.forked == 0
    finally:
        made.close()


class _Runtime:
    """A SuperNode's Runtime API whose message is stored after ``empty`` asks."""

    def __init__(self, empty: int) -> None:
        self.asks = 0
        self.empty = empty

    def PullMessages(self, request: object) -> Any:  # noqa: N802  (Flower's name)
        self.asks += 1
        messages = [] if self.asks <= self.empty else ["message"]
        return types.SimpleNamespace(messages_list=messages)


def test_a_child_asks_again_while_its_message_is_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    def flower_pull(client: Any) -> list[str]:
        response = client.PullMessages(None)
        if not response.messages_list:
            raise RuntimeError("No messages received from Runtime API")
        return list(response.messages_list)

    slept: list[float] = []
    monkeypatch.setattr(launcher.time, "sleep", slept.append)
    runtime = _Runtime(empty=5)
    assert launcher.waiting_for_message(flower_pull)(runtime) == ["message"]
    assert runtime.asks == 6
    assert slept == [0.01, 0.02, 0.04, 0.08, 0.16]
    assert runtime.PullMessages.__func__ is _Runtime.PullMessages  # type: ignore[attr-defined]
    # A message that never comes: Flower's own error, after MESSAGE_WAIT seconds.
    monkeypatch.setattr(launcher, "MESSAGE_WAIT", 0.0)
    with pytest.raises(RuntimeError, match="No messages received"):
        launcher.waiting_for_message(flower_pull)(_Runtime(empty=10**6))


def _backoff_functions() -> dict[str, Any]:
    """Every function of Flower's object pulls that takes the backoff as a keyword
    default, found by looking (not from ``flower_waits.PULLS``)."""
    from flwr.supercore.inflatable import inflatable_utils

    return {
        name: function
        for name, function in vars(inflatable_utils).items()
        if callable(function)
        and "initial_backoff" in (getattr(function, "__kwdefaults__", None) or {})
    }


def test_prepare_child_shortens_every_object_backoff_once(monkeypatch: pytest.MonkeyPatch) -> None:
    functions = _backoff_functions()
    assert set(functions) == {"pull_objects", "pull_and_inflate_object_from_tree"}
    flowers = {name: dict(f.__kwdefaults__) for name, f in functions.items()}
    for function in functions.values():
        monkeypatch.setattr(function, "__kwdefaults__", dict(function.__kwdefaults__))
    monkeypatch.setattr(run_clientapp, "pull_task_input", run_clientapp.pull_task_input)
    launcher.prepare_child()
    wrapped = run_clientapp.pull_task_input
    launcher.prepare_child()
    assert run_clientapp.pull_task_input is wrapped  # not wrapped twice
    # Each, the one a ClientApp's message comes through included (it hands its own
    # defaults on to pull_objects: shortening pull_objects alone left Flower's 1 s)
    for name, function in functions.items():
        assert function.__kwdefaults__ == {
            **flowers[name],
            "initial_backoff": flower_waits.OBJECT_BACKOFF,
            "backoff_cap": flower_waits.OBJECT_BACKOFF_CAP,
        }, name


def test_a_clientapp_message_pull_retries_at_the_short_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a forked child's pull of its message waits for an object not yet stored:
    the delays Flower's retry loop asks for, recorded (jitter off)."""
    from flwr.supercore.inflatable import inflatable_utils

    for function in _backoff_functions().values():
        monkeypatch.setattr(function, "__kwdefaults__", dict(function.__kwdefaults__))
    launcher.prepare_child()
    monkeypatch.setattr(inflatable_utils.random, "uniform", lambda a, b: 0.0)
    seen: list[float] = []

    def pull(object_id: str) -> bytes:
        if len(seen) < 4:
            seen.append(object_id)  # type: ignore[arg-type]
            raise inflatable_utils.ObjectUnavailableError(object_id)
        return b"x"

    waits: list[float] = []
    real_wait = inflatable_utils.threading.Event.wait

    def wait(self: Any, timeout: float | None = None) -> bool:
        waits.append(timeout)  # type: ignore[arg-type]
        return real_wait(self, 0)

    monkeypatch.setattr(inflatable_utils.threading.Event, "wait", wait)
    defaults = inflatable_utils.pull_and_inflate_object_from_tree.__kwdefaults__
    assert inflatable_utils.pull_objects(
        ["a"],
        pull,
        initial_backoff=defaults["initial_backoff"],
        backoff_cap=defaults["backoff_cap"],
    ) == {"a": b"x"}
    retry_waits = [w for w in waits if w is not None and w < 60]
    assert retry_waits == pytest.approx([0.05, 0.1, 0.1, 0.1])  # Flower's: 1, 2, 4, 8


def test_a_flower_without_the_backoff_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.supercore.inflatable import inflatable_utils

    monkeypatch.setattr(inflatable_utils.pull_objects, "__kwdefaults__", {"max_time": 1.0})
    with pytest.raises(flower_waits.FlowerWaitError, match="initial_backoff and backoff_cap"):
        flower_waits.set_object_backoff()


def test_the_supernode_starts_fedpers_superexec_and_nothing_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[list[str]] = []
    monkeypatch.setattr(supernode.subprocess, "Popen", lambda cmd, **kw: started.append(cmd))
    monkeypatch.setattr(loop, "subprocess", loop.subprocess)
    supernode.use_prestarted_launcher()
    loop.subprocess.Popen(["flower-superexec", "--insecure", "--parent-pid", "9"])
    loop.subprocess.Popen(["flwr-clientapp", "--token", "t"])
    assert started == [
        [sys.executable, "-m", "fedpers.launcher", "superexec", "--insecure", "--parent-pid", "9"],
        ["flwr-clientapp", "--token", "t"],
    ]
    assert loop.subprocess.DEVNULL is subprocess.DEVNULL  # the rest is subprocess's own


def test_the_task_poll_is_the_active_one_within_the_window_after_a_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(launcher.time, "sleep", slept.append)
    executor = types.SimpleNamespace(last_launch=-math.inf)  # never launched
    poll = launcher.TaskPoll(executor, active=0.1, window=30.0)  # type: ignore[arg-type]
    poll.sleep(1.0)
    executor.last_launch = time.monotonic()  # a task just now
    poll.sleep(1.0)
    poll.sleep(0.05)  # an interval below the active poll stays
    executor.last_launch = time.monotonic() - 31.0  # the window has passed
    poll.sleep(1.0)
    assert slept == [1.0, 0.1, 0.05, 1.0]
    assert poll.monotonic is time.monotonic  # the rest of `time` is time's own


@pytest.mark.parametrize("active", [None, "0.1"])
def test_the_superexec_polls_actively_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, active: str | None
) -> None:
    from flwr.supercore.constant import ExecutorType
    from flwr.supercore.superexec import run_superexec

    if active is None:
        monkeypatch.delenv(launcher.ACTIVE_TASK_POLL_ENV, raising=False)
    else:
        monkeypatch.setenv(launcher.ACTIVE_TASK_POLL_ENV, active)
    for name in ("time", "get_executor"):
        monkeypatch.setattr(run_superexec, name, getattr(run_superexec, name))
    made: list[object] = []
    monkeypatch.setattr(launcher, "PrestartedExecutor", lambda: made.append(object()) or made[-1])
    seen: list[object] = []

    def flower_main() -> None:  # what Flower's main does first: build the executor
        seen.append(run_superexec.get_executor(ExecutorType.SUBPROCESS))
        seen.append(run_superexec.time)

    monkeypatch.setattr("flwr.supercore.cli.flower_superexec", flower_main)
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    launcher.superexec(["--insecure"])
    assert seen[0] is made[0]
    if active is None:
        assert seen[1] is time  # Flower's task poll, untouched
    else:
        assert isinstance(seen[1], launcher.TaskPoll)
        assert (seen[1].executor, seen[1].active) == (made[0], 0.1)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "61", "soon"])
def test_an_active_task_poll_out_of_range_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(launcher.ACTIVE_TASK_POLL_ENV, value)
    with pytest.raises(ValueError, match=r"number of seconds in \[0.01, 60\], or leave it unset"):
        launcher.active_task_poll()


def test_a_superexec_that_polls_otherwise_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    launcher.check_task_poll_source()  # the installed Flower polls as expected
    monkeypatch.setattr(inspect, "getsource", lambda module: "time.sleep(interval)")
    with pytest.raises(RuntimeError, match="unset FEDPERS_ACTIVE_TASK_POLL"):
        launcher.check_task_poll_source()


def test_a_supernode_that_starts_no_superexec_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supernode.inspect, "getsource", lambda module: "subprocess.Popen(x)")
    with pytest.raises(supernode.SuperNodeWaitError, match="--launcher flower"):
        supernode.use_prestarted_launcher()


def test_the_object_backoff_of_a_run_is_flowers_again_after_it() -> None:
    functions = _backoff_functions()
    before = {name: dict(f.__kwdefaults__) for name, f in functions.items()}
    with flower_waits.object_backoff(0.02, 0.5):
        for function in functions.values():
            during = function.__kwdefaults__
            assert (during["initial_backoff"], during["backoff_cap"]) == (0.02, 0.5)
    assert {name: f.__kwdefaults__ for name, f in functions.items()} == before


def test_a_child_imports_the_fedpers_of_its_app_not_the_launchers(tmp_path: Path) -> None:
    # A FAB's copy of fedpers, told apart by a marker
    fab, package = tmp_path / "fab", Path(launcher.__file__).parent
    shutil.copytree(package, fab / "fedpers")
    shutil.copytree(package.parent / "clients", fab / "clients")  # as a FAB lays it out
    (fab / "fedpers" / "__init__.py").write_text(
        (fab / "fedpers" / "__init__.py").read_text() + "\nFROM_THE_FAB = True\n"
    )
    script = (
        "import sys\n"
        "from fedpers import launcher\n"  # the launcher's fedpers, as in the zygote
        "launcher.forget_fedpers()\n"
        f"sys.path.insert(0, {str(fab)!r})\n"  # Flower's app loader puts the FAB first
        "import fedpers, fedpers.clients\n"
        "print(getattr(fedpers, 'FROM_THE_FAB', False), fedpers.clients.__file__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    marker, clients = done.stdout.split()
    assert marker == "True"
    assert Path(clients).is_relative_to(fab)


@pytest.mark.parametrize("cached", [True, False])
def test_a_child_caches_its_apps_bytecode_where_the_image_says_not_to(
    tmp_path: Path, cached: bool
) -> None:
    """With PYTHONDONTWRITEBYTECODE set (as in the images), a forked child still writes
    the bytecode of the app it imports next to the app's source (the FAB's directory),
    so the next task of that FAB loads it instead of compiling; without
    ``cache_app_bytecode`` nothing is written (what every task paid before)."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "some_app_module.py").write_text("VALUE = 1\n")
    script = (
        "import sys\n"
        "from fedpers import launcher\n"
        + ("launcher.cache_app_bytecode()\n" if cached else "")
        + f"sys.path.insert(0, {str(app)!r})\n"
        "import some_app_module\n"
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60, env=env)
    written = list((app / "__pycache__").glob("some_app_module.*.pyc"))
    assert len(written) == (1 if cached else 0)
