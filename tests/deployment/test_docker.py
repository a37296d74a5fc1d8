"""The Docker deployment for real: images, docker-compose, a locked-down SuperLink.

Run by ``make deploy-test`` (which installs Docker, builds the images and writes the
summary); skipped where no Docker daemon answers. One compose project: a SuperLink
(published on the operator's 127.0.0.1 only), the Fleet proxy that is the devices' only
way in, a registration job and three SuperNodes, each container non-root with only its
own secrets.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedpers.reports import read_rounds
from fedpers.simulations.launch import LocalSimulation
from tests.deployment.cluster import record_figure, same_rounds, wait_for
from tests.deployment.compose import Compose, docker, exchange_steps

pytestmark = pytest.mark.docker

NODES = 3
RUN: dict[str, object] = {
    "algorithm": "fedrep",
    "dataset": "digits",
    "num-clients": NODES,
    "fraction-train": 1.0,
    "round-timeout": 40.0,
    "results-dir": "/results",
}
ROUNDS_KILLED = 25


def _docker_answers() -> bool:
    try:
        return docker("info", timeout=20).returncode == 0
    except (OSError, TimeoutError):
        return False


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compose]:
    if not _docker_answers():
        pytest.skip("no Docker daemon answers (make deploy-test starts one)")
    work = tmp_path_factory.mktemp("compose")
    project = Compose(
        work, nodes=NODES, isolation=os.environ.get("FEDPERS_ISOLATION", "subprocess")
    )
    try:
        project.up()
        yield project
    finally:
        project.close()
        left = docker("ps", "-a", "--filter", f"name={project.project}_", "-q").stdout
        assert not left.strip()


def _simulate(values: dict[str, object], results: Path) -> Path:
    with LocalSimulation(echo=lambda line: None) as simulation:
        return simulation.run({**values, "results-dir": str(results)})


def test_containers_are_non_root_and_hold_only_their_own_secrets(deployment: Compose) -> None:
    services = ["superlink", "fleet", *[f"supernode-{i}" for i in range(NODES)]]
    for service in services:
        info = deployment.inspect(service)
        assert info["Config"]["User"] == "fedpers", service
        assert info["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped", service
        assert "Healthcheck" in info["Config"], service
        ran = docker("exec", deployment.container(service), "sh", "-c", "id -u; ls /credentials")
        uid, *files = ran.stdout.split()
        assert uid == "10001", service
        expected = {
            "superlink": {"ca.crt", "nodes", "server.key", "server.pem"},
            "fleet": {"ca.crt", "proxy.key", "proxy.pem"},
        }.get(service)
        if expected is None:
            index = service.rsplit("-", 1)[1]
            expected = {"ca.crt", f"node{index}", f"node{index}.pub"}
        assert set(files) == expected, service
        found = docker("exec", deployment.container(service), "sh", "-c",
                       "find / -xdev -name 'ca.key' 2>/dev/null")  # fmt: skip
        assert found.stdout.strip() == "", service
    ports = deployment.inspect("superlink")["HostConfig"]["PortBindings"]
    assert ports == {"9091/tcp": [{"HostIp": "127.0.0.1", "HostPort": "9091"}]}


def test_devices_reach_the_fleet_api_only(deployment: Compose) -> None:
    """From the device network the Control and Runtime APIs are refused, Fleet passes."""
    probe = r"""
import json, socket, ssl, sys, urllib.request, urllib.error
ctx = ssl.create_default_context(cafile="/credentials/ca.crt")
out = {}
def status(url, data=None):
    request = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET",
                                     headers={"Content-Type": "application/protobuf"})
    try:
        with urllib.request.urlopen(request, context=ctx, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
for name, url, data in [
    ("health", "https://fleet:9092/health", None),
    ("control_register", "https://fleet:9092/v1/control/register-node", b""),
    ("control_list_runs", "https://fleet:9092/v1/control/list-runs", b""),
    ("control_start_run", "https://fleet:9092/v1/control/start-run", b""),
    ("runtime", "https://fleet:9092/v1/runtime/get-run", b""),
    ("fleet", "https://fleet:9092/v1/fleet/pull-messages", b""),
]:
    out[name] = status(url, data)
try:
    socket.create_connection(("superlink", 9091), timeout=5).close()
    out["superlink_direct"] = "reached"
except OSError as e:
    out["superlink_direct"] = type(e).__name__
print(json.dumps(out))
"""
    ran = docker(
        "run", "--rm", "--network", deployment.network("devices"),
        "-v", f"{deployment.credentials / 'node0' / 'ca.crt'}:/credentials/ca.crt:ro",
        "--entrypoint", "python", deployment.compose_gen.IMAGE_DEVICE, "-c", probe,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    seen = json.loads(ran.stdout.strip().splitlines()[-1])
    record_figure("device_network_probe", seen)
    assert seen["health"] == 200
    for key in ("control_register", "control_list_runs", "control_start_run", "runtime"):
        assert seen[key] == 403, seen
    assert seen["fleet"] not in (403, 404), seen  # reached the SuperLink's Fleet API
    assert seen["superlink_direct"] != "reached", seen  # not on the devices' network
    # The operator's side: the Control API answers (list the runs).
    listed = deployment.cli("ls", deployment.entrypoint.CONNECTION, "--format", "json", timeout=60)
    assert listed.returncode == 0, listed.stdout + listed.stderr


def cgroup_file(container: str, v1: str, v2: str) -> Path:
    """A file of a container's cgroup: cgroup v1's ``v1`` pattern (``{}`` for the
    container's folder), else the v2 file named ``v2``."""
    for pattern in (v1.format(f"*{container}*"), f"**/*{container}*/{v2}"):
        found = sorted(Path("/sys/fs/cgroup").glob(pattern))
        if found:
            return found[0]
    raise FileNotFoundError(f"no {v1.split('/')[0]} cgroup of container {container[:12]}")


class DeviceMemory:
    """The peak memory of each device container (SuperNode, launcher and ClientApps
    together: what its limit counts), per round.

    The memory cgroup of a container keeps its peak (cgroup v1
    ``memory.max_usage_in_bytes``, v2 ``memory.peak``); a thread reads it when a round's
    record appears and, on v1, resets it, so each figure is that round's peak. On v2
    ``memory.peak`` cannot be reset here, so each figure is the peak so far. The peak
    counts page cache; ``resident`` is the processes' anonymous memory when each round
    was recorded."""

    def __init__(self, deployment: Compose, services: list[str], rounds_file: Path) -> None:
        self.files = {s: self._peak_file(deployment.inspect(s)["Id"]) for s in services}
        self.limits = {s: deployment.inspect(s)["HostConfig"]["Memory"] for s in services}
        self.rounds_file = rounds_file
        self.peaks: dict[str, list[int]] = {s: [] for s in services}
        self.resident: dict[str, list[int]] = {s: [] for s in services}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    @staticmethod
    def _peak_file(container: str) -> Path:
        return cgroup_file(container, "memory/**/{}/memory.max_usage_in_bytes", "memory.peak")

    def _read_and_reset(self) -> None:
        for service, path in self.files.items():
            self.peaks[service].append(int(path.read_text()))
            self.resident[service].append(_anonymous_bytes(path.with_name("memory.stat")))
            if path.name == "memory.max_usage_in_bytes":
                path.write_text("0")

    def _watch(self) -> None:
        for path in self.files.values():  # round 1 counts from the run's start
            if path.name == "memory.max_usage_in_bytes":
                path.write_text("0")
        seen = 0
        while not self.stop.wait(0.2):
            lines = (
                len(self.rounds_file.read_text().splitlines()) if self.rounds_file.exists() else 0
            )
            for _ in range(seen, lines):
                self._read_and_reset()
            seen = lines

    def __enter__(self) -> DeviceMemory:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)

    def summary(self) -> dict[str, object]:
        mb = 2**20
        return {
            "limit_mb": sorted({limit // mb for limit in self.limits.values()}),
            "per_round_mb": {s: [round(p / mb, 1) for p in v] for s, v in self.peaks.items()},
            "max_mb": round(max(max(v, default=0) for v in self.peaks.values()) / mb, 1),
            "counter": next(iter(self.files.values())).name,
            # the peak counts the page cache, which the kernel takes back before it
            # kills for memory; the processes' own (anonymous) memory when each round
            # was recorded, from memory.stat (v1 total_rss, v2 anon):
            "anonymous_at_round_end_mb": {
                s: [round(p / mb, 1) for p in v] for s, v in self.resident.items()
            },
        }


def _anonymous_bytes(stat: Path) -> int:
    """The anonymous memory of a cgroup's processes (not page cache): ``total_rss`` of a
    v1 ``memory.stat`` (its processes and its children's), ``anon`` of a v2 one."""
    fields = dict(line.split() for line in stat.read_text().splitlines() if line.strip())
    return int(fields["total_rss"] if "total_rss" in fields else fields["anon"])


def cpu_seconds(deployment: Compose, services: list[str]) -> dict[str, float]:
    """Processor seconds each container has used so far (its cpuacct cgroup, v1; v2's
    cpu.stat usage_usec), all its processes together."""
    used = {}
    for service in services:
        try:
            path = cgroup_file(
                deployment.inspect(service)["Id"], "cpuacct/**/{}/cpuacct.usage", "cpu.stat"
            )
        except FileNotFoundError:
            continue  # no figure for it, as before
        if path.name == "cpuacct.usage":
            used[service] = int(path.read_text()) / 1e9
        else:
            stat = dict(line.split() for line in path.read_text().splitlines())
            used[service] = int(stat["usage_usec"]) / 1e6
    return used


def test_deployed_fedrep_matches_simulation(deployment: Compose, tmp_path: Path) -> None:
    values = {**RUN, "num-rounds": 3, "run-name": "deployed"}
    # The simulated twin first, not beside the deployed run: its processes would share
    # the host's cores with the timed rounds.
    twin = _simulate({**values, "run-name": "simulated"}, tmp_path / "sim")
    devices = [f"supernode-{i}" for i in range(NODES)]
    memory = DeviceMemory(deployment, devices, deployment.results / "deployed" / "rounds.jsonl")
    services = ["superlink", "fleet", *devices]
    before, started = cpu_seconds(deployment, services), time.monotonic()
    with memory:
        result = deployment.run(values)
    after, run_seconds = cpu_seconds(deployment, services), time.monotonic() - started
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    deployed = read_rounds(deployment.results / "deployed")
    assert [r.round for r in deployed] == [1, 2, 3]
    assert all(r.replies == NODES and r.failures == 0 for r in deployed)
    same_rounds(deployed, read_rounds(twin))
    steady = deployed[1:]
    record_figure("round_seconds", float(np.mean([r.seconds for r in steady])))
    # where an exchange's time goes on the devices (the rest: the SuperNodes' polls, the
    # SuperLink, the ServerApp's pulls), the median over the devices' messages
    on_devices: dict[str, dict[str, list[float]]] = {}
    for device in devices:
        log = docker("logs", "-t", deployment.container(device))
        for kind, step in exchange_steps(log.stdout + log.stderr).items():
            for name, seconds in step.items():
                on_devices.setdefault(kind, {}).setdefault(name, []).extend(seconds)
    assert set(on_devices) == {"train", "evaluate"}, on_devices
    record_figure(
        "round_split",
        {
            "isolation": deployment.env["FEDPERS_ISOLATION"],
            "round": float(np.mean([r.seconds for r in steady])),
            "train": float(np.mean([r.train_seconds for r in steady])),
            "evaluate": float(np.mean([r.evaluate_seconds for r in steady])),
            "first_round": deployed[0].seconds,
            "on_devices_median": {
                kind: {name: float(np.median(v)) for name, v in step.items()}
                for kind, step in on_devices.items()
            },
            "on_devices_messages": {kind: len(s["launch"]) for kind, s in on_devices.items()},
            # processor seconds of the whole run (3 rounds, the ServerApp in the
            # SuperLink's container), and the host's cores they shared
            "cpu_seconds_of_the_run": {s: round(after[s] - before[s], 2) for s in after},
            "run_seconds": round(run_seconds, 1),
            "host_cores": os.cpu_count(),
        },
    )
    # Each device within its Raspberry Pi class budget (1 GiB, one CPU) every round.
    peaks = memory.summary()
    record_figure("device_peak_memory_mb", peaks)
    assert all(len(v) == 3 for v in memory.peaks.values()), peaks
    assert all(memory.limits[s] == 2**30 for s in devices), memory.limits
    for service in devices:
        assert deployment.inspect(service)["HostConfig"]["NanoCpus"] == 10**9
        assert not deployment.inspect(service)["State"]["OOMKilled"]


def test_crashed_supernode_restarts_on_its_own_and_rejoins(deployment: Compose) -> None:
    # Enough rounds to outlast the node's way back (up to 60 s until Flower takes its key
    # again, then its start): with torch's CPU build a round takes about 4 s here, and 9
    # rounds (enough at the CUDA image's 29 s) ended before it was back.
    values = {**RUN, "num-rounds": ROUNDS_KILLED, "run-name": "killed"}
    outcome: dict[str, object] = {}
    run = threading.Thread(target=lambda: outcome.setdefault("run", deployment.run(values)))
    run.start()
    rounds = deployment.results / "killed" / "rounds.jsonl"
    wait_for(lambda: rounds.exists() and len(rounds.read_text().splitlines()) >= 2, 300)
    killed_at = time.monotonic()
    # A crash: SIGKILL to the container's main process from the host, as an OOM kill or a
    # power cut would end it. (`docker kill` counts as a manual stop in Docker 20.10: the
    # restart policy then leaves the container stopped, as Docker documents.)
    pid = int(deployment.inspect("supernode-2")["State"]["Pid"])
    assert pid > 0
    os.kill(pid, signal.SIGKILL)
    # Restarted by its restart policy; Flower refuses its key until the previous session
    # misses two 30 s heartbeats, and the entry point retries every 10 s meanwhile.
    deployment.wait_healthy(["supernode-2"], 300)
    back = time.monotonic() - killed_at
    run.join(timeout=600)
    result = outcome["run"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]  # type: ignore[attr-defined]
    assert deployment.inspect("supernode-2")["RestartCount"] >= 1
    records = read_rounds(deployment.results / "killed")
    assert [r.round for r in records] == list(range(1, ROUNDS_KILLED + 1))
    missing = [r.round for r in records if r.replies < NODES]
    assert missing, "the killed node never missed a round"
    assert all(r.failures == NODES - r.replies for r in records)
    rejoined = [r.round for r in records if r.round > max(missing) and r.replies == NODES]
    assert rejoined, f"node 2 never came back (rounds without it: {missing})"
    # Its personal head came back from its volume (the newest snapshots are kept): it
    # counts the rounds trained before the kill too, which a fresh head would not.
    states = deployment.volume_files("supernode-2-state", "killed-*-partition-2-round-*.npz")
    assert states
    newest = max(states, key=lambda n: int(n.rsplit("-", 1)[1].split(".")[0]))
    with np.load(io.BytesIO(states[newest])) as stored:
        configs = str(stored["__configs__"])
    trained = int(re.search(r'"rounds-trained": (\d+)', configs).group(1))  # type: ignore[union-attr]
    after = sum(1 for r in records if r.round >= rejoined[0])
    assert trained >= after + 2, (trained, after, missing)
    record_figure(
        "killed_supernode",
        {
            "rounds_without_it": missing,
            "rejoined_round": rejoined[0],
            "healthy_again_s": round(back, 1),
            "restarts": deployment.inspect("supernode-2")["RestartCount"],
        },
    )


def test_superlink_restart_then_resume_gives_the_uninterrupted_metrics(
    deployment: Compose, tmp_path: Path
) -> None:
    """The SuperLink container restarts mid-run (its state on a volume); the SuperNodes
    reconnect by themselves and the run is resumed from its checkpoint to the metrics of
    an uninterrupted run (its simulated twin, which equals a deployed run, see above)."""
    # A SuperNode reconnects to the restarted SuperLink in its own time (Flower's backoff),
    # and the resumed run may ask it before it is back: a round timeout of 120 s, not 40,
    # lets each round wait for all three (a round that ends sooner costs nothing more).
    values = {
        **RUN,
        "num-rounds": 5,
        "run-name": "restarted",
        "client-state-dir": "/state",
        "round-timeout": 120.0,
    }
    twin: dict[str, Path] = {}
    thread = threading.Thread(
        target=lambda: twin.setdefault(
            "dir", _simulate({**values, "run-name": "uninterrupted", "client-state-dir": ""},
                             tmp_path / "sim")
        )
    )  # fmt: skip
    thread.start()
    outcome: dict[str, object] = {}
    run = threading.Thread(target=lambda: outcome.setdefault("run", deployment.run(values)))
    run.start()
    rounds = deployment.results / "restarted" / "rounds.jsonl"
    wait_for(lambda: rounds.exists() and len(rounds.read_text().splitlines()) >= 2, 300)
    restarted_at = time.monotonic()
    assert docker("restart", "-t", "5", deployment.container("superlink")).returncode == 0
    run.join(timeout=300)
    interrupted = len(rounds.read_text().splitlines())
    assert interrupted < 5, "the run finished before the SuperLink restarted"
    deployment.wait_healthy(["superlink", "fleet"], 120)
    result = deployment.run({**values, "resume": True})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    thread.join(timeout=300)
    records = read_rounds(deployment.results / "restarted")
    assert [r.round for r in records] == [1, 2, 3, 4, 5]
    assert all(r.replies == NODES for r in records), [(r.round, r.replies) for r in records]
    same_rounds(records, read_rounds(twin["dir"]))
    record_figure(
        "superlink_restart",
        {
            "rounds_before_restart": interrupted,
            "seconds_restart_to_resumed_end": round(time.monotonic() - restarted_at, 1),
        },
    )


def test_a_node_with_trusted_entities_refuses_an_unsigned_app(
    deployment: Compose, tmp_path: Path
) -> None:
    """SuperNode 2 restarted with --trusted-entities refuses the app `flwr run .` sends.

    Flower 1.42 attaches app signatures only to apps fetched from Flower Hub (online); an
    app bundle sent from the operator's machine carries none, so no app can be signed
    offline and such a node refuses every run started with `flwr run .`.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    public = (
        ed25519.Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )
    trust = tmp_path / "trust"
    trust.mkdir()
    (trust / "trusted-entities.yaml").write_text(f"fedpers-publisher: {public}\n")
    os.chmod(trust, 0o755)
    stopped = deployment.compose("stop", "-t", "10", "supernode-2")  # deactivates its session
    assert stopped.returncode == 0, stopped.stderr
    name = f"{deployment.project}_trusting"
    credentials = deployment.credentials / "node2"
    started = docker(
        "run", "-d", "--name", name, "--network", deployment.network("devices"),
        "-v", f"{credentials}:/credentials:ro", "-v", f"{trust}:/trust:ro",
        "-e", "FEDPERS_TRUSTED_ENTITIES=/trust/trusted-entities.yaml",
        "-e", "FEDPERS_SUPERLINK=fleet:9092", "-e", f"FEDPERS_NODES={NODES}",
        deployment.compose_gen.IMAGE_DEVICE,
        "python", "docker/entrypoint.py", "exec", "supernode", "2",
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stderr
        wait_for(lambda: _container_health(name) == "healthy", 180)
        result = deployment.run({**RUN, "num-rounds": 1, "run-name": "unsigned"})
        log = docker("logs", name).stdout + docker("logs", name).stderr
    finally:
        docker("stop", "-t", "10", name)
        docker("rm", "-f", name)
    # The node answers the server's first query with an error instead of running the
    # app; fedpers then stops the run before round 1, naming the node and the reason.
    failure = json.loads((deployment.results / "unsigned" / "failure.json").read_text())
    assert "The FAB could not be verified" in failure["reason"], failure
    assert failure["rounds_completed"] == 0
    assert "could not be verified" in log, log[-3000:]
    restarted = deployment.compose("start", "supernode-2")
    assert restarted.returncode == 0, restarted.stderr
    deployment.wait_healthy(["supernode-2"], 180)
    record_figure(
        "trusted_entities", {"flwr_run_exit": result.returncode, "failure": failure["reason"]}
    )


def _container_health(name: str) -> str:
    out = docker("inspect", "-f", "{{.State.Health.Status}}", name).stdout.strip()
    return out or "unknown"


def test_down_then_up_again_registration_is_idempotent(deployment: Compose) -> None:
    down = deployment.compose("down", "--timeout", "10")  # volumes kept
    assert down.returncode == 0, down.stderr
    started = time.monotonic()
    deployment.up(timeout=300)
    register = deployment.compose("logs", "--no-color", "register").stdout
    assert register.count("already registered") == NODES, register
    values = {**RUN, "num-rounds": 1, "run-name": "again"}
    result = deployment.run(values)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_rounds(deployment.results / "again")
    assert records[0].replies == NODES
    record_figure("down_up_seconds_to_healthy_and_one_round", round(time.monotonic() - started, 1))


ARM64_IMAGE = "fedpers-device:1.42-arm64"
# qemu-user adds its own memory to every emulated process (its translated code, its
# copy of the guest's mappings): under the 1 GiB of a device the kernel killed the
# zygote and ClientApps (seen here: a round of 96-100 s and a ClientApp that "stopped
# responding"); with 2 GiB its peaks were 1.48-1.88 GB (page cache included), so the
# emulated node gets 3 GiB. A native arm64 device runs the same processes as the amd64
# ones, whose peaks the first test measures.
ARM64_EMULATED_MEMORY = "3g"
# The arm64 image's torch (2.10, OpenBLAS and the Arm Compute Library) is not the amd64
# image's (2.13, MKL and oneDNN): float32 sums in another order differ in their last
# bits (2**-23 = 1.2e-7 relative each), and 3 rounds of training carried that to 5.7e-7
# relative in the losses here, accuracy equal. 1e-4 is far above that and far below
# what a wrong update does to a loss (percents). Both images pin their torch, so a run
# repeats its own figures: a pass is not luck of the draw.
ARM64_RTOL = 1e-4


def test_mixed_federation_with_an_emulated_arm64_node(deployment: Compose, tmp_path: Path) -> None:
    """One arm64 SuperNode (qemu-user under binfmt_misc) and two amd64 ones train the
    digits FedRep through the proxy, with the metrics of the simulation within
    ARM64_RTOL. Node 2 is recreated on the arm64 image with its own credentials and
    state volume, then put back."""
    if docker("image", "inspect", ARM64_IMAGE).returncode != 0:
        pytest.skip(f"no {ARM64_IMAGE} (make deploy-test builds it under emulation)")
    values = {**RUN, "num-rounds": 3, "run-name": "mixed", "round-timeout": 300.0}
    twin = _simulate({**values, "run-name": "simulated"}, tmp_path / "sim")  # first: see above
    deployment.use_images({2: ARM64_IMAGE}, memory=ARM64_EMULATED_MEMORY)
    memory = DeviceMemory(
        deployment, ["supernode-2"], deployment.results / "mixed" / "rounds.jsonl"
    )
    try:
        machines = [
            docker("exec", deployment.container(f"supernode-{i}"), "uname", "-m").stdout.strip()
            for i in range(NODES)
        ]
        assert machines == ["x86_64", "x86_64", "aarch64"], machines
        with memory:
            result = deployment.run(values, timeout=1200)
        oom_killed = deployment.inspect("supernode-2")["State"]["OOMKilled"]
    finally:
        node_log = docker("logs", deployment.container("supernode-2"))
        (tmp_path / "arm64-supernode.log").write_text(node_log.stdout + node_log.stderr)
        deployment.use_images({})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    mixed = read_rounds(deployment.results / "mixed")
    simulated = read_rounds(twin)
    deviation = {
        f"{section}/{key}": max(
            abs(getattr(m, section)[key] - getattr(s, section)[key])
            / max(abs(getattr(s, section)[key]), 1e-12)
            for m, s in zip(mixed, simulated, strict=True)
        )
        for section in ("train", "evaluate")
        for key in getattr(simulated[0], section)
    }
    record_figure("arm64_round_seconds", float(np.mean([r.seconds for r in mixed[1:]])))
    record_figure(
        "arm64",
        {
            "round_seconds": [r.seconds for r in mixed],
            "train_seconds": [r.train_seconds for r in mixed],
            "evaluate_seconds": [r.evaluate_seconds for r in mixed],
            "largest_relative_deviation": deviation,
            "emulated_node_peak_memory_mb": memory.summary(),
        },
    )
    assert not oom_killed
    same_rounds(mixed, simulated, nodes=NODES, rtol=ARM64_RTOL)
