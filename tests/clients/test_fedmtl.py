"""Fed-MTL against its regularizer (FedRep's MTL baseline, Smith et al. 2017 with Omega
fixed): two rounds of a tiny problem through the in-process grid (the real ClientApp
and Fed-MTL's server), half the clients a round, against full-batch gradient steps on
f_i(w_i) + c (||W||_F^2 + tr(W Omega W^T)) written here in its matrix form, W the
sampled clients' models as columns (the others at their values when the round began)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedpers import protocol
from fedpers.algorithms.fed_mtl import TASK
from fedpers.config import RunConfig, load_run_config
from fedpers.settings import ConfigError
from tests.clients.test_fedprox import _forward, _largest_gap, tiny_rounds, training_tensors

C = 0.05

Params = dict[str, torch.Tensor]


def _flat(model: Params) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in model.values()])


def _fedmtl_oracle(
    config: RunConfig,
    start: dict[str, np.ndarray],
    sampled: list[list[int]],
    *,
    c: float = C,
    elementwise: bool = False,
) -> dict[int, Params]:
    """Each sampled w_i: ``epochs`` full-batch steps of f_i + c (||W||^2 + tr(W Omega
    W^T)), Omega = I - 11^T/m (``elementwise``: the FedRep code's Omega squared entry
    by entry, to show that the test can fail)."""
    initial = {k: torch.tensor(v, dtype=torch.float64) for k, v in start.items()}
    models = {i: dict(initial) for i in range(config.num_clients)}
    for clients in sampled:
        m = len(clients)
        omega = torch.eye(m, dtype=torch.float64) - torch.ones(m, m, dtype=torch.float64) / m
        if elementwise:
            omega = omega**2
        begun = {i: _flat(models[i]) for i in clients}
        for i in clients:
            x, y = training_tensors(config, i)
            w = dict(models[i])
            for _ in range(config.epochs):
                p = {k: v.clone().requires_grad_(True) for k, v in w.items()}
                W = torch.stack(
                    [_flat(p) if j == i else begun[j] for j in clients], dim=1
                )  # d x m, column i live
                regularizer = c * (W.pow(2).sum() + torch.trace(omega @ W.T @ W))
                loss = F.cross_entropy(_forward(p, x), y) + regularizer
                grads = torch.autograd.grad(loss, list(p.values()))
                w = {k: v - config.lr * g for (k, v), g in zip(w.items(), grads, strict=True)}
            models[i] = w
    return models


def _state(result: dict[str, np.ndarray], partition: int) -> dict[str, np.ndarray]:
    prefix = f"{TASK}{partition}."
    return {k.removeprefix(prefix): v for k, v in result.items() if k.startswith(prefix)}


def test_two_rounds_of_fed_mtl_are_gradient_steps_on_the_regularized_loss() -> None:
    config, start, result, sampled, grid = tiny_rounds(
        2, algorithm="fed-mtl", fraction_train=0.5, fed_mtl_lambda=C
    )
    model = _state(start, 0)  # every client starts from the initial model
    assert all(_largest_gap(_state(start, p), model) == 0.0 for p in range(config.num_clients))
    oracle = _fedmtl_oracle(config, model, sampled)
    for p in range(config.num_clients):
        expected = {k: t.numpy() for k, t in oracle[p].items()}
        assert _largest_gap(_state(result, p), expected) < 1e-6
        state = grid.contexts[grid.node_of(p)].state
        if protocol.STATE_PERSONAL in state:  # the device holds what the server does
            kept = {k: v.numpy() for k, v in state[protocol.STATE_PERSONAL].items()}
            assert _largest_gap(kept, expected) < 1e-6
    # The test can fail: with the FedRep code's elementwise-squared Omega, or without
    # the regularizer, the oracle is far from what Fed-MTL computed.
    for wrong in (
        _fedmtl_oracle(config, model, sampled, elementwise=True),
        _fedmtl_oracle(config, model, sampled, c=0.0),
    ):
        gaps = [
            _largest_gap(_state(result, p), {k: t.numpy() for k, t in wrong[p].items()})
            for p in range(config.num_clients)
        ]
        assert max(gaps) > 1e-4


def test_fed_mtl_keeps_state_and_refuses_dp() -> None:
    assert load_run_config({"algorithm": "fed-mtl"}).spec.keeps_state
    with pytest.raises(ConfigError, match="keeps and relays every personal model"):
        load_run_config({"algorithm": "fed-mtl", "dp": "central"})
    with pytest.raises(ConfigError, match=r"'fed-mtl-lambda' = -1\.0 must be at least"):
        load_run_config({"algorithm": "fed-mtl", "fed-mtl-lambda": -1.0})
