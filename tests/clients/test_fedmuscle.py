"""FedMuscle against its formula (Setayesh et al., ICLR 2026, as transcribed in the
module docstring of fedpers/algorithms/fedmuscle.py): the Muscle loss equals a direct enumeration
of every tuple of the other agents' pilots, weights alpha included, and InfoNCE with one
other agent; an agent's step after its epochs is the gradient step of that loss on its
encoder (autograd in float64); the relay sends each agent the representations of the
agents it draws, each screened to rows of norm 1."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, RecordDict

from fedpers import protocol
from fedpers.algorithms.fedmuscle import muscle_loss, pilot_batch
from fedpers.config import RunConfig, load_run_config
from fedpers.data.client import pilot_data
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import REPRESENTATIONS
from fedpers.settings import ConfigError
from fedpers.strategies import build_strategy
from tests.clients.sheaf_agents import agent_model, answer, trained_alone
from tests.helpers import client_of, run_config

AGENTS = {
    "dataset": "digits",
    "algorithm": "fedmuscle",
    "num_clients": 3,
    "sheaf_latent_dims": "8,8,8",
    "sheaf_hidden": "64,160,96",
    "fraction_train": 1.0,
    "batch_size": 100_000,
    "momentum": 0.0,
    "weight_decay": 0.0,
    "sheaf_clip": 0.0,
    "sheaf_pilot_batch": 16,
    "epochs": 1,
    "lr": 0.5,
}


def _unit(generator: np.random.Generator, rows: int, d: int) -> np.ndarray:
    values = generator.normal(size=(rows, d))
    return values / np.linalg.norm(values, axis=1, keepdims=True)


def _enumerated(anchor: np.ndarray, others: list[np.ndarray], tau: float, sub: float) -> float:
    """The formula term by term: for each anchor i, every tuple j of the others' rows."""
    gamma = 1 / sub - 1 / tau
    batch = len(anchor)
    total = 0.0
    for i in range(batch):
        terms, positive = [], 0.0
        for j in itertools.product(range(batch), repeat=len(others)):
            s = sum(anchor[i] @ others[k][j[k]] for k in range(len(others))) / tau
            log_alpha = -gamma * sum(
                others[k][j[k]] @ others[q][j[q]]
                for k in range(len(others))
                for q in range(k + 1, len(others))
            )
            terms.append(s + log_alpha)
            if all(index == i for index in j):
                positive = s + log_alpha
        total += np.logaddexp.reduce(terms) - positive
    return total / batch


@pytest.mark.parametrize("count", [1, 2, 3])
def test_the_muscle_loss_is_the_enumerated_formula(count: int) -> None:
    generator = np.random.default_rng(count)
    anchor, others = _unit(generator, 5, 3), [_unit(generator, 5, 3) for _ in range(count)]
    got = muscle_loss(
        torch.tensor(anchor), [torch.tensor(o) for o in others], tau=0.2, tau_others=0.15
    )
    assert float(got) == pytest.approx(_enumerated(anchor, others, 0.2, 0.15), abs=1e-10)
    if count >= 2:  # the test can fail: without the tuples' weights alpha
        unweighted = _enumerated(anchor, others, 0.2, 0.2)
        assert abs(float(got) - unweighted) > 1e-3


def test_with_one_other_agent_it_is_infonce() -> None:
    generator = np.random.default_rng(7)
    anchor, other = torch.tensor(_unit(generator, 6, 4)), torch.tensor(_unit(generator, 6, 4))
    infonce = F.cross_entropy(anchor @ other.T / 0.2, torch.arange(6))
    assert float(muscle_loss(anchor, [other], tau=0.2, tau_others=0.15)) == pytest.approx(
        float(infonce), abs=1e-12
    )


def _body_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().double() for k, v in model.body.named_parameters()}


def test_an_agents_step_after_its_epochs_is_the_muscle_gradient_step() -> None:
    run = RunConfig.from_mapping(run_config(**AGENTS))
    client = client_of(run, 0, RecordDict())
    config = ConfigRecord({protocol.ROUND: 1, protocol.EPOCHS: 1, protocol.LR: run.lr})
    alone = client_of(run, 0, RecordDict())
    trained_alone(alone, config)  # the epochs alone (the family's training)
    generator = np.random.default_rng(3)
    received = {
        sheaf_family.from_agent(REPRESENTATIONS, m): _unit(generator, 16, 8).astype(np.float32)
        for m in (1, 2)
    }
    _, metrics = client.fit(received, config)
    # Oracle: the loss in float64 on the trained encoder, eval mode, by autograd
    trained_model = agent_model(run, 0, alone.state)
    body = copy.deepcopy(trained_model.body).double().eval()
    pilots_x, pilots_y = pilot_data(run)
    index = torch.from_numpy(pilot_batch(run, 1, len(pilots_y)))
    z = F.normalize(body(torch.tensor(pilots_x, dtype=torch.float64)[index]), dim=1)
    others = [torch.tensor(received[k], dtype=torch.float64) for k in sorted(received)]
    loss = muscle_loss(z, others, tau=0.2, tau_others=0.15)
    grads = torch.autograd.grad(loss, list(body.parameters()))
    expected = {
        name: (p - run.lr * g).detach()
        for (name, p), g in zip(body.named_parameters(), grads, strict=True)
    }
    model = agent_model(run, 0, client.state)
    after = _body_parameters(model)
    assert max(float((after[k] - expected[k]).abs().max()) for k in expected) < 1e-6
    assert metrics[sheaf_family.PENALTY] == pytest.approx(float(loss), rel=1e-5)
    # The test can fail: the epochs alone differ by the step
    trained = _body_parameters(trained_model)
    assert max(float((after[k] - trained[k]).abs().max()) for k in trained) > 1e-4
    # The head is not in the step
    for name, value in trained_model.head.named_parameters():
        assert torch.equal(value, dict(model.head.named_parameters())[name])


def test_the_relay_sends_each_agent_the_representations_of_the_agents_it_draws() -> None:
    from fedpers.clients.client_app import app as client_app
    from tests.helpers import InProcessGrid

    values = run_config(**{**AGENTS, "fedmuscle_others": 1})
    run = RunConfig.from_mapping(values)
    grid = InProcessGrid(client_app, values, 3)
    strategy = build_strategy(run)
    strategy.federation.connect(grid, timeout=5)
    relayed = strategy._relay(1, ConfigRecord({protocol.ROUND: 1}), grid)
    fresh = {
        m: answer(
            client_of(run, m, RecordDict()),
            "representations_message",
            {},
            ConfigRecord({protocol.ROUND: 1}),
        )[REPRESENTATIONS]
        for m in range(3)
    }
    for n in range(3):
        (name,) = relayed[n]
        kind, sender = sheaf_family.agent_of(name)
        assert kind == REPRESENTATIONS
        assert sender != n
        assert sender == strategy.drawn(1, n, [m for m in range(3) if m != n])[0]
        assert np.array_equal(relayed[n][name], fresh[sender])
        assert np.allclose(np.linalg.norm(fresh[sender], axis=1), 1, atol=1e-6)


@pytest.mark.parametrize("kind", ["pilots-scale", "pilots-nan"])
def test_representations_not_of_unit_rows_are_not_relayed(kind: str) -> None:
    from tests.strategies.test_robustness import FAULTY, _run

    left = {"num_clients", "fraction_train", "sheaf_latent_dims", "sheaf_hidden"}
    family = {k: v for k, v in AGENTS.items() if k not in left}
    family["sheaf_latent_dims"] = "8,8,8,8"
    _strategy, (log, _) = _run(family, f"{kind}:{FAULTY}@2", rounds=2)
    assert log[0].rejections == []
    assert any(
        r.startswith(f"partition {FAULTY}: {sheaf_family.QUERY_REPRESENTATIONS}")
        for r in log[1].rejections
    ), log[1].rejections


def test_fedmuscle_needs_equal_latent_dimensions_and_a_loss_that_fits() -> None:
    base = {"algorithm": "fedmuscle", "dataset": "digits", "num-clients": 5}
    with pytest.raises(ConfigError, match="needs equal latent dimensions"):
        load_run_config({**base, "sheaf-latent-dims": "8,16,8,8,8"})
    with pytest.raises(ConfigError, match="must be below 'fedmuscle-tau'"):
        load_run_config({**base, "sheaf-latent-dims": "8,8,8,8,8", "fedmuscle-tau": 0.1})
    with pytest.raises(ConfigError, match="lower 'fedmuscle-others'"):
        load_run_config({**base, "sheaf-latent-dims": "8,8,8,8,8", "sheaf-pilot-batch": 128})
