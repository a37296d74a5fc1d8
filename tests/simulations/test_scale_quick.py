"""The scale benchmark's --quick form: it measures, on Flower's engine through a real
`flwr run` and on the batched engine in a process of its own, what it says (Flower's
engine in `make twin-test`; `make test` measures the batched engine alone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedpers.simulations import scale
from tests.helpers import twins_through_flower

pytestmark = pytest.mark.flower


@pytest.mark.twin
def test_scale_quick_writes_the_measurements(tmp_path: Path) -> None:
    # make test (FEDPERS_FLOWER_TWINS=0) measures the batched engine alone; make
    # twin-test both, Flower's through a real flwr run
    if not twins_through_flower():
        summary = scale.main(["--out", str(tmp_path), "--quick", "--engines", "batched"])
        _check_engine(summary, "batched")
        assert (tmp_path / "table.md").read_text().count("| 200 | 20 |") == 1
        return
    summary = scale.main(["--out", str(tmp_path), "--quick"])
    assert summary["clients"] == summary["engines"]["flower"]["clients"]  # kept where it was
    for engine in ("flower", "batched"):
        _check_engine(summary, engine)
    flower = summary["engines"]["flower"]["clients"]["200"]
    # the start-up's parts are measured from the same clock and add up to it
    parts = [
        flower[f"startup_{k}_seconds"]
        for k in ("to_serverapp", "nodes", "partition_query", "initial_model")
    ]
    assert all(p >= 0 for p in parts)
    assert sum(parts) == pytest.approx(flower["startup_seconds"])
    # The process tree holds at least the SuperLink, the simulation and two torch actors.
    assert 500 < flower["peak_pss_mb"] < 8192
    # the simulation process (ServerApp, LinkState, node contexts) is part of the tree
    assert 100 < flower["simulation_process_rss_mb"] < flower["peak_rss_mb"]
    table = (tmp_path / "table.md").read_text()
    assert table.count("| 200 | 20 |") == 2


def _check_engine(summary: dict[str, Any], engine: str) -> None:
    measured = summary["engines"][engine]["clients"]["200"]
    assert measured["clients_per_round"] == 20
    for key in ("round_seconds", "plain_loop_seconds", "startup_seconds", "peak_rss_mb"):
        assert measured[key] > 0, (engine, key)
    expected = measured["round_seconds"] / measured["plain_loop_seconds"]
    assert measured["ratio"] == pytest.approx(expected)
    # 20 clients x 100 samples x (5 head epochs + 1 body epoch) of the 40-128-64-10 MLP
    assert 0.3 < measured["round_gflop"] < 0.6
    assert 0 < measured["machine_share"] < 1
    # Flower's engine: a process tree; the batched engine: one process, torch and data
    assert 100 < measured["peak_rss_mb"] < 8192
    assert summary["machine"]["matmul_gflops"] > 1
