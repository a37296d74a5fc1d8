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

from fedpers import protocol
from fedpers.config import RunConfig, load_run_config
from fedpers.data.client import client_data
from fedpers.families.sheaf import PROTOTYPE_COUNTS, PROTOTYPES
from fedpers.settings import ConfigError
from tests.clients.sheaf_agents import agent_model, without_dropout
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


def test_an_agents_step_is_the_prototype_regularized_gradient_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    without_dropout(monkeypatch)  # the agent's and the oracle's
    run = RunConfig.from_mapping(run_config(**AGENTS, fedproto_lambda=LAMBDA))
    client = client_of(run, 0, RecordDict())
    start = agent_model(run, 0)
    data = client_data(run, 0)
    rng = np.random.default_rng(0)
    targets = rng.normal(size=(run.num_classes, 8)).astype(np.float32)
    counts = np.ones(run.num_classes)
    counts[int(data.y_train[0])] = 0.0  # a class the agent holds, without a prototype
    arrays = {PROTOTYPES: targets, PROTOTYPE_COUNTS: counts}
    config = ConfigRecord({protocol.ROUND: 1, protocol.EPOCHS: 1, protocol.LR: run.lr})
    reply, _ = client.fit(arrays, config)
    trained = agent_model(run, 0, client.state)
    after = {k: v.detach().double() for k, v in trained.named_parameters()}
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


def _agents_prototypes(config: RunConfig, grid: Any) -> tuple[np.ndarray, np.ndarray]:
    """Each agent's class means of its eval-mode latents (agents x classes x d) and the
    counts behind them (agents x classes), from the models the agents kept."""
    prototypes = np.zeros((config.num_clients, config.num_classes, 8))
    counts = np.zeros((config.num_clients, config.num_classes))
    for agent in range(config.num_clients):
        model = agent_model(config, agent, grid.contexts[grid.node_of(agent)].state)
        model.eval()
        data = client_data(config, agent)
        with torch.no_grad():
            z = model.body(torch.tensor(data.x_train)).double().numpy()
        for j in range(config.num_classes):
            held = data.y_train == j
            counts[agent, j] = held.sum()
            if held.any():
                prototypes[agent, j] = z[held].mean(axis=0)
    return prototypes, counts


def test_a_round_averages_the_agents_prototypes_by_their_class_counts() -> None:
    config, _start, result, _, grid = tiny_rounds(1, **AGENTS, fedproto_lambda=LAMBDA)
    prototypes, by_agent = _agents_prototypes(config, grid)
    counts = by_agent.sum(axis=0)
    expected = _weighted(prototypes, by_agent)
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


FOUR = {**AGENTS, "num_clients": 4, "sheaf_latent_dims": "8,8,8,8", "sheaf_hidden": "64,160,64,160"}


def _robust_oracle(
    aggregation: str, prototypes: np.ndarray, counts: np.ndarray, trim: float, clip: float
) -> np.ndarray:
    """Round 1's prototypes of every class under a robust aggregation, in plain numpy,
    over the agents holding the class: the trimmed mean (ceil(trim k) cut at each end),
    the median, or the count-weighted mean of the prototypes' updates from round 1's
    zeros, each scaled to at most clip x their median norm."""
    expected = np.zeros(prototypes.shape[1:])
    for j in range(prototypes.shape[1]):
        held = prototypes[counts[:, j] > 0, j]
        k = len(held)
        if aggregation == "trimmed-mean":
            cut = int(np.ceil(trim * k - 1e-9))
            expected[j] = np.sort(held, axis=0)[cut : k - cut].mean(axis=0)
        elif aggregation == "median":
            expected[j] = np.median(held, axis=0)
        else:
            norms = np.linalg.norm(held, axis=1)
            scaled = held * np.minimum(1.0, clip * np.median(norms) / norms)[:, None]
            weights = counts[counts[:, j] > 0, j]
            expected[j] = weights @ scaled / weights.sum()
    return expected


def _weighted(prototypes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    total = np.einsum("ac,acd->cd", counts, prototypes)
    return total / np.maximum(counts.sum(axis=0), 1)[:, None]


@pytest.mark.parametrize("aggregation", ["trimmed-mean", "median", "clipped-mean"])
def test_a_robust_aggregation_combines_each_class_over_the_agents_holding_it(
    aggregation: str,
) -> None:
    trim, clip = 0.25, 0.9
    config, _start, result, _, grid = tiny_rounds(
        1,
        **FOUR,
        fedproto_lambda=LAMBDA,
        aggregation=aggregation,
        aggregation_trim=trim,
        aggregation_clip=clip,
    )
    prototypes, counts = _agents_prototypes(config, grid)
    expected = _robust_oracle(aggregation, prototypes, counts, trim, clip)
    assert np.max(np.abs(result[PROTOTYPES] - expected)) < 1e-5
    assert np.array_equal(result[PROTOTYPE_COUNTS], counts.sum(axis=0))
    # The test can fail: the count-weighted mean is another point
    assert np.max(np.abs(result[PROTOTYPES] - _weighted(prototypes, counts))) > 1e-4


def test_a_class_held_by_too_few_replies_to_trim_keeps_its_last_prototype() -> None:
    # Round 2 leaves out two of the four agents (non-finite prototypes): every class is
    # held by two replies, which trim 0.25 would cut to none, so round 1's stay.
    _config, _start, after_one, _, _ = tiny_rounds(1, **FOUR, aggregation="trimmed-mean")
    _config, _start, after_two, _, _ = tiny_rounds(
        2, **FOUR, aggregation="trimmed-mean", fault_injection="nan:1+2@2"
    )
    assert np.array_equal(after_two[PROTOTYPES], after_one[PROTOTYPES])
    assert np.array_equal(after_two[PROTOTYPE_COUNTS], after_one[PROTOTYPE_COUNTS])
    assert after_one[PROTOTYPE_COUNTS].sum() > 0
    # The test can fail: without the faults, round 2 moves the prototypes
    _config, _start, clean_two, _, _ = tiny_rounds(2, **FOUR, aggregation="trimmed-mean")
    assert np.max(np.abs(clean_two[PROTOTYPES] - after_one[PROTOTYPES])) > 1e-4
