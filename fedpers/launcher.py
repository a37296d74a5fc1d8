"""A prestarted ClientApp launcher for Flower's SuperExec (``--isolation subprocess``).

Flower 1.42's SuperExec starts a fresh ``flwr-clientapp --token T`` process for every
message a SuperNode receives. Before that process can handle its message it imports
Flower's ``flwr-clientapp`` entry point (about 1.5-2 s here: it pulls in the SuperNode's
command line, sqlalchemy, alembic and fastapi) and then, through the app, torch and the
data libraries (3-5 s): most of a deployed round on a small device
(docs/deploying.md, "Where a deployed round's time goes").

``PrestartedExecutor`` gives the SuperExec processes that have done that work already.
It starts a *zygote* once: a process that imports the ``flwr-clientapp`` entry point and
the third-party libraries a fedpers ClientApp uses (``PRELOAD``), but not the app itself,
whose code still comes from the FAB of each task (the child forgets the fedpers that
runs the launcher before it starts). For every ClientApp task the zygote forks a child,
which runs Flower's own ``flwr-clientapp`` main with the task's token and arguments,
exactly once, and exits: one task per process, as in Flower, and the token
reaches a process only when its task exists. The wire protocol, the SuperNode, the
SuperLink and the ClientApp's code path are Flower's.

Two races that a fast start exposes are guarded in the child:

- The SuperNode creates a task before it stores the task's message and pulls the
  message's objects (``flwr/supernode/start_client_internal.py``). A cold process
  asked for the message seconds later; a forked one asks within milliseconds. The child
  asks again (``MESSAGE_WAIT``) instead of failing with "No messages received".
- Objects registered but not yet stored are retried after 0.05 s, doubling to 1 s,
  instead of Flower's 1 s doubling to 10 s (``fedpers.flower_waits``).

A task of any other type, a launch while the zygote is still importing, and any
failure of the zygote fall back to Flower's ``SubprocessExecutor`` (a cold process),
and a dead zygote is started again. ``fedpers-supernode`` uses this launcher by default
(``--launcher flower`` keeps Flower's).

    python -m fedpers.launcher superexec FLOWER-SUPEREXEC-ARGS...   # what the SuperNode starts
    python -m fedpers.launcher zygote --status-fd N [--preload a,b]  # what the executor starts
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flwr.supercore.superexec.executor.types import ExecutionSpec, LaunchResult

LOGGER = logging.getLogger(__name__)

# What a fedpers ClientApp imports beyond Flower (measured with an in-process run of the
# digits and MNIST-1D rows): imported once by the zygote, shared by every child.
PRELOAD = (
    "numpy",
    "scipy.linalg",
    "torch",  # not torch._dynamo: fedpers.training builds no torch.optim optimizer
    "sklearn.datasets",
    "flwr_datasets",
    "mnist1d",
)
CLIENTAPP = "flwr-clientapp"
READY = "ready"
# A forked child asks for its message again for up to MESSAGE_WAIT seconds, starting
# every 10 ms and doubling to 0.25 s, while the SuperNode stores it.
MESSAGE_WAIT = 60.0
# How long a launch waits for the zygote to say which child it forked.
ACK_TIMEOUT = 10.0
# The active task poll (``ACTIVE_TASK_POLL_ENV``, seconds; unset: off): for
# ``ACTIVE_WINDOW`` seconds after a launch, the SuperExec asks for its next task this
# often instead of every task-poll interval. A run's next message comes within a round,
# so a node in a run asks fast; an idle node asks at the task-poll interval and pays its
# price alone (docs/deploying.md, "An active task poll").
ACTIVE_TASK_POLL_ENV = "FEDPERS_ACTIVE_TASK_POLL"
ACTIVE_WINDOW = 30.0


# --------------------------------------------------------------------------- the zygote
def zygote(
    requests: IO[bytes], status_fd: int, preload: Sequence[str], *, on_fork: Callable[[], None]
) -> int:
    """Import ``preload``, say ``ready`` on ``status_fd``, then fork one child per JSON
    request line (``{"argv": [...], "quiet": bool}``) and answer each with the child's
    pid. Returns when ``requests`` ends (its SuperExec is gone)."""
    from flwr.supernode.cli import flwr_clientapp  # noqa: F401  (the expensive entry point)
    from flwr.supernode.runtime import run_clientapp  # noqa: F401

    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError as error:  # a device image without it: the child imports it
            LOGGER.warning("fedpers launcher: not preloading %s (%s)", name, error)
    status = os.fdopen(status_fd, "w", buffering=1)
    signal.signal(signal.SIGCHLD, _reap)
    status.write(f"{READY}\n")
    for line in requests:
        try:
            request = json.loads(line)
            argv = [str(a) for a in request["argv"]]
            quiet = bool(request.get("quiet", False))
        except (ValueError, KeyError, TypeError) as error:
            status.write(f"error bad request: {error}\n")
            continue
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _child(argv, quiet, close=(requests.fileno(), status.fileno()), on_fork=on_fork)
        status.write(f"{pid}\n")
    return 0


def _reap(_signum: int, _frame: object) -> None:
    """Collect every finished child (the zygote never waits for one)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _child(
    argv: list[str], quiet: bool, *, close: Sequence[int], on_fork: Callable[[], None]
) -> None:
    """Run Flower's ``flwr-clientapp`` main with ``argv`` in this forked process, then
    leave with its exit code (``os._exit``: nothing of the zygote's runs here)."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        if quiet:
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
        os.close(devnull)
        on_fork()
        forget_fedpers()
        cache_app_bytecode()
        from flwr.supernode.cli import flwr_clientapp

        sys.argv = [CLIENTAPP, *argv]
        flwr_clientapp()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # whatever it was, this process ends here
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def forget_fedpers() -> None:
    """Drop the fedpers that runs this launcher from the process: a task's ClientApp
    imports fedpers from its own FAB, which may hold other code than the node's install.
    (Python imports a package once per process: with the launcher's ``fedpers`` left in
    ``sys.modules`` the FAB's would never load.)"""
    for name in [n for n in sys.modules if n == "fedpers" or n.startswith("fedpers.")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_SiblingFinder"]


def cache_app_bytecode() -> None:
    """Let this process write the bytecode of what it imports. The app's modules come
    from its FAB, which Flower unpacks once per FAB under ``FLWR_HOME/apps``; with
    ``PYTHONDONTWRITEBYTECODE`` (the images set it, for their own install) every task
    compiled them again. Now the first task of a FAB caches them there and the next
    ones load them (Python writes each file atomically, and checks it against its
    source; where the directory is read-only nothing is written). In the namespace
    deployment, five interleaved pairs of runs: rounds of 3.53 s on average with it,
    3.93 s without (docs/deploying.md)."""
    sys.dont_write_bytecode = False


def prepare_child() -> None:
    """What a forked child changes in Flower before it runs: short object backoffs, and
    asking for its message again while the SuperNode stores it."""
    from flwr.supernode.runtime import run_clientapp

    from fedpers.flower_waits import set_object_backoff

    set_object_backoff()
    original = run_clientapp.pull_task_input
    if getattr(original, "waits_for_message", False):
        return
    run_clientapp.pull_task_input = waiting_for_message(original)  # type: ignore[assignment]


def waiting_for_message(pull_task_input: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``pull_task_input`` whose client asks for the task's message again while the
    answer is empty, for up to ``MESSAGE_WAIT`` seconds."""

    def pull(client: Any) -> Any:
        ask = client.PullMessages

        def patient(request: Any) -> Any:
            deadline, step = time.monotonic() + MESSAGE_WAIT, 0.01
            while True:
                response = ask(request)
                if response.messages_list or time.monotonic() > deadline:
                    return response
                time.sleep(step)
                step = min(0.25, 2 * step)

        client.PullMessages = patient
        try:
            return pull_task_input(client)
        finally:
            client.PullMessages = ask

    pull.waits_for_message = True  # type: ignore[attr-defined]
    return pull


# -------------------------------------------------------------------------- the executor
def clientapp_args(spec: ExecutionSpec) -> list[str]:
    """The arguments Flower's ``SubprocessExecutor`` gives ``flwr-clientapp`` for
    ``spec`` (tests/fedpers/test_launcher.py checks them against it)."""
    args = ["--runtime-api-address", spec.runtime_api_address, "--token", spec.token]
    if spec.insecure:
        args.append("--insecure")
    elif spec.root_certificates_path is not None:
        args.extend(["--root-certificates", spec.root_certificates_path])
    if spec.parent_pid is not None:
        args.extend(["--parent-pid", str(spec.parent_pid)])
    if spec.runtime_dependency_install:
        args.append("--allow-runtime-dependency-installation")
    return args


class PrestartedExecutor:
    """Flower's SuperExec executor interface; ClientApp tasks are forked from a zygote.

    Parameters
    ----------
    preload : sequence of str, default ``PRELOAD``
        Modules the zygote imports before it forks.
    fallback : Flower executor, optional
        Launches what the zygote cannot; default Flower's ``SubprocessExecutor``.

    Attributes
    ----------
    forked, cold : int
        Tasks launched from the zygote, and by the fallback.
    """

    def __init__(self, *, preload: Sequence[str] = PRELOAD, fallback: Any = None) -> None:
        from flwr.supercore.superexec.executor import SubprocessExecutor

        self.preload = tuple(preload)
        self.fallback = fallback if fallback is not None else SubprocessExecutor()
        self.forked = 0
        self.cold = 0
        self.last_launch = -math.inf  # time.monotonic() of the last launch
        self._zygote: subprocess.Popen[bytes] | None = None
        self._answers: queue.Queue[str] = queue.Queue()
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._start()

    # Flower's executor interface ------------------------------------------------------
    def get_eligible_capacity(self, supported_task_types: Any, **kwargs: Any) -> Any:
        return self.fallback.get_eligible_capacity(supported_task_types, **kwargs)

    def wait_for_capacity(self, task_type: Any = None, **kwargs: Any) -> None:
        self.fallback.wait_for_capacity(task_type, **kwargs)

    def reconcile(self) -> None:
        self.fallback.reconcile()

    def launch(self, spec: ExecutionSpec) -> LaunchResult:
        """Fork a ClientApp task from the zygote; anything else, or a zygote that is
        not ready or fails, goes to the fallback (a cold process)."""
        from flwr.supercore.superexec.executor import LaunchResult

        self.last_launch = time.monotonic()
        with self._lock:
            if str(spec.task_type) == CLIENTAPP and self._alive() and self._ready.is_set():
                request = {"argv": clientapp_args(spec), "quiet": spec.suppress_output}
                if self._ask(json.dumps(request)):
                    self.forked += 1
                    return LaunchResult.accepted()
                self._restart()
            elif not self._alive():
                self._restart()
        self.cold += 1
        return self.fallback.launch(spec)

    def close(self) -> None:
        """Stop the zygote (its running children finish their tasks)."""
        with self._lock:
            self._stop()
        self.fallback.close()

    # the zygote ------------------------------------------------------------------------
    def _start(self) -> None:
        read, write = os.pipe()
        command = [sys.executable, "-m", "fedpers.launcher", "zygote", "--status-fd", str(write)]
        command += ["--preload", ",".join(self.preload)]
        self._ready.clear()
        self._answers = queue.Queue()
        self._zygote = subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=(write,))
        os.close(write)
        threading.Thread(
            target=self._listen, args=(os.fdopen(read, "r"), self._answers), daemon=True
        ).start()

    def _listen(self, status: IO[str], answers: queue.Queue[str]) -> None:
        with status:
            for line in status:
                if line.strip() == READY:
                    self._ready.set()
                else:
                    answers.put(line.strip())
        answers.put("error zygote gone")

    def _alive(self) -> bool:
        return self._zygote is not None and self._zygote.poll() is None

    def _ask(self, request: str) -> bool:
        """Send one request; True once the zygote names the child it forked."""
        assert self._zygote is not None
        assert self._zygote.stdin is not None
        try:
            self._zygote.stdin.write(request.encode() + b"\n")
            self._zygote.stdin.flush()
            answer = self._answers.get(timeout=ACK_TIMEOUT)
        except (OSError, queue.Empty) as error:
            LOGGER.warning("fedpers launcher: the zygote did not answer (%s)", error)
            return False
        if answer.isdigit():
            return True
        LOGGER.warning("fedpers launcher: the zygote answered %r", answer)
        return False

    def _restart(self) -> None:
        """A zygote that failed once forks nothing more: stop it, start another."""
        self._stop()
        self._start()

    def _stop(self) -> None:
        if self._zygote is None:
            return
        with contextlib.suppress(OSError):
            if self._zygote.stdin is not None:
                self._zygote.stdin.close()
        try:
            self._zygote.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._zygote.kill()
            self._zygote.wait(timeout=5)
        self._zygote = None


class TaskPoll:
    """``time`` as Flower's SuperExec loop sees it (``run_superexec``, whose only call is
    ``time.sleep(task_poll_interval)`` after each ask for a task): within ``window``
    seconds of the executor's last launch the sleep is at most ``active`` seconds;
    every other call is ``time``'s own."""

    def __init__(self, executor: PrestartedExecutor, active: float, window: float) -> None:
        self.executor = executor
        self.active = active
        self.window = window

    def sleep(self, seconds: float) -> None:
        if time.monotonic() - self.executor.last_launch < self.window:
            seconds = min(seconds, self.active)
        time.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def check_task_poll_source() -> None:
    """Refuse, before any SuperExec starts, a Flower whose SuperExec loop no longer
    sleeps where ``TaskPoll`` expects: a silent no-op would claim speed it does not give.

    Raises
    ------
    RuntimeError
        If ``run_superexec`` has no ``time.sleep(task_poll_interval)``.
    """
    import inspect

    from flwr.supercore.superexec import run_superexec

    if "time.sleep(task_poll_interval)" not in inspect.getsource(run_superexec):
        import flwr

        raise RuntimeError(
            f"flwr {flwr.__version__}'s SuperExec does not poll for tasks with "
            f"time.sleep(task_poll_interval) ({run_superexec.__file__}): unset "
            f"{ACTIVE_TASK_POLL_ENV}, or install the flwr version of constraints.txt"
        )


def active_task_poll() -> float | None:
    """The active task poll from ``ACTIVE_TASK_POLL_ENV`` (None when unset or empty).

    Raises
    ------
    ValueError
        If it is set to anything but a number of seconds in [0.01, 60].
    """
    raw = os.environ.get(ACTIVE_TASK_POLL_ENV, "")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.01 <= value <= 60:  # NaN fails too
        raise ValueError(
            f"{ACTIVE_TASK_POLL_ENV}={raw!r}: give a number of seconds in [0.01, 60], or "
            "leave it unset for the task-poll interval alone"
        )
    return value


# ------------------------------------------------------------------------ entry points
def superexec(argv: Sequence[str]) -> None:
    """Flower's ``flower-superexec`` main with ``argv``, its subprocess executor replaced
    by ``PrestartedExecutor`` and, with ``ACTIVE_TASK_POLL_ENV`` set, its task poll
    by ``TaskPoll``."""
    from flwr.supercore.cli import flower_superexec
    from flwr.supercore.constant import ExecutorType
    from flwr.supercore.superexec import run_superexec

    flower_get_executor = run_superexec.get_executor
    active = active_task_poll()

    def get_executor(executor_type: Any, *args: Any, **kwargs: Any) -> Any:
        if executor_type == ExecutorType.SUBPROCESS:
            executor = PrestartedExecutor()
            if active is not None:
                run_superexec.time = TaskPoll(executor, active, ACTIVE_WINDOW)  # type: ignore[assignment]
            return executor
        return flower_get_executor(executor_type, *args, **kwargs)

    run_superexec.get_executor = get_executor
    sys.argv = ["flower-superexec", *argv]
    flower_superexec()


def main(argv: Sequence[str] | None = None) -> int:
    """``superexec ARGS...`` or ``zygote --status-fd N [--preload a,b]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["superexec"]:
        superexec(args[1:])
        return 0
    if args[:1] == ["zygote"]:
        import argparse

        parser = argparse.ArgumentParser(prog="python -m fedpers.launcher zygote")
        parser.add_argument("--status-fd", type=int, required=True)
        parser.add_argument("--preload", default=",".join(PRELOAD))
        options = parser.parse_args(args[1:])
        preload = [name for name in options.preload.split(",") if name]
        return zygote(sys.stdin.buffer, options.status_fd, preload, on_fork=prepare_child)
    print(__doc__, file=sys.stderr)  # noqa: T201
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
