"""Fixtures for tests that start real Flower processes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from simulations.launch import LocalSimulation


def processes_with_home(home: Path) -> list[int]:
    """PIDs of live processes whose environment has FLWR_HOME=home (our descendants:
    SuperLink, SuperExec, ServerApp, simulation, Ray workers all inherit it)."""
    marker = f"FLWR_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if state != "Z" and marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="session")
def simulation() -> Iterator[LocalSimulation]:
    """One local simulation SuperLink for the session; checks nothing is left after."""
    lines: list[str] = []
    with LocalSimulation(echo=lines.append) as sim:
        yield sim
    assert processes_with_home(sim.home) == []
