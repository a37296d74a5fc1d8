"""MOON against its equations (Li et al., CVPR 2021, Algorithm 1): three rounds on a
tiny problem through the in-process grid (the real ClientApp and the FedAvg server),
half the clients a round, against the clients' steps on the cross-entropy plus the
model-contrastive term and the server's sample-weighted mean, written here in plain
torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedpers.algorithms.moon import STATE_PREVIOUS
from fedpers.config import RunConfig, load_run_config
from fedpers.settings import ConfigError
from tests.clients.test_fedprox import _forward, _largest_gap, tiny_rounds, training_tensors

MU = 2.0
TAU = 0.5
ROUNDS = 3

Params = dict[str, torch.Tensor]


def _body(w: Params, x: torch.Tensor) -> torch.Tensor:
    """The digits MLP's body, 64-128-64 with ReLU, written out."""
    h = torch.relu(x @ w["body.0.weight"].T + w["body.0.bias"])
    return torch.relu(h @ w["body.2.weight"].T + w["body.2.bias"])


def _loss(w: Params, glob: Params, prev: Params | None, x, y, mu: float, tau: float):
    """Cross-entropy + mu * -log(e^{sim(z,zg)/tau} / (e^{sim(z,zg)/tau} + e^{sim(z,zp)/tau}))
    averaged over the samples; no negative (and no term) without a previous model."""
    loss = F.cross_entropy(_forward(w, x), y)
    if prev is None:
        return loss
    z, zg, zp = _body(w, x), _body(glob, x), _body(prev, x)
    pos = torch.exp(F.cosine_similarity(z, zg, dim=1) / tau)
    neg = torch.exp(F.cosine_similarity(z, zp, dim=1) / tau)
    return loss - mu * torch.log(pos / (pos + neg)).mean()


def _oracle(
    config: RunConfig,
    start: dict[str, np.ndarray],
    sampled: list[list[int]],
    mu: float,
    tau: float = TAU,
) -> tuple[dict[str, np.ndarray], dict[int, Params]]:
    """``epochs`` full-batch gradient steps on each sampled client's MOON loss from the
    global model; the server's mean weighted by training samples. Returns the global
    model and each client's previous body."""
    theta: Params = {k: torch.tensor(v, dtype=torch.float64) for k, v in start.items()}
    previous: dict[int, Params] = {}
    for clients in sampled:
        models, sizes = [], []
        for partition in clients:
            x, y = training_tensors(config, partition)
            w = {k: v.clone() for k, v in theta.items()}
            for _ in range(config.epochs):
                p = {k: v.clone().requires_grad_(True) for k, v in w.items()}
                loss = _loss(p, theta, previous.get(partition), x, y, mu, tau)
                grads = torch.autograd.grad(loss, list(p.values()))
                w = {k: w[k] - config.lr * d for k, d in zip(w, grads, strict=True)}
            previous[partition] = {k: v for k, v in w.items() if k.startswith("body.")}
            models.append(w)
            sizes.append(len(y))
        weights = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
        theta = {k: sum(wt * m[k] for wt, m in zip(weights, models, strict=True)) for k in theta}
    return {k: v.numpy() for k, v in theta.items()}, previous


def test_three_rounds_of_moon_are_algorithm_1() -> None:
    config, start, result, sampled, grid = tiny_rounds(
        ROUNDS, algorithm="moon", fraction_train=0.5, moon_mu=MU, moon_tau=TAU
    )
    assert all(len(s) == 2 for s in sampled)
    # Some client is sampled twice, so its contrastive term is not zero.
    assert any(set(a) & set(b) for i, a in enumerate(sampled) for b in sampled[i + 1 :])
    oracle, previous = _oracle(config, start, sampled, MU)
    assert _largest_gap(result, oracle) < 1e-6
    for partition in range(config.num_clients):
        state = grid.contexts[grid.node_of(partition)].state
        if partition in previous:
            kept = {k: v.numpy() for k, v in state[STATE_PREVIOUS].items()}
            assert _largest_gap(kept, {k: v.numpy() for k, v in previous[partition].items()}) < 1e-6
        else:
            assert STATE_PREVIOUS not in state
    # The test can fail: without the contrastive term (FedAvg's steps), or with mu or
    # tau off by a tenth, the oracle is far from what MOON computed.
    fedavg, _ = _oracle(config, start, sampled, 0.0)
    assert _largest_gap(result, fedavg) > 1e-4
    for wrong in ({"mu": 1.1 * MU}, {"mu": MU, "tau": 1.1 * TAU}):
        other, _ = _oracle(config, start, sampled, **wrong)
        assert _largest_gap(result, other) > 1e-5, wrong


def test_moon_keeps_state_and_refuses_a_bad_mu_or_tau() -> None:
    config = load_run_config({"algorithm": "moon"})
    assert config.spec.keeps_state  # the previous body: an exact resume needs client-state-dir
    for key in ("moon-mu", "moon-tau"):
        for bad in (0.0, -0.1, float("nan"), float("inf")):
            with pytest.raises(ConfigError, match=key):
                load_run_config({"algorithm": "moon", key: bad})
