"""fedpers' changes inside Flower (``strategies.flower_patches``) answer as Flower does.

The per-node LinkState index. Oracle: Flower's own
``InMemoryLinkState.get_message_ins``/``store_message_ins``, kept by ``flower_patches``
when it installs, run on a twin state that receives the same operations. Random
sequences of stores (to known and unknown nodes, with short and long lifetimes), asks
(limits 1, 2 or none; run filter or not), deletions and clock jumps that expire
messages.

The run-config cache. Oracle: Flower's ``get_fused_config_from_dir`` reading the file.
"""

from __future__ import annotations

import datetime as dt
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Message, RecordDict
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import LinkStateFactory, in_memory_linkstate
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.superlink.federation import NoOpFederationManager

from fedpers.simulations.launch import PROJECT
from fedpers.simulations.linkstate_cost import RUN_ID, in_memory_run
from fedpers.strategies import flower_patches


@pytest.fixture
def indexed() -> Iterator[None]:
    with flower_patches.installed_as(True):
        yield


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """Flower's clock, shifted by ``shift`` seconds (for both modules that read it)."""
    shift = {"seconds": 0.0}

    def now() -> dt.datetime:
        return dt.datetime.now(tz=dt.UTC) + dt.timedelta(seconds=shift["seconds"])

    monkeypatch.setattr(in_memory_linkstate, "now", now)
    monkeypatch.setattr(flower_patches, "now", now)
    return shift


def _state(num_nodes: int) -> tuple[Any, list[int]]:
    factory = LinkStateFactory(
        FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory()
    )
    in_memory_run(factory)
    return factory.state(), list(vce_api._register_nodes(num_nodes, factory))


def _message(node: int, message_id: str, ttl: float) -> Message:
    message = Message(RecordDict(), dst_node_id=node, message_type="query.info", ttl=ttl)
    message.metadata.__dict__["_message_id"] = message_id
    message.metadata.__dict__["_run_id"] = RUN_ID
    return message


@pytest.mark.parametrize("seed", range(6))
def test_indexed_state_answers_as_the_full_scan(
    indexed: None, clock: dict[str, float], seed: int
) -> None:
    rng = random.Random(seed)
    original_get = getattr(InMemoryLinkState, flower_patches._ORIGINAL)
    original_store = InMemoryLinkState.store_message_ins.__wrapped__  # type: ignore[attr-defined]
    patched, nodes = _state(12)
    oracle, oracle_nodes = _state(12)
    # the twins got different random node ids: map one onto the other
    twin = dict(zip(nodes, oracle_nodes, strict=True))
    stored: list[str] = []
    answers = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.45:
            node = rng.choice([*nodes, 999])  # 999 is no node: both must refuse it
            message_id, ttl = str(uuid.UUID(int=rng.getrandbits(128))), rng.choice([5.0, 3600.0])
            got = patched.store_message_ins(_message(node, message_id, ttl))
            expected = original_store(oracle, _message(twin.get(node, 999), message_id, ttl))
            assert got == expected
            if got:
                stored.append(got)
        elif op < 0.85:
            node = rng.choice(nodes)
            limit = rng.choice([1, 2, None])
            run_id = rng.choice([None, RUN_ID, RUN_ID + 1])
            got_ids = [
                m.metadata.message_id
                for m in patched.get_message_ins(node_id=node, limit=limit, run_id=run_id)
            ]
            expected_ids = [
                m.metadata.message_id
                for m in original_get(oracle, node_id=twin[node], limit=limit, run_id=run_id)
            ]
            assert got_ids == expected_ids
            answers += len(got_ids)
        elif op < 0.95 and stored:
            chosen = set(rng.sample(stored, k=min(len(stored), rng.randint(1, 3))))
            patched.delete_messages(chosen)
            oracle.delete_messages(chosen)
        else:
            clock["seconds"] += rng.choice([0.0, 6.0])  # expires the 5 s messages
    assert answers > 20  # the sequences did deliver messages, not only refuse


def test_sweep_delivers_each_message_once_in_store_order(indexed: None) -> None:
    state, nodes = _state(50)
    ids = [state.store_message_ins(_message(n, str(uuid.uuid4()), 3600.0)) for n in nodes * 2]
    first = [m.metadata.message_id for n in nodes for m in state.get_message_ins(n, limit=1)]
    second = [m.metadata.message_id for n in nodes for m in state.get_message_ins(n, limit=1)]
    assert first == ids[:50]
    assert second == ids[50:]
    assert all(not state.get_message_ins(n, limit=None) for n in nodes)


@pytest.mark.parametrize("simulation", [True, False])
def test_the_server_app_installs_it_where_a_linkstate_lives(simulation: bool) -> None:
    """A simulation's process has imported Flower's in-memory LinkState before the
    ServerApp: the index is installed, once. A deployed ServerApp's process has not:
    nothing is installed, nor imported."""
    script = (
        ("import flwr.server.superlink.linkstate.in_memory_linkstate\n" if simulation else "")
        + "import sys\n"
        + "import strategies.server_app\n"
        + "held = 'flwr.server.superlink.linkstate.in_memory_linkstate' in sys.modules\n"
        + "if held:\n"
        + "    from strategies import flower_patches as x\n"
        + "    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState\n"
        + "    assert x.installed() and x.install()\n"
        + "    assert not hasattr(InMemoryLinkState.store_message_ins.__wrapped__, '__wrapped__')\n"
        + "print(held)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=PROJECT, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(simulation)


def test_cached_run_config_equals_flowers_and_follows_the_file(tmp_path: Path) -> None:
    """Oracle: Flower's own ``get_fused_config_from_dir``, read afresh each call."""
    from flwr.common.config import get_fused_config_from_dir

    cached = flower_patches._cached_config(get_fused_config_from_dir)
    pyproject = tmp_path / "pyproject.toml"
    text = (PROJECT / "pyproject.toml").read_text()
    assert "\nseed = 0\n" in text
    pyproject.write_text(text)
    first = cached(tmp_path, {"lr": 0.5})
    assert first == get_fused_config_from_dir(tmp_path, {"lr": 0.5})
    assert (first["lr"], first["seed"]) == (0.5, 0)
    first["lr"] = 99.0  # a caller changing its copy changes nobody else's
    assert cached(tmp_path, {"lr": 0.5})["lr"] == 0.5
    assert cached(tmp_path, {})["lr"] != 0.5  # other overrides, other entry
    pyproject.write_text(text.replace("\nseed = 0\n", "\nseed = 12\n"))  # size changes
    fresh = get_fused_config_from_dir(tmp_path, {})
    assert cached(tmp_path, {}) == fresh
    assert fresh["seed"] == 12
    with pytest.raises(FileNotFoundError):  # no pyproject: Flower's own error
        cached(tmp_path / "missing", {})
