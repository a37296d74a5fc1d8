"""Test doubles: an in-process Grid that delivers messages to the real ClientApp
(``fedpers.simulations.inprocess``, also used by the robustness script's reply sweep),
and the client a ClientApp would build."""

from __future__ import annotations

import os
from typing import Any

from flwr.app import ConfigRecord, RecordDict

from fedpers.cohort import Arrays, Cohort, Member, Metrics
from fedpers.config import RunConfig
from fedpers.data.client import ClientData, client_data
from fedpers.simulations.grid import (
    SERVER_NODE,
    InProcessGrid,
    run_config,
    set_task_identity,
)

__all__ = [
    "SERVER_NODE",
    "InProcessGrid",
    "Node",
    "client_of",
    "run_config",
    "set_task_identity",
]


def twins_through_flower() -> bool:
    """Whether the tests marked ``twin`` send their runs through a real ``flwr run``
    (``FEDPERS_FLOWER_TWINS``, default yes): ``make twin-test`` sets 1, ``make test`` 0,
    where they run in process, or the Flower-only part is left out."""
    return os.environ.get("FEDPERS_FLOWER_TWINS", "1") != "0"


def client_of(run: RunConfig, partition: int, state: RecordDict | None = None) -> Node:
    """The client the ClientApp runs for ``partition``: the row's update for a cohort of
    one (``Node``)."""
    return Node(run, partition, state)


class Node:
    """One client as a device runs it: the row's local update on a cohort of this one
    member (``fedpers.cohort``), its state in ``state``."""

    def __init__(self, run: RunConfig, partition: int, state: RecordDict | None = None) -> None:
        self.run = run
        self.partition_id = partition
        self.state = RecordDict() if state is None else state

    @property
    def data(self) -> ClientData:
        return client_data(self.run, self.partition_id)

    def cohort(self, arrays: Arrays, config: ConfigRecord | None = None) -> Cohort:
        member = Member(self.partition_id, self.state, dict(arrays))
        return Cohort(self.run, config or ConfigRecord(), [member], self.run.client_threads)

    def call(self, name: str, arrays: Arrays, config: ConfigRecord | None = None) -> Any:
        function = self.run.spec.update_function(name, self.run.family)
        assert function is not None, f"{self.run.algorithm} has no {name}"
        return function(self.cohort(arrays, config))

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        reply: tuple[Arrays, Metrics] = self.call("fit", arrays, config)[0]
        return reply

    def evaluate(self, arrays: Arrays, config: ConfigRecord) -> Metrics:
        metrics: Metrics = self.call("evaluate", arrays, config)[0]
        return metrics

    def initial_arrays(self) -> Arrays:
        arrays: Arrays = self.call("initial_arrays", {})
        return arrays
