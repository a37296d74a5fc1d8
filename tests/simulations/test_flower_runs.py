"""Real `flwr run` simulations on the Ray backend: a stopped one leaves no process.

What a run writes is checked in process (test_run_outputs.py); one script of each path
through Flower sends its first run through `flwr run` too (tests/simulations/conftest.py),
and the scale benchmark's quick form runs 200 virtual nodes through it. What a run says
before round 1 and after it, and that its own Ray session folder is removed, is checked
on the interrupted and resumed script (test_interrupt.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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


def test_a_script_killed_by_sigterm_stops_its_simulation_first(tmp_path: Path) -> None:
    # Before: SIGTERM ended the script and left its SuperLink (and, mid-run, its
    # simulation and Ray processes) running, orphaned.
    script = (
        "import sys, time\n"
        "from fedpers.simulations.launch import LocalSimulation\n"
        "with LocalSimulation(echo=lambda line: None) as sim:\n"
        "    print(sim.process.pid, sim.home, flush=True)\n"
        "    time.sleep(120)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert child.stdout is not None
        pid, home = child.stdout.readline().split()
        assert processes_with_home(Path(home)) != []
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
    assert processes_with_home(Path(home)) == []
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)
