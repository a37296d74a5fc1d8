"""Fixtures for the scripts' tests: a real local simulation SuperLink, and its in-process
double, which runs a script's experiments without Flower's processes or Ray.

The double runs the same ServerApp ``main`` and the same ClientApp on the same run
config as ``flwr run``, each message and reply through Flower's own encoding
(``OnTheWire``: protobuf bytes and back, as between SuperLink and SuperNode); a run
writes what the real run writes: the same rounds, byte counts and rejections, every
float to 1e-9 (the replies are summed in another order), a client error's text aside.
The tests check that on the configuration of a script's first run, cut to
``FLOWER_ROUNDS`` rounds, which goes through a real ``flwr run`` and again in process
(``through_flower``), for one script of each path through Flower: the linear family
(no torch), FedRep's image table (``test_interrupt``, interrupted and resumed), FedGMM
with unseen clients, Sheaf-FRL's relayed pilots, client-side privacy. The other
scripts' tests run all their runs in process on the wire (``on_the_wire``): a real run
costs about 20 processor-seconds before its first round (the CLI, the simulation
process, Ray and its actors' imports; docs/benchmarks.md) and 0.3-0.7 s a round on top
of the work, and ``make test`` has 12 minutes on 2 cores. The cut keeps everything a run
does once (start-up, the partition query, the initial vote, a round that follows
another, the last round's final tests, the summary) at a tenth of the rounds of the
longest quick forms.

The real twins (marker ``twin``) run in ``make twin-test``, which ``.ci/run`` runs after
``make test``; ``make test`` sets ``FEDPERS_FLOWER_TWINS=0`` and runs those scripts'
tests with every run in process on the wire (their Flower twins cost about 90
worker-seconds of ``make test``'s 12 minutes), the test of FedRep's image table
interrupted and resumed through Flower staying in it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpers.reports import read_rounds, read_summary
from fedpers.simulations import launch
from fedpers.simulations.inprocess import InProcessSimulation
from fedpers.simulations.launch import LocalSimulation, processes_with_home
from fedpers.simulations.ray_cluster import RayHead
from tests.helpers import twins_through_flower


@pytest.fixture(scope="session")
def simulation(ray_head: RayHead) -> Iterator[LocalSimulation]:
    """One local simulation SuperLink for the session, its runs on the session's Ray
    head (tests/conftest.py); checks nothing of it is left after."""
    lines: list[str] = []
    # One ClientApp actor a run: the tests' runs are small, and a second actor's imports
    # (torch, about 10 s of processor time) competed with the other xdist worker.
    with LocalSimulation(
        echo=lines.append,
        cpus_per_client=ray_head.cpus,
        environment=ray_head.driver_environment(),
    ) as sim:
        yield sim
    assert processes_with_home(sim.home) == []


FLOWER_ROUNDS = 2  # rounds of the first run's configuration that go through Flower


class OnTheWire(InProcessSimulation):
    """``InProcessSimulation`` whose per-client runs send every message and reply
    through Flower's encoding (``InProcessGrid``'s ``wire``)."""

    wire = True


class FirstRunThroughFlower(OnTheWire):
    """Every run in process; the first one's configuration, cut to ``FLOWER_ROUNDS``
    rounds, also through ``real`` (``flwr run`` on Ray) into
    ``<results-dir>/through-flower/`` and again in process into
    ``<results-dir>/through-flower/in-process/`` (its twin). ``twins`` holds the (real,
    in-process) directories of that run. Every instance made with one ``claim`` lock
    and ``twins`` list shares them: a script that makes several simulations still sends
    one run through Flower."""

    def __init__(
        self,
        real: LocalSimulation,
        *,
        claim: threading.Lock | None = None,
        twins: list[tuple[Path, Path]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.real = real
        self.twins: list[tuple[Path, Path]] = [] if twins is None else twins
        self._claimed = threading.Lock() if claim is None else claim  # held for good

    def run(self, overrides: Mapping[str, Any], **kwargs: Any) -> Path:
        directory = super().run(overrides, **kwargs)
        if self._claimed.acquire(blocking=False):
            rounds = min(FLOWER_ROUNDS, int(launch.resolved_config(overrides).num_rounds))
            cut = {
                **overrides,
                "num-rounds": rounds,
                "results-dir": str(directory.parent / "through-flower"),
            }
            # on the session's actors (its cpus_per_client), whatever the script asked
            resources = {k: v for k, v in kwargs.items() if k != "cpus_per_client"}
            real = self.real.run(cut, **resources)
            twin = {**cut, "results-dir": str(real.parent / "in-process")}
            self.twins.append((real, super().run(twin, **kwargs)))
        return directory


@contextlib.contextmanager
def first_run_through_flower(simulation: LocalSimulation) -> Iterator[list[tuple[Path, Path]]]:
    """While open, a script's runs run in process, and its first run's configuration,
    cut to ``FLOWER_ROUNDS`` rounds, goes through ``simulation`` (a real ``flwr run``)
    and again in process. Yields the (real, twin) directories, for
    ``assert_through_flower``."""
    twins: list[tuple[Path, Path]] = []
    kind = functools.partial(FirstRunThroughFlower, simulation, claim=threading.Lock(), twins=twins)
    with simulations_in_process(kind):
        yield twins


@contextlib.contextmanager
def script_runs(request: pytest.FixtureRequest) -> Iterator[list[tuple[Path, Path]]]:
    """``first_run_through_flower`` on the session's SuperLink where the twins go through
    Flower (``twins_through_flower``); else every run in process on the wire, no
    SuperLink started, and no twins."""
    if twins_through_flower():
        with first_run_through_flower(request.getfixturevalue("simulation")) as twins:
            yield twins
    else:
        with simulations_in_process(OnTheWire):
            yield []


@pytest.fixture
def through_flower(request: pytest.FixtureRequest) -> Iterator[list[tuple[Path, Path]]]:
    """``script_runs`` for one test."""
    with script_runs(request) as twins:
        yield twins


@pytest.fixture
def on_the_wire() -> Iterator[list[InProcessSimulation]]:
    """For one test, a script's runs all run in process, on the wire (``OnTheWire``); no
    SuperLink starts. Yields the simulations made, for ``assert_on_the_wire``."""
    with simulations_in_process(OnTheWire) as made:
        yield made


def assert_on_the_wire(made: list[InProcessSimulation], out: Path) -> None:
    """The script made its simulations through the double, ran at least one run, the
    last run of each on a grid that sent its messages on the wire (a batched run's grid
    does not), and wrote under ``out``."""
    ran = [m for m in made if m.runs]
    assert ran
    assert all(m.grid is not None and m.grid.wire for m in ran)
    assert any(out.rglob("summary.json"))


@pytest.fixture
def no_superlink(monkeypatch: pytest.MonkeyPatch) -> None:
    """A script's ``--in-process`` runs must start no local simulation SuperLink: any
    attempt fails the test."""

    def refuse(**_: object) -> None:
        raise AssertionError("--in-process started a SuperLink")

    monkeypatch.setattr(launch, "LocalSimulation", refuse)


def assert_through_flower(twins: list[tuple[Path, Path]], out: Path) -> None:
    """The script wrote under ``out``, its first configuration went through Flower once,
    and that run's results equal its in-process twin's (``assert_same_run``): what lets
    the script's runs run in process. Flower's log holds no terminal codes and no NaN
    progress line. Without the twins (``twins_through_flower``): the script wrote a run
    under ``out``."""
    if not twins and not twins_through_flower():
        assert any(out.rglob("summary.json"))
        return
    (real, twin), *rest = twins
    assert rest == []
    assert real.is_relative_to(out)
    assert_same_run(real, twin)
    log = (real / "flower.log").read_text()
    assert "\x1b[" not in log
    assert "accuracy nan" not in log


@contextlib.contextmanager
def simulations_in_process(
    kind: Callable[..., InProcessSimulation] = OnTheWire,
) -> Iterator[list[InProcessSimulation]]:
    """While open, every ``LocalSimulation`` that a script makes is what ``kind`` makes
    (with the same arguments); yields the simulations made, in order. (The ServerApp
    runs as in a simulation: its grid is not Flower's deployed one,
    ``server_app.simulated``.)"""
    made: list[InProcessSimulation] = []

    def make(**kwargs: Any) -> InProcessSimulation:
        made.append(kind(**kwargs))
        return made[-1]

    with pytest.MonkeyPatch.context() as patch:
        for name, module in list(sys.modules.items()):
            if name.startswith("fedpers.simulations") and hasattr(module, "LocalSimulation"):
                patch.setattr(module, "LocalSimulation", make)
        yield made


# What differs between two runs of one configuration: their clocks, and where they wrote.
TIMES = ("seconds", "_unix", "results-dir")
CLIENT_ERROR = re.compile(r"^(partition \d+: client error): .*$", re.S)


def comparable(value: Any) -> Any:
    """``value`` (a run's JSON) without the entries that hold times or its own path, and
    with a client error's text cut to "partition P: client error": Flower hands the
    ServerApp the ClientApp's exception wrapped in its own, the in-process grid as
    ``repr``."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if not k.endswith(TIMES)}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    if isinstance(value, str):
        return CLIENT_ERROR.sub(r"\1", value)
    return value


def assert_same_numbers(real: Any, twin: Any, where: str = "") -> None:
    """Equal JSON values, floats to 1e-9: the ServerApp sums the replies in the order
    they arrive, which under Flower is not the nodes' order."""
    if isinstance(real, dict) and isinstance(twin, dict):
        assert sorted(real) == sorted(twin), where
        for key in real:
            assert_same_numbers(real[key], twin[key], f"{where}.{key}")
    elif isinstance(real, list) and isinstance(twin, list):
        assert len(real) == len(twin), where
        for index, (a, b) in enumerate(zip(real, twin, strict=True)):
            assert_same_numbers(a, b, f"{where}[{index}]")
    elif isinstance(real, float) or isinstance(twin, float):
        assert real == pytest.approx(twin, rel=1e-9, abs=1e-12, nan_ok=True), where
    else:
        assert real == twin, where


def assert_same_run(real: Path, twin: Path) -> None:
    """Two run directories of one configuration hold the same results: the resolved
    configuration, every round's record and client figures, the summary and the final
    arrays (to 1e-9; float32 arrays to a few of their units in the last place)."""
    assert_same_numbers(comparable(read_summary(real)), comparable(read_summary(twin)), "summary")
    assert_same_numbers(
        [comparable(asdict(r)) for r in read_rounds(real)],
        [comparable(asdict(r)) for r in read_rounds(twin)],
        "rounds",
    )
    for name in ("config.json", "clients.jsonl"):
        assert (real / name).exists() == (twin / name).exists(), name
        if (real / name).exists():
            texts = [(d / name).read_text() for d in (real, twin)]
            values = [
                [json.loads(x) for x in t.splitlines()] if name.endswith("l") else json.loads(t)
                for t in texts
            ]
            assert_same_numbers(comparable(values[0]), comparable(values[1]), name)
    arrays = real / "final_arrays.npz"
    assert arrays.exists() == (twin / "final_arrays.npz").exists()
    if arrays.exists():
        with np.load(arrays) as a, np.load(twin / "final_arrays.npz") as b:
            assert sorted(a.files) == sorted(b.files)
            for name in a.files:
                assert a[name].dtype == b[name].dtype, name
                rtol = 1e-9 if a[name].dtype == np.float64 else 1e-5
                np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=1e-7, err_msg=name)
