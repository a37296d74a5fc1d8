"""L2GD against its equations (Hanzely and Richtarik, 2020, Algorithm 1): rounds of a
tiny problem through the in-process grid (the real ClientApp and L2GD's server), half
the clients a round, against every client's personal model ``x_i`` stepped here in
plain torch and the mean of ALL of them computed directly (the server keeps it from the
sampled clients' changes alone)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedpers import protocol
from fedpers.config import RunConfig, load_run_config
from fedpers.seeding import rng
from fedpers.settings import ConfigError
from fedpers.strategies import build_strategy
from tests.clients.test_fedprox import _forward, _largest_gap, tiny_rounds, training_tensors

P, LAMBDA = 0.75, 3.0
ROUNDS = 4

Params = dict[str, torch.Tensor]


def _coin(config: RunConfig, server_round: int, p: float) -> bool:
    """The round's draw: an aggregation step with probability ``p``."""
    return bool(rng(config.seed, "l2gd", server_round).random() < p)


def _l2gd_oracle(
    config: RunConfig,
    start: dict[str, np.ndarray],
    sampled: list[list[int]],
    *,
    theta: float,
    sampled_mean: bool = False,
) -> tuple[dict[str, np.ndarray], dict[int, Params]]:
    """Every x_i starts at the initial model. An aggregation round moves each sampled
    x_i by ``theta`` toward the mean of all x_j; a local round takes ``epochs``
    full-batch gradient steps of f_i from x_i. The global model is the mean of all x_i
    (``sampled_mean``: of the sampled ones only, FedAvg's server, to show the test can
    fail)."""
    initial = {k: torch.tensor(v, dtype=torch.float64) for k, v in start.items()}
    models = {i: dict(initial) for i in range(config.num_clients)}
    mean = dict(initial)
    for server_round, clients in enumerate(sampled, start=1):
        aggregate = _coin(config, server_round, P)
        for i in clients:
            x_i = models[i]
            if aggregate:
                x_i = {k: v - theta * (v - mean[k]) for k, v in x_i.items()}
            else:
                x, y = training_tensors(config, i)
                for _ in range(config.epochs):
                    p = {k: v.clone().requires_grad_(True) for k, v in x_i.items()}
                    grads = torch.autograd.grad(
                        F.cross_entropy(_forward(p, x), y), list(p.values())
                    )
                    x_i = {
                        k: v - config.lr * g for (k, v), g in zip(x_i.items(), grads, strict=True)
                    }
            models[i] = x_i
        pool = clients if sampled_mean else list(models)
        mean = {k: sum(models[i][k] for i in pool) / len(pool) for k in mean}
    return {k: v.numpy() for k, v in mean.items()}, models


def test_rounds_of_l2gd_are_algorithm_1_and_the_server_keeps_the_mean_of_all() -> None:
    config, start, result, sampled, grid = tiny_rounds(
        ROUNDS, algorithm="l2gd", fraction_train=0.5, l2gd_p=P, l2gd_lambda=LAMBDA
    )
    coins = [_coin(config, r, P) for r in range(1, ROUNDS + 1)]
    assert any(coins)  # both kinds of step happen
    assert not all(coins)
    # Compute-matched sampling: a local step's round trains clients_per_round / (1 - p)
    # clients (here all of them), an aggregation step's clients_per_round.
    k = config.clients_per_round
    local = min(config.num_clients, round(k / (1 - P)))
    assert local > k
    assert [len(s) for s in sampled] == [k if c else local for c in coins]
    theta = config.lr * LAMBDA * (1 - P) / P
    oracle, models = _l2gd_oracle(config, start, sampled, theta=theta)
    assert _largest_gap(result, oracle) < 1e-6
    # Each client's x_i is kept on its node (untouched if it was never sampled)
    for partition in range(config.num_clients):
        state = grid.contexts[grid.node_of(partition)].state
        expected = {k: t.numpy() for k, t in models[partition].items()}
        if protocol.STATE_PERSONAL in state:
            kept = {k: v.numpy() for k, v in state[protocol.STATE_PERSONAL].items()}
            assert _largest_gap(kept, expected) < 1e-6
        else:
            assert _largest_gap(start, expected) == 0.0
    # The test can fail: with FedAvg's mean of the sampled models, or with the pull
    # lr lambda of the FedRep authors' code (not the paper's lr lambda (1 - p) / p).
    wrong_mean, _ = _l2gd_oracle(config, start, sampled, theta=theta, sampled_mean=True)
    assert _largest_gap(result, wrong_mean) > 1e-4
    _, wrong_models = _l2gd_oracle(config, start, sampled, theta=config.lr * LAMBDA)
    gaps = [
        _largest_gap(
            {k: t.numpy() for k, t in models[i].items()},
            {k: t.numpy() for k, t in wrong_models[i].items()},
        )
        for i in models
    ]
    assert max(gaps) > 1e-4


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_matched_l2gd_trains_as_many_clients_a_round_as_the_other_rows(p: float) -> None:
    """Over 20,000 rounds of the coin: the clients trained per round (0 on an
    aggregation step) average clients_per_round within 6 % (the coin's spread is below
    2 % there), against (1 - p) clients_per_round without the matching."""
    rounds = range(1, 20001)
    trained = {}
    for matched in (True, False):
        config = load_run_config(
            {"algorithm": "l2gd", "l2gd-p": p, "l2gd-lambda": 0.1, "l2gd-matched": matched}
        )
        strategy = build_strategy(config)
        counts = [0 if strategy.aggregates(r) else strategy.clients_to_train(r) for r in rounds]
        trained[matched] = float(np.mean(counts))
    k = config.clients_per_round
    assert k == 10
    assert trained[True] == pytest.approx(k, rel=0.06)
    assert trained[False] == pytest.approx((1 - p) * k, rel=0.06)


def test_l2gd_keeps_state_and_refuses_a_pull_past_the_mean_and_dp() -> None:
    assert load_run_config({"algorithm": "l2gd"}).spec.keeps_state  # x_i
    with pytest.raises(ConfigError, match=r"'l2gd-p' = 1\.0 must be in \(0, 1\)"):
        load_run_config({"algorithm": "l2gd", "l2gd-p": 1.0})
    with pytest.raises(ConfigError, match=r"lr lambda \(1 - p\) / p <= 1"):
        load_run_config({"algorithm": "l2gd", "lr": 0.5, "l2gd-lambda": 10.0, "l2gd-p": 0.5})
    with pytest.raises(ConfigError, match="tracks the mean of all personal models"):
        load_run_config({"algorithm": "l2gd", "dp": "central"})
