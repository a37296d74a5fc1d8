"""Everything a run does holds on the batched engine: screening and the invariants under
faults and a robust aggregation, client-level DP, an exact resume, the results files;
a run that asks for it elsewhere is refused; its Ray shards give what one process gives.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MessageType, RecordDict
from hypothesis import given, settings

from fedpers import protocol
from fedpers.config import ConfigError
from fedpers.reports import read_rounds, read_summary
from fedpers.simulations import equality
from fedpers.simulations.batched import BatchedGrid, chunks, sent_bytes
from fedpers.simulations.inprocess import InProcessSimulation
from fedpers.strategies import server_app
from fedpers.strategies.rounds import RoundFailedError
from tests.helpers import InProcessGrid, run_config

BASE = {
    "dataset": "digits",
    "num-clients": 10,
    "fraction-train": 0.6,
    "num-rounds": 3,
    "epochs": 1,
    "head-epochs": 1,
}


def _serve(directory: Path, grid: Any, values: dict[str, Any]) -> Path:
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=values)
    server_app.main(grid, context)
    return directory / str(values["run-name"])


def _untimed(value: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in value.items() if not k.endswith(("seconds", "_unix"))}


@pytest.mark.parametrize(
    "overrides",
    [
        {"fault-injection": "raise:1@2,sign-flip=5:3,nan:4@1", "aggregation": "trimmed-mean"},
        {"fault-injection": "huge:2,drop:5@2,inflate:6", "aggregation": "median"},
        {"algorithm": "scaffold", "fault-injection": "sign-flip=3:0-1,noise=10:2"},
        {"algorithm": "fedgmm", "dataset": "mixture", "fault-injection": "raise:2@2,non-psd:3"},
    ],
    ids=["trimmed-mean", "median", "scaffold", "fedgmm"],
)
def test_faults_are_screened_on_the_batched_engine_as_client_by_client(
    tmp_path: Path, overrides: dict[str, Any]
) -> None:
    """The same rejections, notes and failures every round, and the same figures to
    1e-5 (float64), whether the round's clients train as one cohort or one by one."""
    run = {**BASE, "algorithm": "fedrep", **overrides, "run-name": "x"}
    alone = equality.outcome(run, tmp_path / "alone", cohort_size=1, dtype="float64")
    together = equality.outcome(run, tmp_path / "together", dtype="float64")
    for a, b in zip(alone["rounds"], together["rounds"], strict=True):
        assert a["rejections"] == b["rejections"]
        assert (a["failures"], a["replies"]) == (b["failures"], b["replies"])
    assert any(record["rejections"] for record in alone["rounds"])  # faults were injected
    assert equality.difference(alone, together) < equality.TOLERANCE


@pytest.mark.parametrize("dp", ["central", "distributed"])
def test_client_level_dp_runs_on_the_batched_engine_with_the_same_accounting(
    tmp_path: Path, dp: str
) -> None:
    """Each member's update clipped (and, distributed, noised) by its own mechanism; the
    releases and epsilon counted as client by client (the noise is secret, so the
    models differ run to run, the accounting does not)."""
    run = {
        **BASE,
        "algorithm": "fedavg",
        "dp": dp,
        "dp-noise-multiplier": 1.0,
        "dp-sampling": "without-replacement",
        "dp-delta": 1e-3,
        "run-name": "x",
    }
    batched = InProcessSimulation().run(
        {**run, "engine": "batched", "results-dir": str(tmp_path / "b")}
    )
    one_by_one = InProcessSimulation().run({**run, "results-dir": str(tmp_path / "a")})
    for a, b in zip(read_rounds(one_by_one), read_rounds(batched), strict=True):
        assert a.server["dp.epsilon"] == b.server["dp.epsilon"]
        assert a.server["dp.releases"] == b.server["dp.releases"]
    assert math.isfinite(read_summary(batched)["final_accuracy"])


@pytest.mark.parametrize("algorithm", ["fedrep", "scaffold", "fedgmm", "sheaf-frl"])
def test_a_resumed_batched_run_equals_the_uninterrupted_one(tmp_path: Path, algorithm: str) -> None:
    """Killed in round 3 (every node fails there), resumed on fresh nodes: every round's
    record and the summary as in the straight run, on the batched engine."""
    state = {
        **BASE,
        "algorithm": algorithm,
        "num-rounds": 4,
        "client-state-dir": str(tmp_path / "s"),
        "engine": "batched",
    }
    if algorithm == "fedgmm":
        state["dataset"] = "mixture"
    straight = InProcessSimulation().run(
        {**state, "results-dir": str(tmp_path / "a"), "run-name": "run"}
    )
    values = run_config(
        **{k.replace("-", "_"): v for k, v in state.items()},
        results_dir=str(tmp_path),
        run_name="run",
    )

    def killed(node: int, message: Any) -> str | None:
        config = message.content.config_records.get(protocol.CONFIG)
        late = config is not None and int(config.get(protocol.ROUND, 0)) >= 3
        return "killed" if message.metadata.message_type == MessageType.TRAIN and late else None

    with pytest.raises(RoundFailedError):
        _serve(tmp_path, BatchedGrid(values, 10, fail=killed), values)
    resumed = _serve(tmp_path, BatchedGrid(values, 10), {**values, "resume": True})
    for a, b in zip(read_rounds(straight), read_rounds(resumed), strict=True):
        assert _untimed(asdict(a)) == _untimed(asdict(b))
    assert _untimed(read_summary(straight)) == _untimed(read_summary(resumed))


def test_a_run_that_asks_for_the_batched_engine_elsewhere_is_refused(tmp_path: Path) -> None:
    """On another grid (Flower's, a deployment's) ``engine = "batched"`` stops the
    ServerApp before it writes anything, naming the key and the fix."""
    values = run_config(
        **{k.replace("-", "_"): v for k, v in BASE.items()},
        engine="batched",
        results_dir=str(tmp_path),
        run_name="x",
    )
    grid = InProcessGrid(lambda m, c: m, values, 10)
    with pytest.raises(ConfigError, match="engine = 'flower' there"):
        _serve(tmp_path, grid, values)
    assert not (tmp_path / "x").exists()


@pytest.mark.flower
def test_ray_shards_give_what_one_process_gives(
    tmp_path: Path, ray_head: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two Ray actors holding half the nodes each (on the session's Ray head) against
    every node in this process: every figure to 1e-9 (float64; the cohorts differ, so
    the sums are reassociated)."""
    for key, value in ray_head.driver_environment().items():
        monkeypatch.setenv(key, value)
    run = {**BASE, "algorithm": "fedrep", "run-name": "x"}
    one = equality.outcome(run, tmp_path / "one", dtype="float64")
    sharded = equality.outcome(run, tmp_path / "two", dtype="float64", workers=2)
    assert equality.difference(one, sharded) < 1e-9
    assert json.dumps(one["rounds"][-1]["rejections"]) == json.dumps(
        sharded["rounds"][-1]["rejections"]
    )


@pytest.mark.flower
def test_ray_shards_answer_for_the_nodes_a_grid_fails(
    tmp_path: Path, ray_head: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grid's ``fail`` hook holds on its Ray shards as in one process: the node it
    fails answers every TRAIN with that error, the round records count it, and every
    message pushed is kept in ``sent``. (The shards once ran every message they were
    given, the failing node's too.)"""
    for key, value in ray_head.driver_environment().items():
        monkeypatch.setenv(key, value)
    base = {k.replace("-", "_"): v for k, v in {**BASE, "fraction-train": 1.0}.items()}
    values = run_config(**base, algorithm="fedrep", engine="batched", results_dir=str(tmp_path))
    records = {}
    for workers in (0, 2):
        grid = BatchedGrid(values, 10, workers=workers, fail=None)
        failing = grid.node_of(4)
        grid.fail = lambda node, m, failing=failing: (
            "killed" if node == failing and m.metadata.message_type == MessageType.TRAIN else None
        )
        try:
            run = {**values, "run-name": f"w{workers}"}
            records[workers] = read_rounds(_serve(tmp_path, grid, run))
        finally:
            grid.close()
        trains = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
        assert len(trains) == 10 * len(records[workers])
    for alone, sharded in zip(records[0], records[2], strict=True):
        assert (alone.failures, alone.replies) == (sharded.failures, sharded.replies) == (1, 9)
        assert alone.evaluate.keys() == sharded.evaluate.keys()
        for key, value in alone.evaluate.items():
            assert value == pytest.approx(sharded.evaluate[key], abs=1e-5)


@pytest.mark.flower
def test_shards_on_a_ray_of_their_own_remove_its_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without RAY_ADDRESS the grid starts a Ray on this machine for its shards, with a
    folder of its own for the session (logs, sockets), removed when the grid closes (it
    stayed under the work folder's .ray/ before, one per run)."""
    import ray

    from fedpers.simulations import batched

    if ray.is_initialized():  # an earlier test's driver, on the session's Ray head
        ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    values = run_config(algorithm="fedrep", dataset="digits", num_clients=4, engine="batched")
    folder = batched._own_ray_directory()
    grid = BatchedGrid(values, 4, workers=2)
    try:
        assert list(folder.glob("session_*")), f"no Ray session in {folder}"
    finally:
        grid.close()
    assert not folder.exists()


def _sized(sizes: list[int]) -> list[Message]:
    """Messages carrying ``sizes[i]`` bytes of arrays each (a uint8 array; none for 0)."""
    messages = []
    for size in sizes:
        arrays = {"w": Array(np.zeros(size, np.uint8))} if size else {}
        content = RecordDict({protocol.ARRAYS: ArrayRecord(arrays)})
        messages.append(Message(content, dst_node_id=1, message_type=MessageType.TRAIN))
    return messages


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5_000), max_size=40),
    size=st.integers(1, 8),
    budget=st.integers(1, 20_000),
)
def test_a_cohort_is_cut_at_its_clients_or_its_bytes(
    sizes: list[int], size: int, budget: int
) -> None:
    """Any batch: the chunks are the batch in order; each holds at most ``size``
    messages and at most ``budget`` bytes of arrays unless it is one message alone; and
    no chunk could have taken its successor's first message."""
    batch = _sized(sizes)
    cut = list(chunks(batch, size, budget))
    assert [m for chunk in cut for m in chunk] == batch
    held = [sum(sent_bytes(m) for m in chunk) for chunk in cut]
    for chunk, total in zip(cut, held, strict=True):
        assert chunk
        assert len(chunk) <= size
        assert total <= budget or len(chunk) == 1
    for chunk, total, after in zip(cut, held, cut[1:], strict=False):
        assert len(chunk) == size or total + sent_bytes(after[0]) > budget
    assert [sent_bytes(m) for m in batch] == [_npy_bytes(s) if s else 0 for s in sizes]


def _npy_bytes(size: int) -> int:
    """What ``np.save`` writes for ``size`` uint8 values: an Array's bytes."""
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(size, np.uint8), allow_pickle=False)
    return len(buffer.getvalue())


def test_a_cohort_cut_by_its_bytes_gives_what_one_cohort_gives(tmp_path: Path) -> None:
    """IFCA (every learner sent to every client) with cohorts cut at 0.05 MB, less than
    one client's learners (so every client alone), against one cohort: the same figures
    and states to 1e-5 (float64); another seed is far from them."""
    run = {**BASE, "algorithm": "ifca", "mixture-learners": 3, "num-rounds": 2, "run-name": "x"}
    whole = equality.outcome(run, tmp_path / "whole", dtype="float64")
    cut = equality.outcome(run, tmp_path / "cut", dtype="float64", cohort_mb=0.05)
    assert sum(v.nbytes for v in whole["state"].values()) > 0.05 * 2**20  # each client alone
    assert equality.difference(whole, cut) < equality.TOLERANCE
    swapped = equality.outcome(
        {**run, "seed": 1}, tmp_path / "seed1", dtype="float64", cohort_mb=0.05
    )
    assert equality.difference(whole, swapped) > equality.TOLERANCE
