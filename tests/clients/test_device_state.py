"""A node's state survives a SuperNode restart or a resumed run when it is kept."""

from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict

from fedpers.clients import device_state
from fedpers.config import RunConfig
from tests.helpers import run_config


class Node(Context):
    """A node's context with the run configuration its ClientApp would parse."""

    run: RunConfig


def _context(tmp_path: Path, run_name: str = "exp", *, node_dir: bool = True) -> Node:
    node_config: dict = {"partition-id": 2}
    values = run_config(run_name=run_name)
    if node_dir:
        node_config["state-dir"] = str(tmp_path)
    else:
        values["client-state-dir"] = str(tmp_path)
    node = Node(run_id=7, node_id=5, node_config=node_config, state=RecordDict(), run_config=values)
    node.run = RunConfig.from_mapping(values)
    return node


def _head(context: Context) -> np.ndarray:
    return context.state["fedpers.personal"]["head.weight"].numpy()


def test_a_fresh_node_restores_the_newest_snapshot_before_its_round(tmp_path: Path) -> None:
    node = _context(tmp_path)
    for server_round in (1, 2, 3):
        node.state["fedpers.personal"] = ArrayRecord(
            {"head.weight": Array(np.full((2, 2), server_round, np.float32))}
        )
        device_state.count_round(node)
        device_state.persist(node.run, node, server_round=server_round)
    assert sorted(device_state.snapshots(node.run, node)) == [2, 3]  # only the last two are kept

    resumed = _context(tmp_path)  # training round 3 again after a crash: state of round 2
    assert device_state.restore(resumed.run, resumed, before_round=3) == 2
    np.testing.assert_array_equal(_head(resumed), np.full((2, 2), 2, np.float32))
    assert resumed.state[device_state.META][device_state.ROUNDS_TRAINED] == 2

    later = _context(tmp_path)
    assert device_state.restore(later.run, later, before_round=10) == 3
    np.testing.assert_array_equal(_head(later), np.full((2, 2), 3, np.float32))
    assert not device_state.restore(later.run, later, before_round=10)  # not empty any more

    dropped = _context(tmp_path)
    assert not device_state.restore(dropped.run, dropped, before_round=2)  # round 1 was dropped
    other = _context(tmp_path, "other-run")
    assert not device_state.restore(other.run, other, before_round=10)


def test_simulation_keeps_state_through_the_run_config(tmp_path: Path) -> None:
    node = _context(tmp_path, node_dir=False)
    node.state["x"] = ConfigRecord({"a": 1})
    device_state.persist(node.run, node, server_round=1)
    fresh = _context(tmp_path, node_dir=False)
    assert device_state.restore(fresh.run, fresh, before_round=2) == 1
    assert fresh.state["x"]["a"] == 1


def test_without_a_directory_nothing_is_written(tmp_path: Path) -> None:
    values = run_config()
    context = Context(
        run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config=values
    )
    run = RunConfig.from_mapping(values)
    context.state["x"] = ConfigRecord({"a": 1})
    device_state.persist(run, context, server_round=1)
    assert not any(tmp_path.iterdir())
    assert not device_state.restore(run, context, before_round=5)
