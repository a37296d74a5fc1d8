"""``send_and_collect``: the ServerApp's wait between pulls follows what a pull cost the
processor, not how long it waited."""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest

from fedpers.strategies import federation


class _SlowGrid:
    """A deployed grid whose first pull waits ``wait`` seconds (for a reply's objects:
    Flower's backoff) and returns nothing, and whose second pull returns the reply."""

    def __init__(self, wait: float) -> None:
        self.wait = wait
        self.pulls = 0

    def push_messages(self, messages: list[Any]) -> list[str]:
        return ["m1"]

    def pull_messages(self, ids: Any) -> list[Any]:
        self.pulls += 1
        if self.pulls == 1:
            threading.Event().wait(self.wait)  # asleep, not working: no processor time
            return []
        reply = types.SimpleNamespace(metadata=types.SimpleNamespace(reply_to_message_id="m1"))
        return [reply]


def test_a_pull_that_waited_does_not_lengthen_the_next_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits: list[float] = []
    monkeypatch.setattr(federation.time, "sleep", waits.append)
    replies = federation.send_and_collect(_SlowGrid(wait=0.3), [], timeout=60)  # type: ignore[arg-type]
    assert len(replies) == 1
    # Wall time would have asked for 9 x 0.3 s; the pull used (almost) no processor.
    assert waits == [federation.PULL_INTERVAL]


class _RecordingGrid:
    """Keeps what was pushed; never answers."""

    def __init__(self) -> None:
        self.pushed: list[Any] = []

    def push_messages(self, messages: list[Any]) -> list[str]:
        self.pushed += messages
        return [f"m{i}" for i in range(len(messages))]

    def pull_messages(self, ids: Any) -> list[Any]:
        return []


def test_a_message_expires_when_its_round_stops_waiting() -> None:
    """Its created_at + ttl is the exchange's deadline (a node back after a cut link must
    not fetch a round that is over and train on it); built a while before it is sent,
    it still lives until then."""
    from flwr.app import Message, RecordDict

    messages = [Message(content=RecordDict(), message_type="train", dst_node_id=n) for n in (1, 2)]
    for message in messages:
        message.metadata.__dict__["_created_at"] -= 5.0  # built 5 s before the send
    grid = _RecordingGrid()
    timeout = 0.05
    before = federation.time.time()
    federation.send_and_collect(grid, messages, timeout=timeout)  # type: ignore[arg-type]
    after = federation.time.time()
    assert len(grid.pushed) == 2
    for message in grid.pushed:
        expiry = message.metadata.created_at + message.metadata.ttl
        grace = federation.EXPIRY_GRACE
        assert before + timeout + grace - 1e-6 <= expiry <= after + timeout + grace + 1e-6


def test_without_a_timeout_flower_s_ttl_stays() -> None:
    from flwr.app import Message, RecordDict

    message = Message(content=RecordDict(), message_type="train", dst_node_id=1)
    flower_ttl = message.metadata.ttl
    federation.expire_with_the_round([message], float("inf"))
    assert message.metadata.ttl == flower_ttl
    federation.expire_with_the_round([message], 1e9)  # never longer than Flower's
    assert message.metadata.ttl == flower_ttl


def test_a_run_is_a_simulation_by_its_grid_not_by_what_the_process_imported() -> None:
    """Flower 1.42's deployed ``flwr-serverapp`` imports the in-memory LinkState module
    too (checked in a fresh interpreter), so that import cannot tell the ServerApp it is
    deployed: before 2026-12-05 a deployed run therefore kept Flower's 1 s object backoff
    and a simulation's 5 s "settled" node count. The grid tells: Flower's ``HttpGrid``
    is a deployment, anything else (its in-memory grid, fedpers' in-process grid) a
    simulation."""
    import subprocess
    import sys

    from flwr.superlink.grid.http_grid import HttpGrid
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    from fedpers.simulations.grid import InProcessGrid
    from fedpers.strategies import server_app

    check = (
        "import sys; from flwr.superlink.cli import flwr_serverapp; "
        "print('flwr.server.superlink.linkstate.in_memory_linkstate' in sys.modules)"
    )
    imported = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert imported == "True"  # why the import is no evidence
    assert not server_app.simulated(HttpGrid.__new__(HttpGrid))
    assert server_app.simulated(InMemoryGrid.__new__(InMemoryGrid))
    assert server_app.simulated(InProcessGrid.__new__(InProcessGrid))
