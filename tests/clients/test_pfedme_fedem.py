"""pFedMe as FedEM's code runs it: rounds of a tiny problem through the in-process grid
(the real ClientApp and the MeanOfAll server), against every client's personal model
stepped here in plain torch (full-batch gradient steps on f_i + (mu/2)||v - w||^2 from
its own v_i, never replaced by w) and w computed directly as the mean of ALL of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedpers import protocol
from fedpers.config import RunConfig, load_run_config
from fedpers.settings import ConfigError
from tests.clients.test_fedprox import _forward, _largest_gap, tiny_rounds, training_tensors

MU = 0.5
ROUNDS = 3

Params = dict[str, torch.Tensor]


def _oracle(
    config: RunConfig, start: dict[str, np.ndarray], sampled: list[list[int]], *, replace: bool
) -> tuple[dict[str, np.ndarray], dict[int, Params]]:
    """``replace``: each sampled client starts from w instead of its own v_i (FedProx
    with a mean of all: what the row must not be, to show the test can fail)."""
    initial = {k: torch.tensor(v, dtype=torch.float64) for k, v in start.items()}
    models = {i: dict(initial) for i in range(config.num_clients)}
    mean = dict(initial)
    for clients in sampled:
        for i in clients:
            v = dict(mean) if replace else models[i]
            x, y = training_tensors(config, i)
            for _ in range(config.epochs):
                p = {k: t.clone().requires_grad_(True) for k, t in v.items()}
                prox = sum((p[k] - mean[k]).pow(2).sum() for k in p)
                loss = F.cross_entropy(_forward(p, x), y) + 0.5 * MU * prox
                grads = torch.autograd.grad(loss, list(p.values()))
                v = {k: t - config.lr * g for (k, t), g in zip(v.items(), grads, strict=True)}
            models[i] = v
        mean = {k: sum(models[i][k] for i in models) / len(models) for k in mean}
    return {k: t.numpy() for k, t in mean.items()}, models


def test_rounds_are_proximal_personal_models_and_the_mean_of_all() -> None:
    config, start, result, sampled, grid = tiny_rounds(
        ROUNDS, algorithm="pfedme-fedem", fraction_train=0.5, pfedme_fedem_mu=MU
    )
    assert len({tuple(s) for s in sampled}) > 1  # different clients trained
    oracle, models = _oracle(config, start, sampled, replace=False)
    assert _largest_gap(result, oracle) < 1e-6
    for partition in range(config.num_clients):
        state = grid.contexts[grid.node_of(partition)].state
        expected = {k: t.numpy() for k, t in models[partition].items()}
        if protocol.STATE_PERSONAL in state:
            kept = {k: v.numpy() for k, v in state[protocol.STATE_PERSONAL].items()}
            assert _largest_gap(kept, expected) < 1e-6
        else:
            assert _largest_gap(start, expected) == 0.0
    wrong, _ = _oracle(config, start, sampled, replace=True)
    assert _largest_gap(result, wrong) > 1e-4


def test_the_row_refuses_a_step_past_the_mean_and_dp() -> None:
    assert load_run_config({"algorithm": "pfedme-fedem"}).spec.keeps_state
    with pytest.raises(ConfigError, match=r"lr mu <= 1"):
        load_run_config({"algorithm": "pfedme-fedem", "lr": 1.0, "pfedme-fedem-mu": 2.0})
    with pytest.raises(ConfigError, match="tracks the mean of all personal models"):
        load_run_config({"algorithm": "pfedme-fedem", "dp": "central"})
