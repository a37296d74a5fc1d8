"""Test doubles: an in-process Grid that delivers messages to the real ClientApp
(``fedpers.simulations.inprocess``, also used by the robustness script's reply sweep),
and the client a ClientApp would build."""

from __future__ import annotations

from typing import Any

from flwr.app import RecordDict

from fedpers.config import RunConfig
from fedpers.simulations.inprocess import (
    SERVER_NODE,
    InProcessGrid,
    run_config,
    set_task_identity,
)

__all__ = ["SERVER_NODE", "InProcessGrid", "client_of", "run_config", "set_task_identity"]


def client_of(run: RunConfig, partition: int, state: RecordDict | None = None) -> Any:
    """The client the ClientApp would build for ``partition`` (the row's class)."""
    cls = run.spec.client_class(family=run.family.name)
    return cls(run, partition, RecordDict() if state is None else state)
