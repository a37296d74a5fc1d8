"""The peer relay and Sheaf-FRL agents, through the real ClientApp in process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, MessageType
from numpy.testing import assert_allclose

from fedpers import protocol, sheaf
from fedpers.algorithms.sheaf_frl import STATE_MAPS
from fedpers.clients.client_app import app as client_app
from fedpers.config import RunConfig
from fedpers.data.client import client_data
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import STATE_MODEL
from fedpers.models.agents import build_agent
from fedpers.seeding import int_seed
from fedpers.strategies import build_strategy
from fedpers.strategies.peer_relay import PeerRelay
from fedpers.training import SGDSettings
from fedpers.training import train_model as train
from fedpers.update import to_record as record_of
from tests.clients.sheaf_agents import agent_model, answer
from tests.helpers import InProcessGrid, client_of, run_config

AGENTS = {
    "dataset": "digits",
    "num_clients": 6,
    "fraction_train": 1.0,
    "lr": 0.05,
    "momentum": 0.9,
    "weight_decay": 5e-4,
    "batch_size": 64,
    "epochs": 1,
    "sheaf_lambda": 0.1,
}


def _train_config(config: RunConfig) -> ConfigRecord:
    return ConfigRecord(
        {
            protocol.EPOCHS: config.epochs,
            protocol.LR: config.lr,
        }
    )


def _run(rounds: int, **overrides: object) -> tuple[InProcessGrid, RunConfig, PeerRelay]:
    values = run_config(**{**AGENTS, "algorithm": "sheaf-frl", **overrides})
    config = RunConfig.from_mapping(values)
    grid = InProcessGrid(client_app, values, config.num_clients)
    strategy = build_strategy(config)
    assert isinstance(strategy, PeerRelay)
    strategy.federation.connect(grid, timeout=5)
    strategy.start(
        grid,
        strategy.initial_arrays(grid, timeout=5),
        num_rounds=rounds,
        train_config=_train_config(config),
    )
    return grid, config, strategy


def _maps(grid: InProcessGrid, agent: int) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in grid.contexts[grid.node_of(agent)].state[STATE_MAPS].items()}


def test_relay_sends_each_agent_exactly_its_neighbours_pilots_and_no_model() -> None:
    grid, config, strategy = _run(2)
    partition_of = {grid.node_of(p): p for p in range(config.num_clients)}
    trains = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    assert len(trains) == 2 * config.num_clients
    for message in trains:
        agent = partition_of[message.metadata.dst_node_id]
        names = set(message.content[protocol.ARRAYS])
        assert names == {f"pilots.{j}" for j in sheaf.neighbours(strategy.edges, agent)}
        for j in sheaf.neighbours(strategy.edges, agent):
            pilots = message.content[protocol.ARRAYS][f"pilots.{j}"].numpy()
            assert pilots.shape[1] == sheaf_family.run_agent_specs(config)[j].latent
    # Nothing the server sends or relays is a model parameter: only pilot latents.
    for message in grid.sent:
        for record in message.content.array_records.values():
            assert all(name.startswith("pilots") for name in record)
    assert strategy.bytes_sent[1] > 0


@pytest.mark.parametrize("variant", ["heterogeneous", "homogeneous", "private"])
def test_both_endpoints_of_an_edge_hold_the_same_map(variant: str) -> None:
    overrides: dict[str, object] = {"sheaf_variant": variant}
    if variant != "heterogeneous":
        overrides["sheaf_latent_dims"] = ",".join(["6"] * 6)
    grid, _, strategy = _run(3, **overrides)
    for a, b in strategy.edges:
        at_a, at_b = _maps(grid, a)[str(b)], _maps(grid, b)[str(a)]
        if variant == "private":  # each holds its own map to the other: transposes
            assert_allclose(at_a, at_b.T, atol=1e-8)
        else:
            assert_allclose(at_a, at_b, atol=1e-10)
            assert_allclose(at_a.T @ at_a, np.eye(at_a.shape[1]), atol=1e-10)


def test_lambda_zero_reproduces_independent_training() -> None:
    grid, config, _ = _run(3, sheaf_lambda=0.0)
    settings = SGDSettings(config.lr, config.momentum, config.weight_decay, config.batch_size)
    for agent in (0, 3):
        alone = build_agent(
            sheaf_family.run_agent_specs(config)[agent],
            "digits",
            10,
            int_seed(config.seed, "agent", agent),
        )
        data = client_data(config, agent)
        for server_round in range(1, 4):
            generator = torch.Generator().manual_seed(
                int_seed(config.seed, "train", agent, server_round)
            )
            train(
                alone,
                torch.from_numpy(data.x_train),
                torch.from_numpy(data.y_train),
                parts=("body", "head"),
                epochs=config.epochs,
                settings=settings,
                generator=generator,
                max_grad_norm=sheaf_family.settings(config).sheaf_clip,
            )
        stored = grid.contexts[grid.node_of(agent)].state[STATE_MODEL]
        for name, value in alone.state_dict().items():
            if not name.startswith("whitening"):
                assert np.array_equal(stored[name].numpy(), value.numpy()), name


def test_encoders_equal_up_to_a_rotation_communicate_at_private_accuracy() -> None:
    values = run_config(
        algorithm="sheaf-frl",
        dataset="digits",
        num_clients=2,
        sheaf_latent_dims="6,6",
        sheaf_hidden="32,32",
    )
    config = RunConfig.from_mapping(values)
    sender = client_of(config, 0)
    receiver = client_of(config, 1)
    rotation = np.linalg.qr(np.random.default_rng(0).standard_normal((6, 6)))[0]
    q = torch.from_numpy(rotation.astype(np.float32))
    model = agent_model(config, 0)
    with torch.no_grad():  # receiver = sender with its latent space rotated by Q
        last = model.body[-1]
        last.weight.copy_(q @ last.weight)
        last.bias.copy_(q @ last.bias)
        first = model.head[0]
        first.weight.copy_(first.weight @ q.T)
    receiver.state[STATE_MODEL] = record_of({k: v.numpy() for k, v in model.state_dict().items()})
    ask = ConfigRecord({sheaf_family.WHITENING: "pilots"})
    shared = answer(sender, "latents_message", {}, ask)
    arrays = {f"{name}.0": value for name, value in shared.items()}
    metrics = receiver.evaluate(
        arrays, ConfigRecord({sheaf_family.COMMUNICATION: 1, sheaf_family.WHITENING: "pilots"})
    )
    private = sender.evaluate({}, ConfigRecord({}))[protocol.ACCURACY]
    assert metrics["edge.0"] == pytest.approx(private, abs=1e-12)
    assert len(sender.data.y_test) > 0
