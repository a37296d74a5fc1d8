"""Run fedpers through the real Flower stack: a local SuperLink + `flwr run`.

``LocalSimulation`` starts its own ``flower-superlink --simulation`` (so it knows the
PID), points a private ``FLWR_HOME`` at it, runs ``flwr run . --stream`` once per
experiment, and on exit stops the SuperLink and every process it started, by PID and
process group. Every run has the environment this machine needs: no runtime
dependency installation (Flower would otherwise ``uv sync`` torch from PyPI),
telemetry and update checks off, its own ``FLWR_HOME`` and ``RAY_TMPDIR`` in the work
folder (``work_directory``: the checkout, or from a wheel ``~/.cache/fedpers``; never the
install folder). The run config is validated before Flower or Ray start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

from fedpers import privacy
from fedpers.atomic import write_text
from fedpers.config import RunConfig, load_run_config
from fedpers.logs import strip_ansi
from fedpers.results import (
    FAILURE_FILE,
    SUMMARY_FILE,
    ResultsExistError,
    read_summary,
    run_directory,
)

PROJECT = Path(__file__).resolve().parent.parent
# In a checkout PROJECT holds the project's pyproject.toml (the Flower app); installed
# from a wheel it is site-packages/fedpers, where nothing is read or written.
CHECKOUT = (PROJECT / "pyproject.toml").is_file()
BIN = Path(sys.executable).parent
WORK_ENV = "FEDPERS_WORK_DIR"  # where the Flower and Ray state of local runs goes
logger = logging.getLogger(__name__)

# The progress lines of fedpers.results.RunRecorder, as they come out of `flwr run`.
PROGRESS = re.compile(r"\| (round \d+/\d+|start-up) \|")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


STOP_RECORD_WAIT = 5.0  # seconds a run's files may lag behind its log stream's end


class FlowerRunError(RuntimeError):
    """A Flower run ended without writing its summary."""


def work_directory() -> Path:
    """Where local runs keep Flower's and Ray's state (``.flwr/``, ``.ray/``) and, from a
    wheel, the generated app: ``$FEDPERS_WORK_DIR`` if set, else the checkout, else
    ``~/.cache/fedpers`` (``$XDG_CACHE_HOME/fedpers``). Never the install folder."""
    if given := os.environ.get(WORK_ENV):
        return Path(given).expanduser().resolve()
    if CHECKOUT:
        return PROJECT
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "fedpers"


# Ray's sockets live at RAY_TMPDIR/ray/session_<date>_<time>_<pid>/sockets/plasma_store, 66
# characters below RAY_TMPDIR, and a Unix socket path has at most 107 bytes.
RAY_TMPDIR_MAX = 40


def ray_directory(work: Path, owner: str | None = None) -> Path:
    """Ray's temporary folder of local runs: ``work/.ray``, or, where that path is too
    long for Ray's sockets, a folder of this user in the system's temporary folder;
    with ``owner``, that folder's subfolder of one simulation (the Ray it starts keeps
    its session there, and the simulation removes it when it ends)."""
    folder = work / ".ray"
    if owner is not None:
        folder = folder / owner
    if len(str(folder)) > RAY_TMPDIR_MAX:
        folder = Path(tempfile.gettempdir()) / f"fedpers-ray-{os.getuid()}"
        if owner is not None:
            folder = folder / owner
    return folder


def remove_ray_directory(folder: Path) -> None:
    """Remove a simulation's own Ray folder (``ray_directory(work, owner)``) once its
    Ray has stopped: Ray leaves every session's folder (logs, sockets, spilled objects)
    behind, a few MB each, and nothing reads them after the run."""
    shutil.rmtree(folder, ignore_errors=True)


_APP_HEADER = """# The Flower app of an installed fedpers, written by fedpers.simulations.launch:
# its code is the installed package; this file names the apps and every run-config key.
[project]
name = "fedpers-app"
version = "{version}"

[tool.flwr.app]
publisher = "fedpers"

[tool.flwr.app.components]
serverapp = "fedpers.strategies.server_app:app"
clientapp = "fedpers.clients.client_app:app"

"""


def staged_app(project: Path, into: Path) -> Path:
    """A copy of the Flower app of the checkout ``project`` in ``into``: its
    pyproject.toml, its .gitignore and the files its ``[tool.flwr.app] fab-include``
    patterns name (Flower's default patterns without the key), found without entering
    the folders that Flower or the .gitignore leave out (.venv, .flwr, caches). Flower
    applies its own rules to the copy as it would to the checkout, so the app bundle
    (FAB) that ``flwr run`` builds from it is the same, byte for byte
    (tests/simulations/test_launch.py builds both with Flower's builder).

    Why: ``flwr run`` walks every file below the app's folder before it keeps the
    included ones; in a checkout with its .venv that is 55,000 files and 11-20 s of
    processor time for every run (``flwr build``: 12.9 s here, 2.5 s from this copy).
    """
    import tomllib

    from flwr.cli.utils import build_pathspec  # Flower's own matching
    from flwr.common.constant import FAB_INCLUDE_KEY, FAB_INCLUDE_PATTERNS
    from flwr.supercore.constant import APP_PUBLISH_EXCLUDE_PATTERNS

    pyproject = project / "pyproject.toml"
    app = tomllib.loads(pyproject.read_text()).get("tool", {}).get("flwr", {}).get("app", {})
    include = build_pathspec(app.get(FAB_INCLUDE_KEY, FAB_INCLUDE_PATTERNS))
    ignore = (project / ".gitignore").read_text() if (project / ".gitignore").is_file() else ""
    skip = build_pathspec([*APP_PUBLISH_EXCLUDE_PATTERNS, *ignore.splitlines()])
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    for name in ("pyproject.toml", ".gitignore"):
        if (project / name).is_file():
            shutil.copy2(project / name, into / name)
    for folder, folders, files in os.walk(project):
        here = Path(folder).relative_to(project)
        folders[:] = [d for d in folders if not skip.match_file(f"{(here / d).as_posix()}/")]
        for name in files:
            relative = (here / name).as_posix()
            source = project / relative
            if include.match_file(relative) and not source.is_symlink():
                (into / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, into / relative)
    return into


def app_directory(work: Path, stage: Path | None = None) -> Path:
    """The Flower app that ``flwr run`` builds: in a checkout its app files, staged in
    ``stage`` (``staged_app``; the checkout itself without one), or, installed from a
    wheel, ``work/app`` with a generated pyproject.toml (every run-config key of the
    schema, installed extensions included) and no code of its own."""
    if CHECKOUT:
        return PROJECT if stage is None else staged_app(PROJECT, stage)
    from importlib.metadata import version

    from fedpers.config import pyproject_table

    app = work / "app"
    app.mkdir(parents=True, exist_ok=True)
    text = _APP_HEADER.format(version=version("fedpers")) + pyproject_table()
    pyproject = app / "pyproject.toml"
    if not pyproject.is_file() or pyproject.read_text() != text:
        write_text(pyproject, text)
    return app


def flower_environment(
    home: Path, work: Path | None = None, ray_tmp: Path | None = None
) -> dict[str, str]:
    """The environment every Flower process of this project runs with; ``ray_tmp``:
    the Ray folder of its simulation (default: the work folder's, shared)."""
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(home),
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        RAY_TMPDIR=str(ray_tmp or ray_directory(work or work_directory())),
        # A single-machine Ray instance on loopback: on Linux Ray otherwise announces
        # its nodes at the host's outward address (simulations.ray_cluster sets 1).
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_DEDUP_LOGS="0",
        PYTHONUNBUFFERED="1",
        MPLBACKEND="Agg",
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    return env


def done_line(name: str, directory: Path) -> str:
    """``name | done | results in DIR | start-up S s, rounds R s``: a finished run's last
    line, from its summary (the start-up apart from the rounds)."""
    summary = read_summary(directory)
    wall, startup = summary.get("wall_seconds"), summary.get("startup_seconds")
    timing = (
        f"start-up {startup:.1f} s, rounds {wall - startup:.1f} s"
        if isinstance(wall, int | float) and isinstance(startup, int | float)
        else "no timing"
    )
    return f"{name} | done | results in {directory} | {timing}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LocalSimulation:
    """A local simulation SuperLink owned by this process, and runs submitted to it.

    Use as a context manager; the SuperLink and its process group are stopped on exit,
    also after an error.

    Parameters
    ----------
    echo : callable, optional
        Receives each progress line of a run (default: print to stdout).
    keep_home : bool (default: False)
        Keep the private FLWR_HOME (installed app copies, SuperLink log) after exit.
    environment : mapping, optional
        More environment variables for the SuperLink (and so for its SuperExec and the
        simulation process), e.g. ``RAY_ADDRESS`` of a Ray cluster to run on
        (``simulations.ray_cluster``).
    cpus_per_client : int (default: 1)
        Ray CPUs per ClientApp actor of a run that names none: with 1, one actor per
        core; with the machine's cores, one actor in all (each actor imports torch,
        about 10 s of processor time a run).
    """

    def __init__(
        self,
        *,
        echo: Callable[[str], None] | None = None,
        keep_home: bool = False,
        environment: Mapping[str, str] | None = None,
        cpus_per_client: int = 1,
    ) -> None:
        self.echo = echo or (lambda line: print(line, flush=True))
        self.cpus_per_client = cpus_per_client
        self.keep_home = keep_home
        self.environment = dict(environment or {})
        self.work = work_directory()
        self.app = PROJECT if CHECKOUT else self.work / "app"
        owner = uuid.uuid4().hex[:6]
        self.home = self.work / ".flwr" / f"sim-{os.getpid()}-{owner}"
        # The Ray this simulation starts keeps its session in a folder of its own, removed
        # when it stops; a given RAY_ADDRESS (a cluster's, a test's head) keeps its own.
        self.ray_tmp: Path | None = (
            None
            if "RAY_ADDRESS" in self.environment or os.environ.get("RAY_ADDRESS")
            else ray_directory(self.work, owner)
        )
        self.process: subprocess.Popen[bytes] | None = None
        self.streams: set[subprocess.Popen[str]] = set()  # running `flwr run --stream`
        self.logs: dict[Path, Path] = {}  # each started run's directory: its Flower log
        self.port = 0
        self._log: TextIO | None = None
        self._previous_sigterm: Any = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> LocalSimulation:
        self._stop_on_sigterm()
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # Interrupted (Ctrl-C): the runs stop now, not after a graceful 15 s in which
        # they would go on training rounds.
        interrupted = isinstance(exc[1], KeyboardInterrupt)
        self.stop(grace=2.0 if interrupted else 15.0)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def _stop_on_sigterm(self) -> None:
        """In the main thread, make SIGTERM stop this simulation before the process
        exits (status 143): a script killed by ``kill`` or a job scheduler left its
        SuperLink, SuperExec, simulation and Ray processes running, orphaned. The
        handler stops them by PID first, since the script's threads still wait on their
        runs; ``__exit__`` restores the previous handler."""
        if threading.current_thread() is not threading.main_thread():
            return

        def stop_then_exit(signum: int, frame: object) -> None:
            self.stop(grace=2.0)
            raise SystemExit(128 + signum)

        self._previous_sigterm = signal.signal(signal.SIGTERM, stop_then_exit)

    def start(self, timeout: float = 60.0) -> None:
        """Start the SuperLink and wait until its HTTP API answers."""
        self.home.mkdir(parents=True, exist_ok=True)
        (self.ray_tmp or ray_directory(self.work)).mkdir(parents=True, exist_ok=True)
        self.app = app_directory(self.work, stage=self.home / "app")
        self.port = free_port()
        (self.home / "config.toml").write_text(
            '[superlink]\ndefault = "fedpers"\n\n[superlink.fedpers]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        self._log = (self.home / "superlink.log").open("w")
        self.echo("starting a local Flower SuperLink for the runs")
        begun = time.monotonic()
        command = [
            str(BIN / "flower-superlink"),
            "--insecure",
            "--simulation",
            "--isolation",
            "subprocess",
            "--disable-runtime-dependency-installation",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--control-api-address",
            f"127.0.0.1:{free_port()}",
            "--database",
            str(self.home / "state.db"),
        ]
        self.process = subprocess.Popen(
            command,
            env={**flower_environment(self.home, self.work, self.ray_tmp), **self.environment},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.work,
            start_new_session=True,  # its own process group: stopped as a whole
        )
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.home / "superlink.log").read_text()[-3000:]
                self.stop()
                raise FlowerRunError(f"flower-superlink did not start:\n{log}")
            time.sleep(0.2)
        self.echo(f"SuperLink ready on 127.0.0.1:{self.port} ({time.monotonic() - begun:.1f} s)")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=0.5) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def kill_server(self) -> list[int]:
        """SIGKILL the running ServerApp (in simulation: the ``flwr-simulation`` process,
        which also runs the virtual nodes) and what it started; end the log streams.

        For fault-tolerance tests: the run is gone without a chance to clean up.
        """
        victims = [p for p in processes_with_home(self.home) if "flwr-simulation" in _cmdline(p)]
        # Its Ray processes (some drop FLWR_HOME from their environment) are its
        # descendants: collect them before the parents die and they are re-parented.
        doomed = [d for victim in victims for d in descendants(victim)]
        for pid in victims + doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for stream in list(self.streams):
            stream.terminate()
        return victims

    def stop(self, grace: float = 15.0) -> None:
        """Stop the SuperLink and everything in its process group, by PID, then any
        process still running with this simulation's FLWR_HOME (all started here)."""
        if self.process is not None:
            # The SuperLink leads its own session and process group.
            stop_process_group(self.process.pid, grace=grace, reap=self.process.poll)
            self.process = None
        left = kill_processes_with_home(self.home)
        if left:
            logger.warning(
                "processes %s with FLWR_HOME=%s outlived 15 s of SIGKILL", left, self.home
            )
        if self._log is not None:
            self._log.close()
            self._log = None
        self._keep_logs()
        if not self.keep_home:
            shutil.rmtree(self.home, ignore_errors=True)
            if self.ray_tmp is not None and not left:
                remove_ray_directory(self.ray_tmp)

    def _stream(self, command: list[str], log_path: Path) -> int:
        """Run ``flwr run --stream``: every line to the run's log, its progress lines to
        ``echo``; its exit status."""
        with log_path.open("w") as log:
            process = subprocess.Popen(
                command,
                env=flower_environment(self.home, self.work, self.ray_tmp),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=self.work,
            )
            self.streams.add(process)
            assert process.stdout is not None
            for line in process.stdout:
                log.write(strip_ansi(line))  # files hold no terminal codes
                if PROGRESS.search(line):
                    self.echo(_strip_log_prefix(line))
            code = process.wait()
            self.streams.discard(process)
        return code

    def _keep_logs(self) -> None:
        """Copy the Flower log of every started run that has none in its directory (a
        run stopped before its end: interrupted, failed) there, before the private
        FLWR_HOME goes."""
        for directory, log in self.logs.items():
            if directory.is_dir() and log.is_file() and not (directory / "flower.log").exists():
                with contextlib.suppress(OSError):
                    shutil.copy(log, directory / "flower.log")

    # ----------------------------------------------------------------------- runs
    def run(
        self,
        overrides: Mapping[str, Any],
        *,
        num_supernodes: int | None = None,
        cpus_per_client: int | None = None,
        gpus_per_client: float = 0.0,
    ) -> Path:
        """Run one experiment; return its results directory.

        Parameters
        ----------
        overrides : Mapping
            Run-config keys to change from the defaults of pyproject.toml.
        num_supernodes : int, optional
            Virtual nodes; defaults to the run's ``num-clients``.
        cpus_per_client, gpus_per_client : int, float
            Ray resources per ClientApp (whole CPUs; GPUs may be fractional); the
            simulation's ``cpus_per_client`` (1) by default.
        """
        if self.process is None:
            raise RuntimeError("LocalSimulation.run called outside `with LocalSimulation()`")
        config = resolved_config(overrides)
        directory = run_directory(config.results_dir, config.run_name)
        if (directory / SUMMARY_FILE).exists() and not config.resume:
            raise ResultsExistError(f"{directory} already holds results; remove it first")
        run_config_file = self.home / f"run-{config.run_name}.toml"
        run_config_file.write_text(to_toml(config.to_mapping()))
        nodes = num_supernodes or config.num_clients
        federation = (
            f"num-supernodes={nodes} "
            f"client-resources-num-cpus={cpus_per_client or self.cpus_per_client} "
            f"client-resources-num-gpus={gpus_per_client}"
        )
        command = [
            str(BIN / "flwr"),
            "run",
            str(self.app),
            "fedpers",
            "--run-config",
            str(run_config_file),
            "--federation-config",
            federation,
            "--stream",
        ]
        log_path = self.home / f"run-{config.run_name}.log"
        self.logs[directory] = log_path
        self.echo(
            f"{config.run_name} | start-up | flwr run: the simulation starts Ray and "
            f"{nodes} virtual nodes"
        )
        code = self._stream(command, log_path)
        # A run stopped by Flower (`flwr stop`) ends the stream at once; its ServerApp
        # records the stop a moment later (strategies/stopping.py).
        deadline = time.monotonic() + STOP_RECORD_WAIT
        while not (directory / SUMMARY_FILE).exists() and not (directory / FAILURE_FILE).exists():
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if (directory / SUMMARY_FILE).exists():
            shutil.copy(log_path, directory / "flower.log")
            self.echo(done_line(config.run_name, directory))
            return directory
        raise self._failed(config.run_name, directory, log_path, code)

    def _failed(self, name: str, directory: Path, log_path: Path, code: int) -> FlowerRunError:
        """The error of a run that wrote no summary: the reason its ``failure.json``
        gives and the end of its log, or, where the ServerApp wrote neither (killed, or
        Flower ended the run around it), the end of the SuperLink's log, which holds
        Flower's side of the story and the simulation process's output."""
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
        failure = directory / FAILURE_FILE
        if failure.exists():
            reason = json.loads(failure.read_text())["reason"]
        else:
            superlink = self.home / "superlink.log"
            lines = superlink.read_text(errors="replace").splitlines(keepends=True)
            tail += f"\n--- {superlink} (last 30 lines) ---\n" + "".join(lines[-30:])
            reason = "no summary"
        return FlowerRunError(f"run '{name}' failed: {reason} (flwr exit {code}):\n{tail}")

    def run_all(
        self, runs: Sequence[Mapping[str, Any]], *, parallel: int = 1, **kwargs: Any
    ) -> list[Path]:
        """Run several experiments, ``parallel`` of them at a time; directories in order.

        Every run config is validated before the first run starts. Concurrent runs
        share the CPUs, so their wall times are not comparable with sequential ones:
        time measurements use ``parallel=1``.
        """
        for overrides in runs:
            resolved_config(overrides)
        if parallel <= 1:
            return [self.run(overrides, **kwargs) for overrides in runs]
        pool = ThreadPoolExecutor(max_workers=parallel)
        try:
            return list(pool.map(lambda overrides: self.run(overrides, **kwargs), runs))
        except BaseException:
            # Interrupted (or a run failed): stop the runs' processes now, so that the
            # threads waiting on them return, instead of waiting for every run to end.
            self.stop(grace=2.0)
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def resolved_config(overrides: Mapping[str, Any]) -> RunConfig:
    """Validated run config with an absolute results-dir and a run-name.

    Its private mechanism is built here too (``privacy.run_mechanism``): a
    ``dp-target-epsilon`` that no noise multiplier reaches is refused before Flower or
    Ray start, not at the ServerApp's start (the calibration is a function of the
    configuration alone: its clients, fraction, sampling and rounds).
    """
    values = dict(overrides)
    values["results-dir"] = str(Path(values.get("results-dir", "results")).expanduser().resolve())
    config = load_run_config(values)
    if not config.run_name:
        config = load_run_config({**values, "run-name": f"{config.algorithm}-{config.dataset}"})
    if config.data_root:
        config = load_run_config(
            {
                **values,
                "run-name": config.run_name,
                "data-root": str(Path(config.data_root).resolve()),
            }
        )
    privacy.run_mechanism(config)
    config.check_client_state()
    return config


def to_toml(values: Mapping[str, Any]) -> str:
    """Flat TOML of scalar values (str, bool, int, finite float)."""
    lines = []
    for key, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = repr(value)
        else:
            text = json.dumps(str(value))
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def stop_process_group(
    group: int, *, grace: float = 15.0, reap: Callable[[], object] | None = None
) -> None:
    """SIGTERM the process group ``group``; SIGKILL what is left after ``grace`` s.

    ``reap`` (the leader's ``Popen.poll``) collects the leader once it exits, so that a
    zombie does not keep the group looking alive.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _group_alive(group):
        if reap is not None:
            reap()
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)


def kill_processes_with_home(home: Path, within: float = 15.0) -> list[int]:
    """SIGKILL every process with ``FLWR_HOME=home`` until two scans half a second apart
    find none, then every process group they led or joined (not this process's); the
    PIDs still found after ``within`` s (none, normally).

    One empty scan is not enough: a process SIGKILLed a moment ago may not have exited
    yet, and a dying Ray may still start one (seen once on a loaded machine). Ray's
    dashboard and runtime-env agents, which its raylet starts, carry no FLWR_HOME; they
    leave once they see the raylet gone, which once took seconds after a stopped script
    had exited on a loaded machine. They share a process group with the Ray processes
    killed here.
    """
    deadline = time.monotonic() + within
    groups: set[int] = set()
    empty = 0
    while time.monotonic() < deadline:
        left = processes_with_home(home)
        empty = 0 if left else empty + 1
        if empty == 2:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(pid))
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1 if left else 0.5)
    for group in groups - {0, 1, os.getpgrp()}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    return processes_with_home(home)


def processes_with_home(home: Path) -> list[int]:
    """PIDs of live processes whose environment has ``FLWR_HOME=home``: the SuperLink,
    SuperExec, simulation and Ray processes started for this simulation inherit it."""
    return processes_with_env("FLWR_HOME", str(home))


def processes_with_env(name: str, value: str, *more: tuple[str, str]) -> list[int]:
    """PIDs of live processes (not this one) whose environment has ``name=value``, or
    any other of the ``(name, value)`` pairs in ``more``: one pass over /proc."""
    markers = {f"{n}={v}".encode() for n, v in ((name, value), *more)}
    found = []
    for pid, state, _ in _processes():
        if pid == os.getpid() or state == "Z":
            continue
        try:
            environ = (Path("/proc") / str(pid) / "environ").read_bytes()
        except OSError:
            continue
        if not markers.isdisjoint(environ.split(b"\0")):
            found.append(pid)
    return found


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` in the process tree."""
    children: dict[int, list[int]] = {}
    for child, _, parent in _processes():
        children.setdefault(parent, []).append(child)
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found


def _processes() -> list[tuple[int, str, int]]:
    """(pid, state, parent pid) of every process in /proc (fields after the name in
    ``/proc/PID/stat``, whose name may hold spaces and parentheses)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            found.append((int(entry.name), fields[0], int(fields[1])))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _strip_log_prefix(line: str) -> str:
    line = ANSI.sub("", line).rstrip()
    return line.split("INFO :", 1)[-1].strip() if "INFO :" in line else line
