"""Bad networks for the namespace deployments: delay, jitter, loss and a rate limit on a
device's link, and a cut link.

``Impairment`` is netem's model (``tc qdisc add ... netem delay D J loss L rate R``):
each frame is lost with probability ``loss``, else leaves ``delay`` plus a uniform
jitter in [-J, J] after it arrived, never before the frame ahead of it (no reordering,
as netem with a rate), and then after its own transmission time at ``rate``; at most
``limit`` frames wait. It applies in each direction of the link.

``shape`` puts it on a member of ``cluster.Hosts``:

- where the kernel has netem, as ``tc netem`` on both ends of the member's veth pair;
- where it has not (this machine's kernel is built without CONFIG_NET_SCH_NETEM, and
  without fq for an eBPF delay), in user space. The member's veth leaves the bridge; a
  new veth pair takes its place there; and a relay process (``python -m
  tests.deployment.links relay ...``) moves every Ethernet frame between the two,
  through the same model, over packet sockets. Offloads are turned off on the test's
  interfaces (``ethtool -K``) so that every frame is one wire frame with its checksum
  filled in, as it would be on a real link.

``cut`` takes the member's link down (its cable pulled) and ``restore`` brings it back.
Everything is undone by ``Hosts.close`` (the namespaces, the veths, the bridge) and by
stopping the relay, by its PID.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.deployment.cluster import Hosts

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
MAX_FRAME = 65536
OFFLOADS = ["tx", "off", "tso", "off", "gso", "off", "gro", "off", "sg", "off"]


@dataclasses.dataclass(frozen=True)
class Impairment:
    """netem's delay (with uniform jitter), loss and rate, per direction."""

    delay_s: float = 0.150
    jitter_s: float = 0.030
    loss: float = 0.02
    rate_bps: float = 5e6
    limit: int = 1000

    def __post_init__(self) -> None:
        if not 0 <= self.jitter_s <= self.delay_s:
            raise ValueError(f"jitter {self.jitter_s} s must be within [0, delay {self.delay_s} s]")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss {self.loss} must be in [0, 1)")
        if self.rate_bps <= 0 or self.limit < 1:
            raise ValueError("rate and limit must be positive")

    def netem_args(self) -> list[str]:
        """The same model as ``tc netem`` arguments."""
        return [
            "delay", f"{self.delay_s * 1000:g}ms", f"{self.jitter_s * 1000:g}ms",
            "loss", f"{self.loss * 100:g}%", "rate", f"{self.rate_bps / 1e3:g}kbit",
            "limit", str(self.limit),
        ]  # fmt: skip


class Direction:
    """One direction of a link: the frames waiting, and when each may leave."""

    def __init__(self, model: Impairment, rng: random.Random) -> None:
        self.model, self.rng = model, rng
        self.queue: deque[tuple[float, bytes]] = deque()
        self.last_departure = 0.0
        self.counts = {"arrived": 0, "lost": 0, "overflow": 0, "sent": 0, "send_errors": 0}

    def arrive(self, frame: bytes, now: float) -> None:
        """netem's enqueue: lose it, or give it its departure time."""
        self.counts["arrived"] += 1
        if self.rng.random() < self.model.loss:
            self.counts["lost"] += 1
            return
        if len(self.queue) >= self.model.limit:
            self.counts["overflow"] += 1
            return
        jitter = self.rng.uniform(-self.model.jitter_s, self.model.jitter_s)
        ready = max(now + self.model.delay_s + jitter, self.last_departure)
        departure = ready + 8 * len(frame) / self.model.rate_bps
        self.last_departure = departure
        self.queue.append((departure, frame))

    def due(self, now: float) -> list[bytes]:
        """The frames whose time has come, in order."""
        out = []
        while self.queue and self.queue[0][0] <= now:
            out.append(self.queue.popleft()[1])
        return out

    def next_departure(self) -> float | None:
        return self.queue[0][0] if self.queue else None


def _open(interface: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((interface, 0))
    sock.setblocking(False)
    return sock


def relay(a: str, b: str, model: Impairment, seed: int, stats: Path | None) -> None:
    """Move frames between interfaces ``a`` and ``b`` through ``model`` until SIGTERM."""
    rng = random.Random(seed)
    sockets = {a: _open(a), b: _open(b)}
    towards = {a: Direction(model, rng), b: Direction(model, rng)}  # keyed by destination
    other = {a: b, b: a}
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    by_fd = {sock.fileno(): name for name, sock in sockets.items()}
    while not stop:
        departures = [d for d in (q.next_departure() for q in towards.values()) if d is not None]
        now = time.monotonic()
        wait = min(0.2, max(0.0, min(departures) - now)) if departures else 0.2
        with contextlib.suppress(InterruptedError):
            readable, _, _ = select.select(list(sockets.values()), [], [], wait)
            now = time.monotonic()
            for sock in readable:
                source = by_fd[sock.fileno()]
                while True:
                    try:
                        frame, address = sock.recvfrom(MAX_FRAME)
                    except (BlockingIOError, OSError):
                        break  # drained, or the link is down (a cut)
                    if address[2] == PACKET_OUTGOING:
                        continue  # what this relay itself sent on that interface
                    towards[other[source]].arrive(frame, now)
        now = time.monotonic()
        for destination, direction in towards.items():
            for frame in direction.due(now):
                try:
                    sockets[destination].send(frame)
                    direction.counts["sent"] += 1
                except OSError:  # the link is down: the frame is lost, as on a wire
                    direction.counts["send_errors"] += 1
    if stats is not None:
        stats.write_text(json.dumps({f"to {k}": v.counts for k, v in towards.items()}))


def _run(*args: str, namespace: str | None = None) -> None:
    command = ["ip", "netns", "exec", namespace, *args] if namespace else list(args)
    subprocess.run(command, check=True, capture_output=True, text=True)


def kernel_has_netem() -> bool:
    """Does ``tc qdisc add ... netem`` work here? (Tried on a dummy interface.)"""
    name = f"fpnetem{os.getpid() % 10000}"
    try:
        _run("ip", "link", "add", name, "type", "dummy")
    except (OSError, subprocess.CalledProcessError):
        return False
    try:
        _run("tc", "qdisc", "add", "dev", name, "root", "netem", "delay", "1ms")
        return True
    except subprocess.CalledProcessError:
        return False
    finally:
        subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)


class Shaper:
    """Impair the links of members of ``hosts``; ``close`` stops what it started."""

    def __init__(self, hosts: Hosts, work: Path, *, use_netem: bool | None = None) -> None:
        if not hosts.isolated:
            raise RuntimeError(f"network namespaces unavailable: {hosts.reason}")
        self.hosts, self.work = hosts, work
        self.use_netem = kernel_has_netem() if use_netem is None else use_netem
        if not self.use_netem and shutil.which("ethtool") is None:
            raise RuntimeError(
                "the kernel has no netem and ethtool is missing, which the user-space relay "
                "needs to turn offloads off: apt-get install ethtool (make deploy-test does)"
            )
        self.relays: dict[str, subprocess.Popen[bytes]] = {}
        self.stats: dict[str, Path] = {}
        self._offloads_off = False

    def mechanism(self) -> str:
        return "tc netem" if self.use_netem else "user-space relay (no netem in this kernel)"

    def _veth(self, name: str) -> tuple[str, str]:
        index = self.hosts.names.index(name)
        return f"{self.hosts.prefix}h{index}", f"{self.hosts.prefix}n{index}"

    def shape(self, name: str, model: Impairment, *, seed: int = 0) -> None:
        """Put ``model`` on both directions of member ``name``'s link."""
        outside, inside = self._veth(name)
        namespace = self.hosts.namespaces[name]
        if self.use_netem:
            _run("tc", "qdisc", "add", "dev", outside, "root", "netem", *model.netem_args())
            _run("tc", "qdisc", "add", "dev", inside, "root", "netem", *model.netem_args(),
                 namespace=namespace)  # fmt: skip
            return
        self._turn_offloads_off()
        index = self.hosts.names.index(name)
        near, far = f"{self.hosts.prefix}r{index}", f"{self.hosts.prefix}b{index}"
        _run("ip", "link", "add", near, "type", "veth", "peer", "name", far)
        for interface in (near, far):
            _run("ethtool", "-K", interface, *OFFLOADS)
        _run("ip", "link", "set", outside, "nomaster")
        _run("ip", "link", "set", far, "master", self.hosts.bridge)
        for interface in (near, far, outside):
            _run("ip", "link", "set", interface, "up")
        stats = self.work / f"relay-{name}.json"
        parameters = json.dumps(dataclasses.asdict(model))
        with (self.work / f"relay-{name}.log").open("wb") as log:
            self.relays[name] = subprocess.Popen(
                [sys.executable, "-m", "tests.deployment.links", "relay", outside, near,
                 "--model", parameters, "--seed", str(seed), "--stats", str(stats)],
                stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2],
            )  # fmt: skip
        self.stats[name] = stats

    def _turn_offloads_off(self) -> None:
        """Every interface of the test: one wire frame per packet, checksums filled in."""
        if self._offloads_off:
            return
        for index, name in enumerate(self.hosts.names):
            outside, inside = f"{self.hosts.prefix}h{index}", f"{self.hosts.prefix}n{index}"
            _run("ethtool", "-K", outside, *OFFLOADS)
            _run("ethtool", "-K", inside, *OFFLOADS, namespace=self.hosts.namespaces[name])
        self._offloads_off = True

    def cut(self, name: str) -> None:
        """Pull member ``name``'s cable: its link goes down on the bridge's side."""
        _run("ip", "link", "set", self._veth(name)[0], "down")

    def restore(self, name: str) -> None:
        _run("ip", "link", "set", self._veth(name)[0], "up")

    def counts(self) -> dict[str, object]:
        """What each relay forwarded and dropped (after ``close``)."""
        return {
            name: json.loads(path.read_text()) if path.exists() else None
            for name, path in self.stats.items()
        }

    def close(self) -> None:
        """Stop the relays (by PID). The interfaces go with ``Hosts.close``."""
        for process in self.relays.values():
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        for process in self.relays.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        self.relays = {}
        for index in range(len(self.hosts.names)):  # the relays' own veth pairs, if left
            relay_end = f"{self.hosts.prefix}r{index}"
            subprocess.run(["ip", "link", "del", relay_end], capture_output=True, check=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A netem-model relay between two interfaces")
    commands = parser.add_subparsers(dest="command", required=True)
    relay_parser = commands.add_parser("relay")
    relay_parser.add_argument("a")
    relay_parser.add_argument("b")
    relay_parser.add_argument("--model", required=True, help="Impairment fields as JSON")
    relay_parser.add_argument("--seed", type=int, default=0)
    relay_parser.add_argument("--stats", type=Path)
    args = parser.parse_args(argv)
    relay(args.a, args.b, Impairment(**json.loads(args.model)), args.seed, args.stats)


if __name__ == "__main__":
    main()
