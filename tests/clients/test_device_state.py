"""A node's state survives a SuperNode restart when the device keeps it."""

from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict

from clients import device_state


def _context(run_id: int, state_dir: Path, state: RecordDict | None = None) -> Context:
    return Context(
        run_id=run_id,
        node_id=5,
        node_config={"partition-id": 2, "state-dir": str(state_dir)},
        state=state if state is not None else RecordDict(),
        run_config={},
    )


def test_state_is_restored_by_a_fresh_node_of_the_same_run_only(tmp_path: Path) -> None:
    head = np.arange(6, dtype=np.float32).reshape(2, 3)
    before = _context(7, tmp_path)
    before.state["fedpers.personal"] = ArrayRecord({"head.weight": Array(head)})
    assert device_state.count_round(before) == 1
    assert device_state.count_round(before) == 2
    device_state.persist(before)

    after = _context(7, tmp_path)  # a restarted SuperNode: empty state
    assert device_state.restore(after)
    np.testing.assert_array_equal(after.state["fedpers.personal"]["head.weight"].numpy(), head)
    assert after.state[device_state.META][device_state.ROUNDS_TRAINED] == 2
    assert device_state.count_round(after) == 3

    other_run = _context(8, tmp_path)
    assert not device_state.restore(other_run)
    assert len(other_run.state) == 0


def test_without_state_dir_nothing_is_written(tmp_path: Path) -> None:
    context = Context(
        run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )
    context.state["x"] = ConfigRecord({"a": 1})
    device_state.persist(context)
    assert not any(tmp_path.iterdir())
    assert not device_state.restore(context)
