"""The in-process double on the wire: each message and reply through Flower's own encoding
(``InProcessGrid(wire=True)``, ``OnTheWire``), which the scripts' tests run on."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedpers.simulations.grid import InProcessGrid, on_the_wire
from tests.simulations.conftest import InProcessSimulation, OnTheWire, assert_same_run

BASE = {
    "dataset": "digits",
    "num-clients": 6,
    "fraction-train": 0.5,
    "num-rounds": 2,
    "epochs": 1,
    "head-epochs": 1,
}


def _writes_into_what_it_got(message: Message, context: Context) -> Message:
    """An app that trains in place on the arrays it received, and replies with them."""
    received = message.content.array_records["arrays"]["w"]
    weights = received.numpy()
    weights += 1.0
    reply = RecordDict({"arrays": ArrayRecord({"w": Array(weights)})})
    return Message(reply, reply_to=message)


@pytest.mark.parametrize("wire", [False, True])
def test_a_node_replies_to_what_it_got_on_and_off_the_wire(wire: bool) -> None:
    sent = np.arange(4.0)
    grid = InProcessGrid(_writes_into_what_it_got, {}, 2, wire=wire)
    message = Message(
        RecordDict({"arrays": ArrayRecord({"w": Array(sent.copy())}), "c": ConfigRecord()}),
        dst_node_id=grid.node_of(0),
        message_type="train",
    )
    (reply,) = grid.send_and_receive([message])
    np.testing.assert_array_equal(reply.content.array_records["arrays"]["w"].numpy(), sent + 1)
    assert reply.metadata.reply_to_message_id == message.metadata.message_id
    # Array holds bytes: the app's in-place write reaches nothing of the server's either
    # way; on the wire the message it got was decoded from bytes of its own.
    np.testing.assert_array_equal(message.content.array_records["arrays"]["w"].numpy(), sent)


def test_a_message_on_the_wire_keeps_its_content_and_addressing() -> None:
    InProcessGrid(lambda m, c: m, {}, 1)  # sets the sender's identity, as a ServerApp
    content = RecordDict(
        {
            "arrays": ArrayRecord({"w": Array(np.linspace(-1, 1, 7, dtype=np.float32))}),
            "config": ConfigRecord({"round": 3, "lr": 0.05, "ids": [1, 2], "name": "x"}),
        }
    )
    message = Message(content, dst_node_id=1007, message_type="train")
    again = on_the_wire(message)
    assert again is not message
    assert again.metadata.dst_node_id == 1007
    assert again.metadata.message_type == "train"
    assert dict(again.content["config"]) == dict(content["config"])
    got = again.content.array_records["arrays"]["w"].numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, content.array_records["arrays"]["w"].numpy())


def _digest(directory: Path) -> str:
    """The final arrays (not the checkpoint's own token and digests, which name the run)."""
    with np.load(directory / "checkpoint.npz") as stored:
        digest = hashlib.sha256()
        for name in sorted(n for n in stored.files if not n.startswith("__")):
            digest.update(name.encode() + np.ascontiguousarray(stored[name]).tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize(
    "overrides",
    [
        {"algorithm": "fedrep"},
        {"algorithm": "fedgmm", "dataset": "mixture"},
        {"algorithm": "sheaf-frl"},
    ],
    ids=["fedrep", "fedgmm", "sheaf-frl"],
)
def test_a_run_on_the_wire_is_the_run_off_it(tmp_path: Path, overrides: dict[str, Any]) -> None:
    """No ClientApp or strategy leans on sharing objects with the other side: the same
    rounds and summary, and the same final arrays bit for bit."""
    run = {**BASE, **overrides, "run-name": "run"}
    off = InProcessSimulation(echo=lambda line: None).run(
        {**run, "results-dir": str(tmp_path / "off")}
    )
    on = OnTheWire(echo=lambda line: None)
    wired = on.run({**run, "results-dir": str(tmp_path / "on")})
    assert on.grid is not None
    assert on.grid.wire
    assert_same_run(off, wired)
    assert _digest(off) == _digest(wired)
