"""Runs in this process: the ServerApp's ``main`` on an in-process grid of the real
ClientApps, no Ray, no SuperLink.

``InProcessSimulation`` runs a whole run this way: on an ``InProcessGrid``
(``fedpers.simulations.grid``: each message handled by calling the ClientApp, one at a
time, as a SuperNode would), or, for a run with ``engine = "batched"``, on a
``BatchedGrid`` (``fedpers.simulations.batched``: a round's messages as cohorts). A run
writes what ``flwr run`` writes, every float to 1e-9 (the tests check it on each
script's first run); a real run's start-up (about 25 s here) and Ray's 0.3-0.7 s a round
are what it saves. The scripts' ``--in-process`` and ``--engine batched`` runs and the
reply sweep of ``simulations.robustness`` use it (``run_in_process``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict

from fedpers.clients.client_app import app as client_app
from fedpers.config import Engine
from fedpers.results import FAILURE_FILE, SUMMARY_FILE, ResultsExistError, run_directory
from fedpers.simulations import launch
from fedpers.simulations.grid import InProcessGrid
from fedpers.simulations.launch import FlowerRunError
from fedpers.strategies import server_app


class InProcessSimulation:
    """``LocalSimulation``'s interface, each run in this process: the ServerApp's
    ``main`` on an ``InProcessGrid`` of real ClientApps (a ``BatchedGrid`` for a run
    with ``engine = "batched"``), one node per virtual node, with the run config that
    ``flwr run`` would pass. No SuperLink, no Ray, no start-up.

    A run ends as under Flower: with its results directory, or with ``FlowerRunError``
    and the reason its ``failure.json`` gives. ``runs`` lists the run names, in order.
    Runs that a script starts from several threads run one at a time: each real run has
    a process of its own, and nothing of one may leak into another.
    """

    one_at_a_time = threading.Lock()
    # Each message and reply of a per-client run through Flower's encoding
    # (``InProcessGrid``'s ``wire``): the scripts' tests set it (tests/simulations).
    wire = False

    def __init__(
        self,
        *,
        echo: Callable[[str], None] | None = None,
        keep_home: bool = False,
        environment: Mapping[str, str] | None = None,
        batched: Mapping[str, Any] | None = None,
        threads: int | None = None,
    ) -> None:
        self.runs: list[str] = []
        self.echo = echo or (lambda line: print(line, flush=True))
        self.process = None
        self.threads = threads  # the batched engine's torch threads (None: as torch has)
        # with ``batched`` (BatchedGrid's keywords: cohort_size, threads, dtype), the
        # nodes' TRAIN and EVALUATE messages run as cohorts (the batched engine)
        self.batched = batched
        self.grid: InProcessGrid | None = None  # the last run's, for the tests

    def __enter__(self) -> InProcessSimulation:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def run(
        self,
        overrides: Mapping[str, Any],
        *,
        num_supernodes: int | None = None,
        cpus_per_client: int = 1,
        gpus_per_client: float = 0.0,
    ) -> Path:
        config = launch.resolved_config(overrides)
        directory = run_directory(config.results_dir, config.run_name)
        if (directory / SUMMARY_FILE).exists() and not config.resume:
            raise ResultsExistError(f"{directory} already holds results; remove it first")
        values = config.to_mapping()
        nodes = num_supernodes or config.num_clients
        if self.batched is not None or config.engine is Engine.BATCHED:
            from fedpers.simulations.batched import BatchedGrid

            options = {
                "cohort_size": config.cohort_size,
                "cohort_mb": config.cohort_mb,
                "threads": config.engine_threads or self.threads,
                "workers": config.engine_workers,
                "keep_sent": False,
                **(self.batched or {}),
            }
            grid: InProcessGrid = BatchedGrid(values, nodes, **options)
        else:
            grid = InProcessGrid(client_app, values, nodes, keep_sent=False, wire=self.wire)
        self.grid = grid
        context = Context(
            run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=values
        )
        with self.one_at_a_time:
            self.runs.append(config.run_name)
            try:
                server_app.main(grid, context)  # type: ignore[arg-type]
            except Exception as error:  # the run ended; what it wrote says how
                ended = f"{type(error).__name__}: {error}"
            else:
                ended = "no error"
            finally:
                close = getattr(grid, "close", None)
                if close is not None:
                    close()

        if (directory / SUMMARY_FILE).exists():
            self.echo(launch.done_line(config.run_name, directory))
            return directory
        failure = directory / FAILURE_FILE
        reason = json.loads(failure.read_text())["reason"] if failure.exists() else "no summary"
        raise FlowerRunError(f"run '{config.run_name}' failed: {reason} ({ended})")

    def run_all(
        self, runs: Sequence[Mapping[str, Any]], *, parallel: int = 1, **kwargs: Any
    ) -> list[Path]:
        for overrides in runs:
            launch.resolved_config(overrides)
        return [self.run(overrides, **kwargs) for overrides in runs]


def run_in_process(overrides: Mapping[str, Any], threads: int | None = None) -> Path:
    """One run in this process (``InProcessSimulation``; ``threads``: the batched
    engine's torch threads), for a process pool: its results directory; a run that did
    not finish raises ``FlowerRunError``."""
    return InProcessSimulation(threads=threads).run(overrides)
