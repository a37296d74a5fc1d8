"""Real multi-host deployments on one machine: network namespaces and processes.

``Hosts`` gives every member (SuperLink, SuperNodes) its own network namespace with its
own address on a bridge made for the test (``ip netns``, ``veth``); without the right
to make namespaces it falls back to loopback and says so. ``Cluster`` starts the real
``flower-superlink`` / ``flower-supernode`` processes of ``docker/entrypoint.py`` in them,
with TLS and SuperNode authentication. Everything it made (processes, namespaces, the
bridge) is removed on ``close``, also after a failure.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from fedpers.simulations.launch import flower_environment, staged_app

PROJECT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def load_script(name: str) -> ModuleType:
    """Import a script of docker/ (the folder is not a package). Its imports of the other
    scripts resolve as when it runs (``python docker/NAME.py``: docker/ first on sys.path)."""
    folder = PROJECT / "docker"
    spec = importlib.util.spec_from_file_location(f"fedpers_docker_{name}", folder / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(folder))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
    return module


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """Network namespaces on a private bridge, or loopback when they cannot be made."""

    def __init__(self, names: list[str]) -> None:
        tag = os.getpid() % 100000
        self.prefix = f"fp{tag}"
        self.subnet = f"10.213.{tag % 250}"
        self.bridge = f"{self.prefix}br"
        self.names = names
        self.namespaces: dict[str, str] = {}
        self.addresses: dict[str, str] = {}
        self.host_address = "127.0.0.1"
        self.isolated = False
        self.reason = ""
        self.forward_rule: list[str] = []
        try:
            self._create()
            self.isolated = True
        except (OSError, subprocess.CalledProcessError) as error:
            self.close()
            self.reason = getattr(error, "stderr", "") or str(error)
            self.addresses = dict.fromkeys(names, "127.0.0.1")

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self._allow_forwarding()
        self.host_address = f"{self.subnet}.1"
        for index, name in enumerate(self.names):
            namespace = f"{self.prefix}-{index}"
            outside, inside = f"{self.prefix}h{index}", f"{self.prefix}n{index}"
            _ip("netns", "add", namespace)
            self.namespaces[name] = namespace
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", namespace)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            address = f"{self.subnet}.{10 + index}"
            _ip("netns", "exec", namespace, "ip", "addr", "add", f"{address}/24", "dev", inside)
            _ip("netns", "exec", namespace, "ip", "link", "set", inside, "up")
            _ip("netns", "exec", namespace, "ip", "link", "set", "lo", "up")
            self.addresses[name] = address

    def _allow_forwarding(self) -> None:
        """Let the bridge forward between its own ports whatever the FORWARD policy is.

        A running Docker daemon sets the iptables FORWARD policy to DROP and turns on
        ``bridge-nf-call-iptables``, which filters the frames between our namespaces. One
        ACCEPT rule for this bridge alone, first in FORWARD, is removed on ``close``, so the
        firewall is left as it was found (and nothing outside the test's subnet is opened).
        """
        iptables = shutil.which("iptables")
        if iptables is None:
            return  # no iptables: no filter on bridged frames can be set either
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        subprocess.run([iptables, "-w", "5", "-I", *rule[:1], "1", *rule[1:]], check=True,
                       capture_output=True, text=True)  # fmt: skip
        self.forward_rule = [iptables, "-w", "5", "-D", *rule]

    def wrap(self, name: str, command: list[str]) -> list[str]:
        """``command`` run inside ``name``'s namespace (unchanged on loopback)."""
        if name in self.namespaces:
            return ["ip", "netns", "exec", self.namespaces[name], *command]
        return command

    def pids(self, name: str) -> list[int]:
        """Processes living in ``name``'s namespace (all started by this test)."""
        if name not in self.namespaces:
            return []
        listed = subprocess.run(
            ["ip", "netns", "pids", self.namespaces[name]], capture_output=True, text=True
        )
        return [int(p) for p in listed.stdout.split()]

    def close(self) -> None:
        """Delete the veth pairs, the namespaces and the bridge.

        Each pair is deleted from the host's side first: a namespace outlives ``ip netns
        del`` while a socket still holds it (a connection closing over a lossy link keeps
        its socket for minutes), and its veth would stay on the host with it."""
        for index, name in enumerate(self.names):
            if name in self.namespaces:
                with contextlib.suppress(subprocess.CalledProcessError):
                    _ip("link", "del", f"{self.prefix}h{index}")
        for namespace in self.namespaces.values():
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", namespace)
        self.namespaces = {}
        if self.forward_rule:
            subprocess.run(self.forward_rule, capture_output=True, check=False)
            self.forward_rule = []
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", self.bridge)


class Cluster:
    """A SuperLink and SuperNodes of docker/entrypoint.py, as processes on ``Hosts``.

    ``supernode_program``: what runs each SuperNode, Flower's ``flower-supernode`` or
    ``fedpers-supernode`` with its flags (``fedpers.supernode``)."""

    def __init__(
        self,
        work: Path,
        *,
        nodes: int,
        extra_keys: int = 1,
        supernode_program: tuple[str, ...] = ("flower-supernode",),
    ) -> None:
        self.entrypoint = load_script("entrypoint")
        self.supernode_program = supernode_program
        credentials = load_script("credentials")
        self.work = work
        self.nodes = nodes
        members = ["superlink", *[f"node{i}" for i in range(nodes + extra_keys)]]
        self.hosts = Hosts(members)
        self.port = self.entrypoint.SUPERLINK_PORT if self.hosts.isolated else _free_port()
        self.superlink_address = f"{self.hosts.addresses['superlink']}:{self.port}"
        self.credentials = credentials.make_credentials(
            work / "credentials",
            ips=[self.hosts.addresses["superlink"]],
            nodes=nodes,
            extra_nodes=extra_keys,
        )
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.node_ids: dict[int, int] = {}
        self.logs: dict[str, Path] = {}
        # What `flwr run` bundles: the app's files, without the checkout's .venv to walk.
        self.app = staged_app(PROJECT, work / "app")
        self.cli_home = work / "cli"
        self.cli_home.mkdir(parents=True, exist_ok=True)
        (self.cli_home / "config.toml").write_text(
            self.entrypoint.connection_toml(
                self.superlink_address, str(self.credentials / "operator" / "ca.crt")
            )
        )

    # ------------------------------------------------------------------ processes
    def environment(self, home: Path) -> dict[str, str]:
        """The environment of every Flower process of the test: the project's own."""
        return flower_environment(home)

    def start(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        """Start ``command`` on host ``name`` (its own session, output to a log)."""
        home = self.work / name
        home.mkdir(parents=True, exist_ok=True)
        log = self.work / f"{name}-{len([k for k in self.logs if k.startswith(name)])}.log"
        self.logs[name] = log
        command = (
            [str(BIN / command[0]), *command[1:]]
            if command[0].startswith(("flower-", "fedpers-"))
            else command
        )
        process = subprocess.Popen(
            self.hosts.wrap(name, command),
            env=self.environment(home),
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            cwd=home,
            start_new_session=True,
        )
        self.processes[name] = process
        return process

    def start_superlink(self) -> None:
        """The SuperLink, waiting until it answers over TLS."""
        host = "0.0.0.0" if self.hosts.isolated else "127.0.0.1"
        self.start(
            "superlink",
            self.entrypoint.superlink_args(
                str(self.credentials / "superlink"),
                str(self.work / "superlink" / "state.db"),
                host=host,
                port=self.port,
            ),
        )
        deadline = time.monotonic() + 60
        while not self.healthy(tls=True):
            if time.monotonic() > deadline or self.processes["superlink"].poll() is not None:
                raise RuntimeError(
                    "SuperLink did not start:\n" + self.logs["superlink"].read_text()[-3000:]
                )
            time.sleep(0.3)

    def start_supernode(self, index: int, *, key: str | None = None) -> subprocess.Popen[bytes]:
        """SuperNode ``index`` (on host ``node<index>``) with its key and state directory."""
        port = self.entrypoint.NODE_RUNTIME_PORT if self.hosts.isolated else _free_port()
        partition = index % self.nodes
        return self.start(
            f"node{index}",
            self.entrypoint.supernode_args(
                partition,
                credentials=str(self.credentials / f"node{index}"),
                superlink=self.superlink_address,
                num_nodes=self.nodes,
                state_dir=str(self.work / "device-state" / f"node{partition}"),
                port=port,
                key=key or str(self.credentials / f"node{index}" / f"node{index}"),
                program=self.supernode_program,
            ),
        )

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run the ``flwr`` CLI against this cluster (from the host namespace)."""
        return subprocess.run(
            [str(BIN / "flwr"), *args],
            env=self.environment(self.cli_home),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=PROJECT,
        )

    def start_run(
        self, config: Path, run_dir: Path, *, rounds: int, limit: float
    ) -> Callable[[], subprocess.CompletedProcess[str]]:
        """``flwr run`` of the app with the run config ``config``, in a thread; return once
        ``rounds`` rounds of ``run_dir`` are recorded (AssertionError with the run's
        failure.json if it failed first). Calling the result waits for the run's end and
        gives its outcome, which must be a success."""
        outcome: dict[str, subprocess.CompletedProcess[str]] = {}
        args = ["run", str(self.app), "fedpers", "--run-config", str(config), "--stream"]
        thread = threading.Thread(
            target=lambda: outcome.setdefault("run", self.cli(*args, timeout=limit))
        )
        thread.start()
        rounds_file, failure = run_dir / "rounds.jsonl", run_dir / "failure.json"
        wait_for(
            lambda: (
                failure.exists()
                or (rounds_file.exists() and len(rounds_file.read_text().splitlines()) >= rounds)
            ),
            limit,
        )
        assert not failure.exists(), failure.read_text()

        def finished() -> subprocess.CompletedProcess[str]:
            thread.join(timeout=limit)
            done = outcome["run"]
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            return done

        return finished

    def register(self, index: int) -> int:
        """Register node ``index``'s public key with the SuperLink; return its node id."""
        public = self.credentials / "operator" / "nodes" / f"node{index}.pub"
        args = self.entrypoint.register_args(str(public))[1:]
        result = self.cli(*args, "--format", "json")
        if result.returncode != 0:
            raise RuntimeError(f"registering node{index} failed:\n{result.stdout}\n{result.stderr}")
        found = re.search(
            r'"node-id":\s*(\d+)|SuperNode (\d+) registered', result.stdout + result.stderr
        )
        if found is None:
            raise RuntimeError(f"no node id in the registration output:\n{result.stdout}")
        self.node_ids[index] = int(found.group(1) or found.group(2))
        return self.node_ids[index]

    def replace_identity(self, index: int, key_index: int) -> int:
        """Unregister node ``index`` and register the spare key ``node<key_index>`` for it.

        Flower 1.42 keeps a SIGKILLed SuperNode ONLINE until it misses two 30 s
        heartbeats and refuses to activate the same key before then (exit code 305);
        an unregistered key cannot be registered again. A crashed device therefore
        rejoins at once only under a new key (a new node id), which the strategy maps
        back to the device's partition.
        """
        result = self.cli(
            "supernode", "unregister", str(self.node_ids[index]), self.entrypoint.CONNECTION
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"unregistering node{index} failed:\n{result.stdout}\n{result.stderr}"
            )
        node_id = self.register(key_index)
        self.node_ids[index] = node_id
        return node_id

    def healthy(self, *, tls: bool) -> bool:
        """Does the SuperLink answer ``/health`` (over TLS with the CA, or plaintext)?"""
        import ssl

        scheme = "https" if tls else "http"
        context = (
            ssl.create_default_context(cafile=str(self.credentials / "operator" / "ca.crt"))
            if tls
            else None
        )
        try:
            url = f"{scheme}://{self.superlink_address}/health"
            with urllib.request.urlopen(url, timeout=2, context=context) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def kill(self, name: str) -> None:
        """SIGKILL a member (the process group it leads and what lives in its namespace)."""
        process = self.processes[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        for pid in self.hosts.pids(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait(timeout=10)

    def close(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL) and remove the namespaces."""
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        for name, process in self.processes.items():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            for pid in self.hosts.pids(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        self.hosts.close()


def wait_for(condition: Callable[[], object], timeout: float, step: float = 0.2) -> None:
    """Poll ``condition`` until it is true; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met in {timeout} s")
        time.sleep(step)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_run_config(path: Path, values: dict[str, object]) -> Path:
    """A ``--run-config`` TOML file of ``values`` (strings quoted, booleans lower-case)."""

    def toml(value: object) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        return f'"{value}"' if isinstance(value, str) else repr(value)

    path.write_text("".join(f"{k} = {toml(v)}\n" for k, v in values.items()))
    return path


def record_figure(key: str, value: object) -> None:
    """Add a figure to the summary ``make deploy-test`` writes (the JSON file that
    ``FEDPERS_DEPLOY_SUMMARY`` names; nothing when it is unset)."""
    target = os.environ.get("FEDPERS_DEPLOY_SUMMARY", "")
    if not target:
        return
    path = Path(target)
    found = json.loads(path.read_text()) if path.exists() else {}
    found[key] = value
    path.write_text(json.dumps(found, indent=2))


def same_rounds(
    ours: list[Any], theirs: list[Any], *, nodes: int | None = None, rtol: float = 1e-9
) -> None:
    """Two runs' rounds, pairwise: the same round numbers and the same metrics to
    ``rtol``; with ``nodes``, every node answered each of them in both."""
    for mine, other in zip(ours, theirs, strict=True):
        assert mine.round == other.round
        if nodes is not None:
            assert mine.replies == other.replies == nodes
        for section in ("train", "evaluate"):
            a, b = getattr(mine, section), getattr(other, section)
            assert set(a) == set(b)
            for key in a:
                np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=1e-12)


def newest_snapshot(folder: Path, run_name: str, partition: int) -> tuple[int, list[str]]:
    """The ``rounds-trained`` count and the array names of a device's newest snapshot of
    ``run_name`` (clients/device_state.py writes one per round trained)."""
    states = sorted(
        folder.glob(f"{run_name}-*-partition-{partition}-round-*.npz"),
        key=lambda p: int(p.stem.rsplit("-", 1)[1]),
    )
    assert states, f"no snapshot of {run_name} partition {partition} in {folder}"
    with np.load(states[-1]) as stored:
        configs = str(stored["__configs__"])
        names = list(stored.files)
    found = re.search(r'"rounds-trained": (\d+)', configs)
    assert found is not None, configs
    return int(found.group(1)), names
