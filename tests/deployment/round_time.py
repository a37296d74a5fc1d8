"""Where a deployed round's time goes: a benchmark, not a test.

    python -m tests.deployment.round_time [--rounds 5] [--nodes 3]
        [--supernode "fedpers-supernode"] [--supernode "flower-supernode"] ...
        [--in-memory] [--idle SECONDS] [--json FILE]

For each ``--supernode`` program (with its flags, as one argument), starts the namespace
deployment of ``tests/deployment/cluster.py`` (a SuperLink with TLS, SuperNode
authentication and, unless ``--in-memory``, its SQLite database; ``--nodes`` SuperNodes,
each in its own network namespace), runs the digits FedRep with every node training
every round, and prints:

- each round's seconds, and its training and evaluation exchanges, from the run's
  ``rounds.jsonl``;
- the processor seconds each kind of process used, read from ``/proc`` before the
  cluster stops (SuperLink, SuperNodes, SuperExecs, ClientApp processes or the
  launcher's zygotes with their children, the ServerApp).

With ``--idle SECONDS`` it runs nothing and reports what idle SuperNodes polling cost
the SuperLink instead (its processor seconds over that time), the figure the poll
interval of a fleet is chosen from (docs/deploying.md), and what idling cost the nodes
(their SuperNodes and SuperExecs: the task poll's price on a device).

Run it on an otherwise idle machine; it starts and stops everything it uses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from tests.deployment.cluster import Cluster

RUN = {
    "algorithm": "fedrep",
    "dataset": "digits",
    "fraction-train": 1.0,
    "round-timeout": 60.0,
}
KINDS = (
    ("SuperLink", re.compile(r"flower-superlink")),
    ("ServerApp", re.compile(r"flwr-serverapp")),
    ("zygotes and their ClientApps", re.compile(r"fedpers\.launcher zygote")),
    ("ClientApps (cold)", re.compile(r"flwr-clientapp")),
    ("SuperExec", re.compile(r"superexec")),
    ("SuperNode", re.compile(r"(flower|fedpers)-supernode")),
)


def processor_seconds(work: Path) -> dict[str, float]:
    """Processor seconds (own, and of children it reaped) of the cluster's processes
    (those whose FLWR_HOME is in ``work``), by side and kind: "superlink" for the
    SuperLink's host (its SuperExec holds the ServerApp's once it ended), "nodes" for
    all SuperNodes' together."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = defaultdict(float)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        home = next((e[len(b"FLWR_HOME=") :] for e in environ if e.startswith(b"FLWR_HOME=")), b"")
        if not home.startswith(str(work).encode()):
            continue
        side = "superlink" if home.endswith(b"/superlink") else "nodes"
        kind = next((name for name, pattern in KINDS if pattern.search(command)), None)
        if kind is not None:
            used = sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
            seconds[f"{side}: {kind}"] += used
    return dict(seconds)


def measure(program: tuple[str, ...], *, rounds: int, nodes: int, in_memory: bool) -> dict:
    """One deployed run with ``program`` as every SuperNode; its figures."""
    work = Path(tempfile.mkdtemp(prefix="fedpers-round-time-"))
    cluster = Cluster(work, nodes=nodes, extra_keys=0, supernode_program=program)
    if in_memory:
        flower_args = cluster.entrypoint.superlink_args
        cluster.entrypoint.superlink_args = lambda *a, **k: [
            arg for arg in flower_args(*a, **k) if arg != "--database" and not arg.endswith(".db")
        ]
    try:
        cluster.start_superlink()
        for index in range(nodes):
            cluster.register(index)
        for index in range(nodes):
            cluster.start_supernode(index)
        config = work / "run.toml"
        values = {**RUN, "num-clients": nodes, "num-rounds": rounds,
                  "results-dir": str(work / "results"), "run-name": "timed"}  # fmt: skip
        config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
        started = time.monotonic()
        done = cluster.cli(
            "run", str(cluster.app), "fedpers", "--run-config", str(config), "--stream",
            timeout=60 + 90 * rounds,
        )  # fmt: skip
        wall = time.monotonic() - started
        if done.returncode != 0:
            raise RuntimeError(f"flwr run failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        cpu = processor_seconds(work)
    finally:
        cluster.close()
    lines = (work / "results" / "timed" / "rounds.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {
        "program": " ".join(program),
        "superlink": "in memory" if in_memory else "SQLite database",
        "wall_seconds": wall,
        "rounds": [
            {k: r[k] for k in ("round", "seconds", "train_seconds", "evaluate_seconds")}
            for r in records
        ],
        "processor_seconds": cpu,
    }


def poll_cost(program: tuple[str, ...], *, nodes: int, seconds: float, in_memory: bool) -> dict:
    """What idle SuperNodes cost the SuperLink: its processor seconds over ``seconds``
    of ``nodes`` SuperNodes polling with nothing to do, and the polls they made (from
    their interval: ``seconds / interval`` each)."""
    work = Path(tempfile.mkdtemp(prefix="fedpers-poll-cost-"))
    cluster = Cluster(work, nodes=nodes, extra_keys=0, supernode_program=program)
    if in_memory:
        flower_args = cluster.entrypoint.superlink_args
        cluster.entrypoint.superlink_args = lambda *a, **k: [
            arg for arg in flower_args(*a, **k) if arg != "--database" and not arg.endswith(".db")
        ]
    try:
        cluster.start_superlink()
        for index in range(nodes):
            cluster.register(index)
        for index in range(nodes):
            cluster.start_supernode(index)
        time.sleep(20)  # connected, and past their start-up
        before = processor_seconds(work)
        time.sleep(seconds)
        after = processor_seconds(work)
    finally:
        cluster.close()
    used = {kind: after[kind] - before.get(kind, 0.0) for kind in after}
    return {
        "program": " ".join(program),
        "superlink": "in memory" if in_memory else "SQLite database",
        "nodes": nodes,
        "seconds": seconds,
        "superlink_processor_seconds": used.get("superlink: SuperLink", 0.0),
        # what idling costs the devices: each SuperNode's polls of the SuperLink, and
        # its SuperExec's polls of the SuperNode for tasks (all nodes together)
        "node_processor_seconds": {k: v for k, v in used.items() if k.startswith("nodes: ")},
    }


def report(result: dict) -> str:
    """One run's figures as text."""
    rounds = result["rounds"]
    steady = [r["seconds"] for r in rounds[1:]] or [rounds[0]["seconds"]]
    lines = [
        f"{result['program']} ({result['superlink']}): run {result['wall_seconds']:.1f} s, "
        f"median round after the first {statistics.median(steady):.2f} s"
    ]
    lines += [
        f"  round {r['round']}: {r['seconds']:.2f} s (training {r['train_seconds']:.2f}, "
        f"evaluation {r['evaluate_seconds']:.2f})"
        for r in rounds
    ]
    used = sorted(result["processor_seconds"].items(), key=lambda item: -item[1])
    lines += [f"  processor: {kind:40s} {seconds:6.1f} s" for kind, seconds in used]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.deployment.round_time")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument(
        "--supernode",
        action="append",
        default=None,
        help='a SuperNode program and its flags, e.g. "fedpers-supernode --poll-interval '
        '0.2" (repeatable; default: fedpers-supernode)',
    )
    parser.add_argument("--in-memory", action="store_true", help="no SuperLink database")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="instead of a run: the SuperLink's processor seconds over this many seconds "
        "of idle SuperNodes polling",
    )
    args = parser.parse_args(argv)
    results = []
    if args.idle:
        for program in args.supernode or ["fedpers-supernode"]:
            cost = poll_cost(
                tuple(program.split()), nodes=args.nodes, seconds=args.idle,
                in_memory=args.in_memory,
            )  # fmt: skip
            results.append(cost)
            print(json.dumps(cost), flush=True)  # noqa: T201
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return 0
    for program in args.supernode or ["fedpers-supernode"]:
        results.append(
            measure(
                tuple(program.split()),
                rounds=args.rounds,
                nodes=args.nodes,
                in_memory=args.in_memory,
            )
        )
        print(report(results[-1]), flush=True)  # noqa: T201
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
