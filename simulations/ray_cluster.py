"""A real two-node Ray cluster on this machine, for simulations past one process.

    with RayCluster(cpus_per_node=1) as cluster:
        with LocalSimulation(environment=cluster.driver_environment()) as sim:
            sim.run({...})
        print(cluster.client_actor_nodes())

The head node runs here, on this host's side of a veth pair on a private /24 that the
cluster creates (``10.215.X.1``); the worker node runs in a network namespace of its
own at the other end (``10.215.X.2``). Each is its own ``ray start``
(``--head``, then ``--address HEAD``), with its own GCS/raylet processes, CPUs and temp
directory. Flower's simulation process, started here, joins the cluster through
``RAY_ADDRESS`` in its environment (the SuperLink's, which its SuperExec and
``flwr-simulation`` inherit): ``ray.init()`` connects and places one ClientApp actor per
``client-resources-num-cpus`` CPUs of the cluster, on both nodes. On real machines the
same holds with the head's address; the app directory and the data root must then exist
on every node.

Why a namespace and not two nodes on loopback: Ray (2.55, Linux) rewrites a loopback
address given to ``ray start --address`` into the host's outward address, so a
"loopback" cluster would talk over the machine's own network interface. In the
namespace every Ray connection stays on the veth pair, which is a point-to-point link
(no bridge, so neither the FORWARD chain nor a Docker daemon's firewall rules apply).
The driver (``flwr-simulation``) runs beside the head: Ray attaches a driver to a raylet
it finds in the process list, the head's first, and announces the driver at that
node's address, which the other node must reach.

Every process the cluster starts carries ``FEDPERS_RAY_CLUSTER=<id>`` or the node's own
``RAY_TMPDIR`` in its environment; ``stop()`` ends those, and only those, by PID
(``ray stop`` would end every Ray process on the machine), then deletes the veth pair
and the namespace. Each node has
its own ``RAY_TMPDIR``, so the ``ray_current_cluster`` file that ``ray start`` writes is
never seen by other simulations (``ray.init()`` without an address would join it).

``RayHead`` is the one-node form, on loopback, for many runs in a row: each `flwr run`
otherwise starts a Ray instance of its own and stops it at the end, about 7 s of a
17-s small run here (a 10-client, 1-round FedRep run on 2 cores: 24.0-24.4 s alone,
17.1-17.4 s on a running head). The test suite's session SuperLink runs on one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable

from fedpers.simulations.launch import (
    BIN,
    PROJECT,
    flower_environment,
    free_port,
    processes_with_env,
)

MARKER = "FEDPERS_RAY_CLUSTER"
# Ray refuses worker nodes when this is 0, which simulations.launch sets for the
# single-machine instances it starts (they then stay on loopback).
_MULTI_NODE = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}

_NODES_SCRIPT = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
alive = [n for n in ray.nodes() if n["Alive"]]
actors = [
    {"class": a["ActorClassName"], "node": a["Address"]["NodeID"], "state": a["State"]}
    for a in ray._private.state.actors().values()
]
print(json.dumps({"nodes": [n["NodeID"] for n in alive], "actors": actors}))
"""


class RayClusterError(RuntimeError):
    """The cluster did not come up."""


class RayCluster:
    """A head node (this host) and a worker node (own namespace); a context manager.

    Parameters
    ----------
    cpus_per_node : int
        CPUs each node offers to actors.
    """

    def __init__(self, *, cpus_per_node: int = 1) -> None:
        if cpus_per_node < 1:
            raise ValueError(f"cpus_per_node must be >= 1, got {cpus_per_node}")
        self.cpus_per_node = cpus_per_node
        self.id = uuid.uuid4().hex[:6]
        tag = os.getpid() % 100000
        self.namespace = f"fpr{tag}"
        self.host_link, self.worker_link = f"fpr{tag}h", f"fpr{tag}n"
        subnet = f"10.215.{tag % 250}"
        self.head_ip, self.worker_ip = f"{subnet}.1", f"{subnet}.2"  # here, in the namespace
        self.port = 6379
        self.home = PROJECT / ".flwr" / f"ray-{self.id}"
        # short: Ray's socket paths under it must stay below 107 characters
        self.tmp = {role: PROJECT / ".ray" / f"{self.id}{role[0]}" for role in ("head", "worker")}
        self._made: list[list[str]] = []  # `ip` commands that undo what was made

    @property
    def address(self) -> str:
        """The head's GCS address, what ``RAY_ADDRESS`` takes."""
        return f"{self.head_ip}:{self.port}"

    def driver_environment(self) -> dict[str, str]:
        """What a process on this host needs to run its Ray driver on the cluster."""
        return {
            "RAY_ADDRESS": self.address,
            "RAY_TMPDIR": str(self.tmp["head"]),
            **_MULTI_NODE,
        }

    def __enter__(self) -> RayCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _environment(self, role: str) -> dict[str, str]:
        env = flower_environment(self.home)
        env.update({MARKER: self.id, "RAY_TMPDIR": str(self.tmp[role]), **_MULTI_NODE})
        env.pop("RAY_ADDRESS", None)
        return env

    def _network(self) -> None:
        ns = ["ip", "netns", "exec", self.namespace, "ip"]
        steps = [
            (["ip", "netns", "add", self.namespace], ["ip", "netns", "del", self.namespace]),
            (
                [
                    "ip",
                    "link",
                    "add",
                    self.host_link,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    self.worker_link,
                ],
                ["ip", "link", "del", self.host_link],
            ),
            (["ip", "link", "set", self.worker_link, "netns", self.namespace], None),
            (["ip", "addr", "add", f"{self.head_ip}/24", "dev", self.host_link], None),
            (["ip", "link", "set", self.host_link, "up"], None),
            ([*ns, "addr", "add", f"{self.worker_ip}/24", "dev", self.worker_link], None),
            ([*ns, "link", "set", self.worker_link, "up"], None),
            ([*ns, "link", "set", "lo", "up"], None),
        ]
        for command, undo in steps:
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RayClusterError(
                    f"`{' '.join(command)}` failed: {done.stderr.strip()}. The two-node Ray "
                    "cluster needs the right to make network namespaces (root, or "
                    "CAP_NET_ADMIN)."
                )
            if undo:
                self._made.insert(0, undo)

    def start(self, timeout: float = 120.0) -> None:
        """Make the namespace, start the head here and the worker in it; return when
        both nodes are alive."""
        self.home.mkdir(parents=True, exist_ok=True)
        for directory in self.tmp.values():
            directory.mkdir(parents=True, exist_ok=True)
        resources = ["--num-cpus", str(self.cpus_per_node), "--num-gpus", "0"]
        head = [
            str(BIN / "ray"), "start", "--head",
            "--node-ip-address", self.head_ip, "--port", str(self.port),
            "--include-dashboard", "false", "--disable-usage-stats", *resources,
        ]  # fmt: skip
        worker = [
            "ip", "netns", "exec", self.namespace,
            str(BIN / "ray"), "start", "--address", self.address,
            "--node-ip-address", self.worker_ip, "--disable-usage-stats", *resources,
        ]  # fmt: skip
        try:
            self._network()
            for role, command in (("head", head), ("worker", worker)):
                log = self.home / f"ray-start-{role}.log"
                with log.open("w") as out:
                    code = subprocess.call(
                        command,
                        env=self._environment(role),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        cwd=PROJECT,
                        timeout=timeout,
                    )
                if code != 0:
                    raise RayClusterError(
                        f"`ray start` of the {role} exited {code}:\n{log.read_text()[-2000:]}"
                    )
            deadline = time.monotonic() + timeout
            while len(self.state()["nodes"]) < 2:
                if time.monotonic() > deadline:
                    raise RayClusterError(f"fewer than 2 Ray nodes alive after {timeout} s")
                time.sleep(1.0)
        except BaseException:
            self.stop()
            raise

    def state(self) -> dict[str, list]:
        """The alive nodes' ids and every actor (class, node id, state), from Ray's GCS."""
        out = subprocess.run(
            [str(BIN / "python"), "-c", _NODES_SCRIPT, self.address],
            env={**self._environment("head"), **self.driver_environment()},
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
            cwd=PROJECT,
        ).stdout
        return dict(json.loads(out.strip().splitlines()[-1]))

    def client_actor_nodes(self) -> dict[str, int]:
        """How many ClientApp actors each node hosted (alive or ended), by node id."""
        counts: dict[str, int] = {}
        for actor in self.state()["actors"]:
            if actor["class"] == "ClientAppActor":
                counts[actor["node"]] = counts.get(actor["node"], 0) + 1
        return counts

    def pids(self) -> list[int]:
        """Every live process this cluster started: those with its marker, and those
        with one of its temp directories or its FLWR_HOME (Ray starts its dashboard and
        runtime-env agents without the marker, some with ``RAY_TMPDIR``, some, seen
        after a CI run, with only the ``FLWR_HOME`` of this cluster)."""
        tmp = [("RAY_TMPDIR", str(directory)) for directory in self.tmp.values()]
        return processes_with_env(MARKER, self.id, ("FLWR_HOME", str(self.home)), *tmp)

    def stop(self, grace: float = 10.0) -> None:
        """End every process of this cluster by PID (SIGTERM, then SIGKILL after
        ``grace``), then remove the veth pair, the namespace and the temp directories."""
        leftover = _end(self.pids, grace)
        for undo in self._made:
            subprocess.run(undo, capture_output=True, check=False)
        self._made = []
        for directory in (self.home, *self.tmp.values()):
            shutil.rmtree(directory, ignore_errors=True)
        if leftover:
            raise RayClusterError(f"Ray processes {leftover} outlived SIGKILL")


# The raylet starts an idle Python worker per CPU for every job that connects; Flower's
# ClientApp actors start workers of their own, so each run paid for two that did nothing.
_NO_PRESTART = {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}


class RayHead:
    """One Ray head node on loopback that many simulations join; a context manager.

        with RayHead(cpus=2) as head, LocalSimulation(environment=head.driver_environment()):
            ...

    Parameters
    ----------
    cpus : int
        CPUs the node offers to ClientApp actors.
    """

    def __init__(self, *, cpus: int) -> None:
        if cpus < 1:
            raise ValueError(f"cpus must be >= 1, got {cpus}")
        self.cpus = cpus
        self.id = uuid.uuid4().hex[:6]
        self.port = 0
        self.home = PROJECT / ".flwr" / f"ray-{self.id}"
        self.tmp = PROJECT / ".ray" / f"{self.id}h"  # short: Ray's socket paths

    @property
    def address(self) -> str:
        """The head's GCS address, what ``RAY_ADDRESS`` takes."""
        return f"127.0.0.1:{self.port}"

    def driver_environment(self) -> dict[str, str]:
        """What a process on this host needs to run its Ray driver on this head."""
        return {"RAY_ADDRESS": self.address, "RAY_TMPDIR": str(self.tmp)}

    def __enter__(self) -> RayHead:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 120.0) -> None:
        """Start the head; return once ``ray start`` says it runs."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        env = flower_environment(self.home)  # loopback: RAY_ENABLE_..._CLUSTER=0
        env.update({MARKER: self.id, "RAY_TMPDIR": str(self.tmp), **_NO_PRESTART})
        env.pop("RAY_ADDRESS", None)
        command = [
            str(BIN / "ray"), "start", "--head",
            "--node-ip-address", "127.0.0.1", "--port", str(self.port),
            "--num-cpus", str(self.cpus), "--num-gpus", "0",
            "--include-dashboard", "false", "--disable-usage-stats",
        ]  # fmt: skip
        log = self.home / "ray-start-head.log"
        try:
            with log.open("w") as out:
                code = subprocess.call(
                    command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=PROJECT,
                    timeout=timeout,
                )  # fmt: skip
            if code != 0:
                raise RayClusterError(
                    f"`ray start --head` exited {code}:\n{log.read_text()[-2000:]}"
                )
        except BaseException:
            self.stop()
            raise

    def pids(self) -> list[int]:
        """Every live process this head started (its marker, temp directory or home)."""
        return processes_with_env(
            MARKER, self.id, ("FLWR_HOME", str(self.home)), ("RAY_TMPDIR", str(self.tmp))
        )

    def stop(self, grace: float = 3.0) -> None:
        """End every process of this head by PID (SIGTERM, then SIGKILL after
        ``grace``: a head whose drivers have gone holds nothing that needs an orderly
        end, and some of its processes took 10 s to end on SIGTERM); remove its
        folders."""
        leftover = _end(self.pids, grace)
        for directory in (self.home, self.tmp):
            shutil.rmtree(directory, ignore_errors=True)
        if leftover:
            raise RayClusterError(f"Ray processes {leftover} outlived SIGKILL")


def _end(pids: Callable[[], list[int]], grace: float) -> list[int]:
    """SIGTERM every process ``pids()`` lists, SIGKILL what is left after ``grace``
    seconds; the processes still alive after that."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        listed = pids()
        for pid in listed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while listed and pids() and time.monotonic() < deadline:
            time.sleep(0.2)
    return pids()
