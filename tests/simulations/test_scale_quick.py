"""The scale benchmark's --quick form: it measures, through Flower, what it says."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpers.simulations import scale

pytestmark = pytest.mark.flower


def test_scale_quick_writes_the_measurements(tmp_path: Path) -> None:
    summary = scale.main(["--out", str(tmp_path), "--quick"])
    measured = summary["clients"]["200"]
    assert measured["clients_per_round"] == 20
    for key in ("round_seconds", "plain_loop_seconds", "startup_seconds", "peak_pss_mb"):
        assert measured[key] > 0
    expected = measured["round_seconds"] / measured["plain_loop_seconds"]
    assert measured["ratio"] == pytest.approx(expected)
    # the start-up's parts are measured from the same clock and add up to it
    parts = [
        measured[f"startup_{k}_seconds"]
        for k in ("to_serverapp", "nodes", "partition_query", "initial_model")
    ]
    assert all(p >= 0 for p in parts)
    assert sum(parts) == pytest.approx(measured["startup_seconds"])
    # The process tree holds at least the SuperLink, the simulation and two torch actors.
    assert 500 < measured["peak_pss_mb"] < 8192
    # the simulation process (ServerApp, LinkState, node contexts) is part of the tree
    assert 100 < measured["simulation_process_rss_mb"] < measured["peak_rss_mb"]
    assert "| 200 | 20 |" in (tmp_path / "table.md").read_text()
