"""FedProto against its equations (Tan et al., AAAI 2022, Algorithm 1), between two
Sheaf-FRL agents of different encoders and one latent dimension: an agent's local
step is a gradient step on CE + lambda mean ||body(x) - C_bar^y||^2 (written here in
float64 with torch.func, dropout off), and after a round through the in-process grid
the global prototypes are the count-weighted class means of the agents' eval-mode
latents, computed here from the models the agents kept."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, RecordDict

from fedpers import protocol, records
from fedpers.clients.sheaf import STATE_MODEL
from fedpers.config import RunConfig, load_run_config
from fedpers.data.client import client_data
from fedpers.families.sheaf import PROTOTYPE_COUNTS, PROTOTYPES
from fedpers.settings import ConfigError
from tests.clients.test_fedprox import tiny_rounds
from tests.helpers import client_of, run_config

AGENTS = {
    "dataset": "digits",
    "algorithm": "fedproto",
    "num_clients": 2,
    "sheaf_latent_dims": "8,8",
    "sheaf_hidden": "64,160",
    "fraction_train": 1.0,
    "batch_size": 100_000,
    "momentum": 0.0,
    "weight_decay": 0.0,
    "sheaf_clip": 0.0,
    "epochs": 1,
    "lr": 0.1,
}
LAMBDA = 2.0


def _no_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def _step(
    model: torch.nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    targets: np.ndarray,
    known: np.ndarray,
    *,
    lam: float,
    lr: float,
    masked: bool = True,
) -> dict[str, torch.Tensor]:
    """One full-batch gradient step of CE + lam * mean over samples of the mean squared
    distance of each latent to its class's prototype (classes without one left out)."""
    params = {k: v.detach().double().requires_grad_(True) for k, v in model.named_parameters()}
    xs, ys = torch.tensor(x, dtype=torch.float64), torch.tensor(y)
    body = {k.removeprefix("body."): v for k, v in params.items() if k.startswith("body.")}
    head = {k.removeprefix("head."): v for k, v in params.items() if k.startswith("head.")}
    z = torch.func.functional_call(model.body.double(), body, (xs,))
    logits = torch.func.functional_call(model.head.double(), head, (z,))
    per_sample = (z - torch.tensor(targets, dtype=torch.float64)[ys]).pow(2).mean(dim=1)
    weight = torch.tensor(known[y] if masked else np.ones(len(y)), dtype=torch.float64)
    loss = F.cross_entropy(logits, ys) + lam * (per_sample * weight).mean()
    grads = torch.autograd.grad(loss, list(params.values()))
    return {k: (v - lr * g).detach() for (k, v), g in zip(params.items(), grads, strict=True)}


def test_an_agents_step_is_the_prototype_regularized_gradient_step() -> None:
    run = RunConfig.from_mapping(run_config(**AGENTS, fedproto_lambda=LAMBDA))
    client = client_of(run, 0, RecordDict())
    _no_dropout(client.model)
    start = copy.deepcopy(client.model)
    data = client_data(run, 0)
    rng = np.random.default_rng(0)
    targets = rng.normal(size=(run.num_classes, 8)).astype(np.float32)
    counts = np.ones(run.num_classes)
    counts[int(data.y_train[0])] = 0.0  # a class the agent holds, without a prototype
    arrays = {PROTOTYPES: targets, PROTOTYPE_COUNTS: counts}
    config = ConfigRecord({protocol.ROUND: 1, protocol.EPOCHS: 1, protocol.LR: run.lr})
    reply, _ = client.fit(arrays, config)
    after = {k: v.detach().double() for k, v in client.model.named_parameters()}
    known = counts > 0

    def gap(expected: dict[str, torch.Tensor]) -> float:
        return max(float((after[k] - expected[k]).abs().max()) for k in expected)

    common: dict[str, Any] = {"lr": run.lr}
    x, y = data.x_train, data.y_train
    assert gap(_step(copy.deepcopy(start), x, y, targets, known, lam=LAMBDA, **common)) < 1e-6
    # The test can fail: without the prototype term, or with the class that has no
    # global prototype pulled toward zeros
    assert gap(_step(copy.deepcopy(start), x, y, targets, known, lam=0.0, **common)) > 1e-4
    unmasked = _step(copy.deepcopy(start), x, y, targets, known, lam=LAMBDA, masked=False, **common)
    assert gap(unmasked) > 1e-5
    # Its reply: the class means of its eval-mode latents and the counts behind them
    assert reply[PROTOTYPE_COUNTS].sum() == len(y)
    assert reply[PROTOTYPES].shape == (run.num_classes, 8)


def test_a_round_averages_the_agents_prototypes_by_their_class_counts() -> None:
    config, _start, result, _, grid = tiny_rounds(1, **AGENTS, fedproto_lambda=LAMBDA)
    total = np.zeros((config.num_classes, 8))
    counts = np.zeros(config.num_classes)
    for agent in range(2):
        client = client_of(config, agent, grid.contexts[grid.node_of(agent)].state)
        stored = grid.contexts[grid.node_of(agent)].state[STATE_MODEL]
        model = client.model
        model.load_state_dict({k: torch.from_numpy(records.values(v)) for k, v in stored.items()})
        model.eval()
        data = client_data(config, agent)
        with torch.no_grad():
            z = model.body(torch.tensor(data.x_train)).double().numpy()
        for j in range(config.num_classes):
            held = data.y_train == j
            total[j] += z[held].sum(axis=0)
            counts[j] += held.sum()
    expected = total / np.maximum(counts, 1)[:, None]
    assert np.array_equal(result[PROTOTYPE_COUNTS], counts)
    assert np.max(np.abs(result[PROTOTYPES] - expected)) < 1e-5
    assert counts.sum() > 0


def test_fedproto_needs_equal_latent_dimensions() -> None:
    with pytest.raises(ConfigError, match="needs equal latent dimensions"):
        load_run_config(
            {
                "algorithm": "fedproto",
                "dataset": "digits",
                "num-clients": 2,
                "sheaf-latent-dims": "8,16",
            }
        )
