"""Where Flower's simulation spends time as the node count grows: its message dispatcher.

    python -m simulations.linkstate_cost [--nodes 100,1000,5000]

Flower 1.42's simulation runtime (``flwr.server.superlink.fleet.vce.vce_api``) hands
messages to the Ray actors from one thread that, every 0.1 s, asks the in-memory
LinkState for the next message of *every* registered node
(``get_message_ins(node_id, limit=1)``); each of those calls scans every stored message
(and re-validates it). One sweep therefore costs nodes x stored messages, whether or not
a node has work. This script builds that LinkState with N nodes, pushes M messages
(10% of the nodes, as a training round, and then one per node, as a query to every node
before round 1) and times one sweep, with no Ray and no fedpers code involved.

It explains the start-up cost of ``simulations.scale`` at 1,000 and 5,000 clients
(fedpers asks every node once which partition it holds, because Flower gives simulated
nodes random ids) and part of its round cost at 5,000 clients. Prints one line per
(nodes, messages).
"""

from __future__ import annotations

import argparse
import sys
import time

from flwr.app import Message, RecordDict
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run, RunStatus
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid

RUN_ID, TASK_ID = 7, 1


def sweep_seconds(num_nodes: int, fractions: tuple[float, ...]) -> list[tuple[int, float, int]]:
    """(messages, seconds of one dispatcher sweep, messages delivered) per fraction."""
    factory = LinkStateFactory(
        FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory()
    )
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
    nodes = list(vce_api._register_nodes(num_nodes, factory))
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    results = []
    for fraction in fractions:
        count = max(1, round(fraction * num_nodes))
        grid.push_messages(
            [
                Message(content=RecordDict(), message_type="query.info", dst_node_id=n)
                for n in nodes[:count]
            ]
        )
        start = time.perf_counter()
        delivered = sum(len(state.get_message_ins(node_id=n, limit=1)) for n in nodes)
        results.append((count, time.perf_counter() - start, delivered))
        state.message_ins_store.clear()  # type: ignore[attr-defined]
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="100,1000,5000")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.nodes.split(",") if n.strip()]
    if not sizes or min(sizes) < 1:
        parser.error(f"--nodes needs positive integers, got {args.nodes!r}")
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = RUN_ID, TASK_ID, 1
    print("| nodes | messages stored | one dispatcher sweep (s) |")
    print("|---|---|---|")
    for num_nodes in sizes:
        for count, seconds, delivered in sweep_seconds(num_nodes, (0.1, 1.0)):
            assert delivered == count, (delivered, count)
            print(f"| {num_nodes} | {count} | {seconds:.3f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
