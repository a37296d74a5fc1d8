"""Test doubles of the sheaf family's agents: an agent's model as its node keeps it, its
training alone (the family's update), and its agents built without dropout (for the
oracles that take a deterministic step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedpers import agents_update, records
from fedpers.cohort import Arrays, Member, Metrics
from fedpers.config import RunConfig
from fedpers.families import sheaf as sheaf_family
from fedpers.models.agents import build_agent
from fedpers.seeding import int_seed
from tests.helpers import Node


def agent_model(run: RunConfig, partition: int, state: RecordDict | None = None) -> torch.nn.Module:
    """The model agent ``partition`` keeps in ``state`` (its seeded one before it kept
    any), in training mode."""
    model = build_agent(
        sheaf_family.run_agent_specs(run)[partition],
        run.dataset,
        run.num_classes,
        int_seed(run.seed, "agent", partition),
    )
    stored = (state or RecordDict()).get(sheaf_family.STATE_MODEL)
    if isinstance(stored, ArrayRecord):
        model.load_state_dict({k: torch.from_numpy(records.values(v)) for k, v in stored.items()})
    return model


def trained_alone(node: Node, config: ConfigRecord) -> Metrics:
    """The node's epochs of the round on its private loss alone (the family's ``fit``,
    what Sheaf-FMTL and FedMuscle take their own step after)."""
    metrics: Metrics = agents_update.fit(node.cohort({}, config))[0][1]
    return metrics


def answer(node: Node, query: str, arrays: Arrays, config: ConfigRecord) -> Arrays:
    """The node's answer to the family query whose update function is ``query``."""
    reply: Arrays = node.call(query, arrays, config)[0][0]
    return reply


def local_of(node: Node) -> agents_update.Agents:
    """The node as a cohort of one agent (``fedpers.agents_update``)."""
    return agents_update.Agents(node.cohort({}))


def member(node: Node) -> Member:
    return Member(node.partition_id, node.state)


def theta(model: torch.nn.Module) -> np.ndarray:
    """Every trainable parameter as one float64 vector, in ``parameters()`` order."""
    return np.concatenate([p.detach().double().numpy().ravel() for p in model.parameters()])


def no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every dropout rate set to 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def without_dropout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents built without dropout, in the update and in ``agent_model`` (until the
    test ends)."""

    original = build_agent

    def build(*args: object, **kwargs: object) -> torch.nn.Module:
        return no_dropout(original(*args, **kwargs))  # type: ignore[arg-type]

    monkeypatch.setattr(agents_update, "build_agent", build)
    monkeypatch.setattr(f"{__name__}.build_agent", build)
