"""What stops a local simulation's processes (``launch.kill_processes_with_home``), on
processes made here: a process carrying the simulation's FLWR_HOME, and one beside it in
its process group that carries none (as Ray's agents, found alive after a stop once)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from fedpers.simulations.launch import kill_processes_with_home, processes_with_home


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_every_process_with_the_home_and_its_group_is_killed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k != "FLWR_HOME"}
    pids = tmp_path / "pids"
    # a session of its own: sh, one sleep with FLWR_HOME=home, one without it
    leader = subprocess.Popen(
        [
            "sh",
            "-c",
            f'FLWR_HOME="{home}" sleep 300 & a=$!; sleep 300 & b=$!; echo "$a $b" > "{pids}"; wait',
        ],
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (pids.is_file() and pids.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        with_home, without = (int(p) for p in pids.read_text().split())
        # forked at once, FLWR_HOME in its environment once it has exec'd sleep
        while processes_with_home(home) != [with_home] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_with_home(home) == [with_home]
        assert kill_processes_with_home(home) == []
        leader.wait(timeout=10)
        deadline = time.monotonic() + 10
        while (_alive(with_home) or _alive(without)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(with_home)
        assert not _alive(without)  # no FLWR_HOME, but in the group of one that had it
    finally:
        if leader.poll() is None:
            os.killpg(leader.pid, 9)
            leader.wait()


def test_nothing_outside_the_homes_groups_is_touched(tmp_path: Path) -> None:
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        assert kill_processes_with_home(tmp_path / "nobody") == []
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
