"""Real `flwr run` simulations on the Ray backend: a stopped one leaves no process.

What a run writes is checked in process (test_run_outputs.py); one script of each path
through Flower sends its first run through `flwr run` too (tests/simulations/conftest.py),
and the scale benchmark's quick form runs 200 virtual nodes through it."""

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


def test_a_simulation_says_what_it_does_and_removes_its_own_ray_folder(tmp_path: Path) -> None:
    # Before: every run's Ray session folder stayed under the work folder's .ray/ (28
    # after an afternoon of runs). A simulation that starts its own Ray (no RAY_ADDRESS)
    # now gives it a folder of its own and removes it when it stops.
    lines: list[str] = []
    with LocalSimulation(echo=lines.append) as sim:
        assert sim.ray_tmp is not None
        sim.run(
            {
                "algorithm": "fedavg",
                "dataset": "digits",
                "num-clients": 2,
                "num-rounds": 1,
                "results-dir": str(tmp_path),
                "run-name": "ray-folder",
            }
        )
        sessions = list(sim.ray_tmp.rglob("session_*"))
        assert sessions, f"the run's Ray kept no session in {sim.ray_tmp}"
    assert not sim.ray_tmp.exists()
    # Only its own folder is asserted: simulations on the other xdist worker add and
    # remove theirs in the same parent meanwhile (a fresh clone's make test saw both).
    # What a user sees before round 1 and after the run (before: nothing for a minute,
    # and no word of where the results went)
    assert lines[0] == "starting a local Flower SuperLink for the runs"
    assert lines[1].startswith("SuperLink ready on 127.0.0.1:")
    stages = [line.split(" | ")[2] for line in lines if " | start-up | " in line]
    assert stages == [
        "flwr run: the simulation starts Ray and 2 virtual nodes",
        "waiting for 2 nodes and their partitions",
        "nodes registered, partitions known; choosing the initial model",
        "initial model ready; round 1 starts",
    ]
    assert lines[-1].startswith(f"ray-folder | done | results in {tmp_path / 'ray-folder'} | ")
    assert " s, rounds " in lines[-1]
