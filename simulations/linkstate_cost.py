"""Where Flower's simulation spends time as the node count grows: its message dispatcher.

    python -m simulations.linkstate_cost [--nodes 100,1000,5000,10000]
                                         [--states flower,indexed,sqlite]

Flower 1.42's simulation runtime (``flwr.server.superlink.fleet.vce.vce_api``) hands
messages to the Ray actors from one thread that, every 0.1 s, asks the LinkState for
the next message of *every* registered node (``get_message_ins(node_id, limit=1)``).
Flower's in-memory LinkState answers each ask by scanning (and re-validating) every
stored message, so one sweep costs nodes x stored messages, whether or not a node has
work. This script builds a LinkState with N nodes, pushes M messages (none, 10% of the
nodes as in a training round, and one per node as in a query to every node) and times
one sweep, with no Ray and no fedpers client code involved. It also counts the messages
the sweep delivered, which must be M.

``--states`` picks the LinkStates to time:

- ``flower``: Flower's ``InMemoryLinkState`` as shipped, what a simulation uses;
- ``indexed``: the same with fedpers' per-node index (``strategies.flower_patches``,
  installed by the ServerApp in a simulation), the upstream proposal this script
  reproduces the need for;
- ``sqlite``: Flower's ``SqlLinkState`` on a file (``flower-superlink --database``),
  whose claim query filters by node in SQL. The simulation process always builds an
  in-memory state, so this is what a deployed SuperLink with ``--database`` pays.

Combinations whose nodes x messages exceed ``--max-scan`` (default 25 million, about
35 s a sweep for ``flower``) are not run and are printed as such.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from flwr.app import Message, RecordDict
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID, TaskType
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run, RunStatus
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid

from fedpers import protocol
from fedpers.strategies import flower_patches

RUN_ID, TASK_ID = 7, 1
STATES = ("flower", "indexed", "sqlite")
FRACTIONS = (0.0, 0.1, 1.0)


def in_memory_run(factory: LinkStateFactory) -> Run:
    """A running run registered directly in an in-memory state, as the simulation does."""
    state = factory.state()
    run = Run(
        run_id=RUN_ID,
        fab_id="",
        fab_version="",
        fab_hash="",
        override_config={},
        pending_at="",
        starting_at="",
        running_at="",
        finished_at="",
        status=RunStatus("running", "", ""),
        flwr_aid="",
        federation_id=NOOP_FEDERATION_ID,
        primary_task_id=TASK_ID,
        bytes_sent=0,
        bytes_recv=0,
        clientapp_runtime=0.0,
    )
    state.run_ids[RUN_ID] = RunRecord(run=run)  # type: ignore[attr-defined]
    state.task_store[TASK_ID] = Task(task_id=TASK_ID, run_id=RUN_ID)  # type: ignore[attr-defined]
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = RUN_ID, TASK_ID, 1
    return run


def sqlite_run(factory: LinkStateFactory) -> Run:
    """A run created through the SQL state's own API."""
    state = factory.state()
    run_id = state.create_run(
        None, None, None, {}, NOOP_FEDERATION_ID, None, None, TaskType.SIMULATION
    )
    run = state.get_run_info(run_ids=[run_id])[0]
    TaskIdentity.run_id, TaskIdentity.node_id = run_id, 1
    TaskIdentity.task_id = int(run.primary_task_id or 0)
    return run


def sweep_seconds(
    kind: str, num_nodes: int, fractions: tuple[float, ...], directory: Path
) -> list[tuple[int, float, int]]:
    """(messages, seconds of one dispatcher sweep, messages delivered) per fraction."""
    database = str(directory / f"{kind}-{num_nodes}.db") if kind == "sqlite" else None
    factory = LinkStateFactory(
        database or FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory()
    )
    with flower_patches.installed_as(kind == "indexed"):
        state = factory.state()
        run = sqlite_run(factory) if database else in_memory_run(factory)
        nodes = list(vce_api._register_nodes(num_nodes, factory))
        grid = InMemoryGrid(state_factory=factory)
        grid.set_run(run)
        results = []
        for fraction in fractions:
            count = round(fraction * num_nodes)
            ids = grid.push_messages(
                [
                    Message(content=RecordDict(), message_type=protocol.QUERY_INFO, dst_node_id=n)
                    for n in nodes[:count]
                ]
            )
            start = time.perf_counter()
            delivered = sum(len(state.get_message_ins(node_id=n, limit=1)) for n in nodes)
            results.append((count, time.perf_counter() - start, delivered))
            state.delete_messages(set(ids))
    return results


def main(argv: list[str] | None = None) -> list[dict[str, float | int | str]]:
    """Time one sweep per (state, nodes, messages); returns the rows printed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="100,1000,5000,10000")
    parser.add_argument("--states", default=",".join(STATES))
    parser.add_argument("--max-scan", type=float, default=25e6)
    args = parser.parse_args(argv)
    try:
        sizes = [int(n) for n in args.nodes.split(",") if n.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        parser.error(f"--nodes needs positive integers, e.g. 100,1000; got {args.nodes!r}")
    states = [s.strip() for s in args.states.split(",") if s.strip()]
    if not states or set(states) - set(STATES):
        parser.error(f"--states takes some of {','.join(STATES)}; got {args.states!r}")
    rows: list[dict[str, float | int | str]] = []
    print("| LinkState | nodes | messages stored | one dispatcher sweep (s) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="fedpers-linkstate-") as tmp:
        for kind in states:
            for num_nodes in sizes:
                fractions = tuple(
                    f for f in FRACTIONS if kind != "flower" or num_nodes**2 * f <= args.max_scan
                )
                skipped = [round(f * num_nodes) for f in FRACTIONS if f not in fractions]
                for count, seconds, delivered in sweep_seconds(
                    kind, num_nodes, fractions, Path(tmp)
                ):
                    if delivered != count:
                        raise RuntimeError(f"{kind}: {delivered} of {count} messages delivered")
                    rows.append(
                        {"state": kind, "nodes": num_nodes, "messages": count, "seconds": seconds}
                    )
                    print(f"| {kind} | {num_nodes} | {count} | {seconds:.3f} |", flush=True)
                for count in skipped:
                    print(f"| {kind} | {num_nodes} | {count} | not run (> --max-scan) |")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
