"""FedDyn against its equations (Acar et al., ICLR 2021, Algorithm 1): three rounds on a
tiny problem through the in-process grid (the real ClientApp and the FedDyn server),
half the clients a round, against the clients' steps on the dynamically regularized
loss, their ``g_k`` and the server's ``h`` and ``theta``, written here in plain torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedpers.algorithms.feddyn import STATE_GRADIENT, H
from fedpers.config import RunConfig, load_run_config
from fedpers.settings import ConfigError
from tests.clients.test_fedprox import _forward, _largest_gap, tiny_rounds, training_tensors

ALPHA = 0.3
ROUNDS = 3

Params = dict[str, torch.Tensor]


def _oracle(
    config: RunConfig,
    start: dict[str, np.ndarray],
    sampled: list[list[int]],
    alpha: float,
    *,
    linear: bool = True,
    server_h: bool = True,
) -> tuple[dict[str, np.ndarray], dict[int, dict[str, np.ndarray]]]:
    """Algorithm 1 with ``epochs`` full-batch gradient steps for the local minimum:
    w <- w - lr (grad L_k(w) - g_k + alpha (w - theta)); g_k <- g_k - alpha (w_k - theta);
    h <- h - alpha (|S| / N) mean_S(w_k - theta); theta <- mean_S(w_k) - h / alpha.
    Returns theta and h (as the global state) and every g_k. ``linear=False`` leaves
    the -g_k out of the steps, ``server_h=False`` the h out of the server's step (so
    that the test can show it fails without either)."""
    theta: Params = {
        k: torch.tensor(v, dtype=torch.float64) for k, v in start.items() if H not in k
    }
    h = {k: torch.zeros_like(v) for k, v in theta.items()}
    g = {p: {k: torch.zeros_like(v) for k, v in theta.items()} for p in range(config.num_clients)}
    for clients in sampled:
        models = []
        for partition in clients:
            x, y = training_tensors(config, partition)
            w = {k: v.clone() for k, v in theta.items()}
            for _ in range(config.epochs):
                p = {k: v.clone().requires_grad_(True) for k, v in w.items()}
                grads = torch.autograd.grad(F.cross_entropy(_forward(p, x), y), list(p.values()))
                w = {
                    k: w[k] - config.lr * (d - linear * g[partition][k] + alpha * (w[k] - theta[k]))
                    for k, d in zip(w, grads, strict=True)
                }
            g[partition] = {k: g[partition][k] - alpha * (w[k] - theta[k]) for k in w}
            models.append(w)
        mean = {k: torch.stack([m[k] for m in models]).mean(0) for k in theta}
        share = len(clients) / config.num_clients
        h = {k: h[k] - alpha * share * (mean[k] - theta[k]) for k in h}
        theta = {k: mean[k] - server_h * h[k] / alpha for k in theta}
    state = {k: v.numpy() for k, v in theta.items()} | {H + k: v.numpy() for k, v in h.items()}
    return state, {p: {k: v.numpy() for k, v in gp.items()} for p, gp in g.items()}


def test_three_rounds_of_feddyn_are_algorithm_1() -> None:
    config, start, result, sampled, grid = tiny_rounds(
        ROUNDS, algorithm="feddyn", fraction_train=0.5, feddyn_alpha=ALPHA
    )
    assert all(len(s) == 2 for s in sampled)
    assert len({tuple(s) for s in sampled}) > 1
    assert all(not np.any(v) for k, v in start.items() if k.startswith(H))  # h^0 = 0
    oracle, gradients = _oracle(config, start, sampled, ALPHA)
    assert _largest_gap(result, oracle) < 1e-6
    assert np.max(np.abs(result[H + "head.weight"])) > 1e-4  # h moved
    for partition in range(config.num_clients):
        state = grid.contexts[grid.node_of(partition)].state
        if any(partition in s for s in sampled):
            kept = {k: v.numpy() for k, v in state[STATE_GRADIENT].items()}
            assert _largest_gap(kept, gradients[partition]) < 1e-6
        else:
            assert STATE_GRADIENT not in state
    # The test can fail: without the clients' linear term, without the server's h, or
    # with alpha off by a tenth, the oracle is far from what FedDyn computed.
    for wrong in ({"linear": False}, {"server_h": False}):
        other, _ = _oracle(config, start, sampled, ALPHA, **wrong)
        assert _largest_gap(result, other) > 1e-4, wrong
    other, _ = _oracle(config, start, sampled, 1.1 * ALPHA)
    assert _largest_gap(result, other) > 1e-5


def test_feddyn_keeps_state_sends_no_h_and_refuses_dp_and_a_bad_alpha() -> None:
    config = load_run_config({"algorithm": "feddyn"})
    assert config.spec.keeps_state  # g_k: an exact resume needs client-state-dir
    with pytest.raises(ConfigError, match="'dp' = 'central' does not cover 'feddyn'"):
        load_run_config({"algorithm": "feddyn", "dp": "central"})
    for bad in (0.0, -0.1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="feddyn-alpha"):
            load_run_config({"algorithm": "feddyn", "feddyn-alpha": bad})
