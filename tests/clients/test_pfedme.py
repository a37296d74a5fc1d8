"""pFedMe against its equations (T Dinh et al., NeurIPS 2020, Algorithm 1): two rounds
of a tiny problem through the in-process grid (the real ClientApp and pFedMe's server),
half the clients a round, against the inner steps on theta, the local steps on w_i and
the server's beta step written here in plain torch, one full batch per local round."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedpers import protocol
from fedpers.config import RunConfig, load_run_config
from fedpers.settings import ConfigError
from tests.clients.test_fedprox import _forward, _largest_gap, tiny_rounds, training_tensors

LAMBDA, K, PERSONAL_LR, BETA = 5.0, 3, 0.05, 0.7

Params = dict[str, torch.Tensor]


def _pfedme_oracle(
    config: RunConfig,
    start: dict[str, np.ndarray],
    sampled: list[list[int]],
    *,
    k: int = K,
    beta: float = BETA,
) -> tuple[dict[str, np.ndarray], dict[int, Params]]:
    """Per client from the global w: theta = w_i = w; per local round K steps
    theta <- theta - plr (grad f(theta) + lambda (theta - w_i)), then
    w_i <- w_i - lr lambda (w_i - theta). Server: w + beta (mean w_i - w), unweighted."""
    w = {key: torch.tensor(v, dtype=torch.float64) for key, v in start.items()}
    personal: dict[int, Params] = {}
    for clients in sampled:
        replies = []
        for i in clients:
            x, y = training_tensors(config, i)
            theta, w_i = dict(w), dict(w)
            for _ in range(config.epochs):
                for _ in range(k):
                    p = {key: v.clone().requires_grad_(True) for key, v in theta.items()}
                    grads = torch.autograd.grad(
                        F.cross_entropy(_forward(p, x), y), list(p.values())
                    )
                    theta = {
                        key: v - PERSONAL_LR * (g + LAMBDA * (v - w_i[key]))
                        for (key, v), g in zip(theta.items(), grads, strict=True)
                    }
                w_i = {key: v - config.lr * LAMBDA * (v - theta[key]) for key, v in w_i.items()}
            personal[i] = theta
            replies.append(w_i)
        mean = {key: sum(r[key] for r in replies) / len(replies) for key in w}
        w = {key: v + beta * (mean[key] - v) for key, v in w.items()}
    return {key: v.numpy() for key, v in w.items()}, personal


def test_two_rounds_of_pfedme_are_algorithm_1() -> None:
    config, start, result, sampled, grid = tiny_rounds(
        2,
        algorithm="pfedme",
        fraction_train=0.5,
        pfedme_lambda=LAMBDA,
        pfedme_k=K,
        pfedme_personal_lr=PERSONAL_LR,
        pfedme_beta=BETA,
    )
    oracle, personal = _pfedme_oracle(config, start, sampled)
    assert _largest_gap(result, oracle) < 1e-6
    # The personal model theta of the last round's clients is kept on their nodes
    for partition in sampled[-1]:
        state = grid.contexts[grid.node_of(partition)].state
        kept = {key: v.numpy() for key, v in state[protocol.STATE_PERSONAL].items()}
        expected = {key: t.numpy() for key, t in personal[partition].items()}
        assert _largest_gap(kept, expected) < 1e-6
    # The test can fail: with the mean itself (beta = 1), or one inner step (K = 1)
    for wrong in ({"beta": 1.0}, {"k": 1}):
        other, _ = _pfedme_oracle(config, start, sampled, **wrong)
        assert _largest_gap(result, other) > 1e-4, wrong


def test_pfedme_keeps_state_and_refuses_a_step_past_theta_and_dp() -> None:
    assert load_run_config({"algorithm": "pfedme"}).spec.keeps_state  # theta
    with pytest.raises(ConfigError, match=r"so that lr lambda <= 1"):
        load_run_config({"algorithm": "pfedme", "lr": 0.1, "pfedme-lambda": 15.0})
    with pytest.raises(ConfigError, match="steps by pfedme-beta"):
        load_run_config({"algorithm": "pfedme", "dp": "central"})
