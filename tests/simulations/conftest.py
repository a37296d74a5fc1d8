"""Fixtures for tests that start real Flower processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fedpers.simulations.launch import LocalSimulation, processes_with_home


@pytest.fixture(scope="session")
def simulation() -> Iterator[LocalSimulation]:
    """One local simulation SuperLink for the session; checks nothing is left after."""
    lines: list[str] = []
    with LocalSimulation(echo=lines.append) as sim:
        yield sim
    assert processes_with_home(sim.home) == []
