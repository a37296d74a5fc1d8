"""Sheaf-FMTL against its equations (Ben Issaid et al. 2025): between two Sheaf-FRL
agents of different architectures and latent dimensions, after its local epochs an
agent takes a gradient step on (lambda / 2) sum_j ||P_ij theta - m_ji||^2 in theta,
then one in each P_ij at the new theta (both written here with torch autograd in
float64), with the projections ``m_ji = P_ji theta_j`` its neighbours sent; one round
through the in-process grid relays exactly those projections. Also: the parameter count
the server sizes the messages by equals torch's, and a run whose maps would not fit is
refused before it starts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fedpers import protocol, records, sheaf
from fedpers.algorithms.sheaf_fmtl import STATE_FMTL_MAPS, restriction_maps, sheaf_step
from fedpers.config import RunConfig, load_run_config
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import PROJECTION, STATE_MODEL
from fedpers.models.agents import build_agent
from fedpers.settings import ConfigError
from tests.clients.sheaf_agents import agent_model, member, trained_alone
from tests.clients.sheaf_agents import theta as _theta
from tests.clients.test_fedprox import tiny_rounds
from tests.helpers import Node, client_of, run_config

AGENTS = {
    "dataset": "digits",
    "algorithm": "sheaf-fmtl",
    "num_clients": 2,
    "sheaf_latent_dims": "8,16",
    "sheaf_hidden": "64,160",
    "fraction_train": 1.0,
    "batch_size": 100_000,
    "momentum": 0.0,
    "weight_decay": 0.0,
    "sheaf_clip": 0.0,
    "epochs": 1,
    "lr": 0.1,
    # large enough that the sheaf steps move theta and the maps well past 1e-6
    "sheaf_fmtl_lambda": 0.5,
    "sheaf_fmtl_map_lr": 0.05,
    "sheaf_fmtl_gamma": 0.02,
}


def _oracle(
    theta: np.ndarray,
    maps: dict[int, np.ndarray],
    received: dict[int, np.ndarray],
    *,
    lam: float,
    lr: float,
    eta: float,
    fresh_theta: bool = True,
) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """theta <- theta - lr grad_theta J(theta, P); P_ij <- P_ij - eta grad_P J(theta', P)
    with J = (lam / 2) sum_j ||P_ij theta - m_ji||^2, by autograd in float64
    (``fresh_theta`` False: the map step at the old theta, a wrong variant)."""
    t = torch.tensor(theta, dtype=torch.float64, requires_grad=True)
    ps = {j: torch.tensor(maps[j], dtype=torch.float64, requires_grad=True) for j in received}
    ms = {j: torch.tensor(m, dtype=torch.float64) for j, m in received.items()}

    def objective(t_: torch.Tensor) -> torch.Tensor:
        return lam / 2 * sum(((ps[j] @ t_ - ms[j]) ** 2).sum() for j in received)

    (grad,) = torch.autograd.grad(objective(t), [t])
    new_theta = (t - lr * grad).detach()
    at = new_theta if fresh_theta else t.detach()
    map_grads = torch.autograd.grad(objective(at), [ps[j] for j in received])
    new_maps = {
        j: (ps[j] - eta * g).detach().numpy() for j, g in zip(received, map_grads, strict=True)
    }
    return new_theta.numpy(), new_maps


def _maps(run: RunConfig, node: Node) -> dict[int, np.ndarray]:
    """The node's maps ``P_ij``: as it kept them, or as it draws them before any."""
    count = len(_theta(agent_model(run, node.partition_id)))
    return restriction_maps(run, member(node), count)


def test_an_agents_step_after_its_epochs_is_the_sheaf_gradient_step() -> None:
    run = RunConfig.from_mapping(run_config(**AGENTS))
    client = client_of(run, 0, RecordDict())
    config = ConfigRecord({protocol.ROUND: 1, protocol.EPOCHS: 1, protocol.LR: run.lr})
    # What its local epochs alone give (the family's training, tested elsewhere)
    alone = client_of(run, 0, RecordDict())
    trained_alone(alone, config)
    trained = _theta(agent_model(run, 0, alone.state))
    maps = _maps(run, client)
    (d,) = {p.shape[0] for p in maps.values()}
    received = {1: np.random.default_rng(0).normal(size=d).astype(np.float32)}
    reply, metrics = client.fit({sheaf_family.from_agent(PROJECTION, 1): received[1]}, config)
    after = _theta(agent_model(run, 0, client.state))
    kept = _maps(run, client)
    settings = {"lam": 0.5, "lr": run.lr, "eta": 0.05}
    theta, expected = _oracle(trained, maps, received, **settings)
    assert reply == {}
    assert np.max(np.abs(after - theta)) < 1e-6
    assert np.max(np.abs(kept[1] - expected[1])) < 1e-6
    gap = maps[1].astype(np.float64) @ trained - received[1]
    assert metrics[sheaf_family.PENALTY] == pytest.approx(gap @ gap, rel=1e-6)
    # The test can fail: without the sheaf step, or with the maps stepped at the old theta
    assert np.max(np.abs(after - trained)) > 1e-4
    _, stale = _oracle(trained, maps, received, fresh_theta=False, **settings)
    assert np.max(np.abs(kept[1] - stale[1])) > 1e-5


def test_a_clipped_step_moves_theta_and_a_map_by_at_most_lr_and_eta_times_the_clip() -> None:
    run = RunConfig.from_mapping(run_config(**{**AGENTS, "sheaf_clip": 1.0}))
    client = client_of(run, 0, RecordDict())
    config = ConfigRecord({protocol.ROUND: 1, protocol.EPOCHS: 0, protocol.LR: run.lr})
    before, maps = _theta(agent_model(run, 0)), _maps(run, client)
    (d,) = {p.shape[0] for p in maps.values()}
    hostile = np.full(d, 3e38, dtype=np.float32)  # float32's largest, from a neighbour
    client.fit({sheaf_family.from_agent(PROJECTION, 1): hostile}, config)
    after = _theta(agent_model(run, 0, client.state))
    moved = np.linalg.norm(after - before)
    assert 0 < moved <= run.lr * 1.0 * (1 + 1e-6)
    step = np.linalg.norm(_maps(run, client)[1].astype(np.float64) - maps[1])
    assert 0 < step <= 0.05 * 1.0 * (1 + 1e-3)
    assert np.all(np.isfinite(after))


def test_a_round_relays_each_agents_projection_to_its_neighbour() -> None:
    rounds = tiny_rounds(1, **AGENTS)
    run, grid = rounds.config, rounds.grid
    config = ConfigRecord({protocol.ROUND: 1, protocol.EPOCHS: 1, protocol.LR: run.lr})
    fresh = [client_of(run, agent, RecordDict()) for agent in range(2)]
    start_maps = [
        restriction_maps(run, member(c), len(_theta(agent_model(run, agent))))
        for agent, c in enumerate(fresh)
    ]
    sent = {  # m_ij = P_ij theta_i^0, from agent i to j
        (i, 1 - i): start_maps[i][1 - i].astype(np.float64) @ _theta(agent_model(run, i))
        for i in range(2)
    }
    for agent in range(2):
        other = 1 - agent
        alone = client_of(run, agent, RecordDict())
        trained_alone(alone, config)
        trained = _theta(agent_model(run, agent, alone.state))
        state = grid.contexts[grid.node_of(agent)].state
        model = agent_model(run, agent, state)
        kept = records.values(state[STATE_FMTL_MAPS][str(other)])
        settings = {"lam": 0.5, "lr": run.lr, "eta": 0.05}
        received = {other: sent[other, agent]}
        theta, expected = _oracle(trained, start_maps[agent], received, **settings)
        assert np.max(np.abs(_theta(model) - theta)) < 1e-6
        assert np.max(np.abs(kept - expected[other])) < 1e-6
        # The test can fail: the agent's own projection instead of its neighbour's
        own = {other: sent[agent, other]}
        wrong, _ = _oracle(trained, start_maps[agent], own, **settings)
        assert np.max(np.abs(_theta(model) - wrong)) > 1e-5


@pytest.mark.parametrize("dataset", ["digits", "mnist"])
def test_the_parameter_count_the_server_uses_is_torchs(dataset: str) -> None:
    for spec in sheaf.agent_specs(15, scale=0.125, latent_dims=None, hidden=None):
        model = build_agent(spec, dataset, 10, 0)
        expected = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert sheaf.parameter_count(spec, dataset, 10) == expected


def test_maps_that_would_not_fit_are_refused_before_the_run() -> None:
    with pytest.raises(ConfigError, match="lower 'sheaf-fmtl-gamma'"):
        load_run_config(
            {
                "algorithm": "sheaf-fmtl",
                "dataset": "digits",
                "num-clients": 4,
                "sheaf-hidden": "4000,4000,4000,4000",
                "sheaf-fmtl-gamma": 1.0,
            }
        )


FINITE32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(
    received=st.lists(FINITE32, min_size=3, max_size=3),
    scale=st.sampled_from([1e-30, 1.0, 1e10, 1e30]),
    clip=st.sampled_from([0.1, 1.0, 10.0]),
)
def test_whatever_a_neighbour_sends_one_step_moves_theta_and_a_map_a_bounded_amount(
    received: list[float], scale: float, clip: float
) -> None:
    # Any finite float32 projection (the relay passes only those): the step on theta is
    # at most lr x clip, the map's at most eta x clip, and both stay finite.
    generator = np.random.default_rng(1)
    theta = generator.normal(size=20) * scale
    maps = {4: generator.normal(size=(3, 20)).astype(np.float32)}
    message = {4: np.array(received, dtype=np.float32).astype(np.float64)}
    new_theta, new_maps, penalty = sheaf_step(
        theta, maps, message, lr=0.05, lam=0.5, eta=0.01, clip=clip
    )
    assert np.all(np.isfinite(new_theta))
    assert np.all(np.isfinite(new_maps[4]))
    # beyond the bound only by rounding: of float64 at theta's scale, of the map's float32
    rounding = 1e-15 * np.linalg.norm(theta)
    assert np.linalg.norm(new_theta - theta) <= 0.05 * clip * (1 + 1e-9) + rounding
    moved = np.linalg.norm(new_maps[4].astype(np.float64) - maps[4])
    assert moved <= 0.01 * clip * (1 + 1e-9) + 1e-7 * np.linalg.norm(maps[4])
    assert penalty >= 0


def test_a_neighbours_nan_projections_are_not_relayed_and_scaled_ones_stay_bounded() -> None:
    from tests.strategies.test_robustness import FAULTY, _run

    faults = f"pilots-nan:{FAULTY}@2,pilots-scale:{FAULTY}@3"
    left = {"sheaf_latent_dims", "sheaf_hidden", "num_clients", "fraction_train"}
    family = {k: v for k, v in {**AGENTS, "sheaf_clip": 1.0}.items() if k not in left}
    _strategy, (log, _) = _run(family, faults, rounds=3)
    assert [r.round for r in log] == [1, 2, 3]
    assert log[0].rejections == []
    assert any(
        r.startswith(f"partition {FAULTY}: {sheaf_family.QUERY_PROJECTIONS}")
        for r in log[1].rejections
    ), log[1].rejections
    assert log[2].rejections == []  # 1e6 x the projections: finite, relayed
    rounds = tiny_rounds(3, **{**family, "num_clients": 4, "fault_injection": faults})
    for agent in range(4):
        state = rounds.grid.contexts[rounds.grid.node_of(agent)].state
        for name, value in state[STATE_MODEL].items():
            assert np.all(np.isfinite(records.values(value))), (agent, name)
