"""Real `flwr run` simulations on the Ray backend: a stopped one leaves no process.

What a run writes is checked in process (test_run_outputs.py); every script's test
sends its first run through `flwr run` too, and the scale benchmark's quick form runs
200 virtual nodes through it."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpers.simulations.launch import LocalSimulation, processes_with_home

pytestmark = pytest.mark.flower


def test_a_stopped_simulation_leaves_no_process(tmp_path: Path) -> None:
    with LocalSimulation(echo=lambda line: None) as sim:
        superlink = sim.process
        assert superlink is not None
        assert processes_with_home(sim.home) != []
    assert processes_with_home(sim.home) == []
    assert superlink.poll() is not None
