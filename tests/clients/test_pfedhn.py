"""pFedHN against its equations (Shamsian et al., ICML 2021, Algorithm 1): three rounds on
a tiny problem through the in-process grid (the real ClientApp and the pFedHN server),
half the clients a round, against a hypernetwork written here in torch whose gradients
come from autograd (``autograd.grad(theta_i, phi, grad_outputs=theta_i - theta~_i)``,
as the authors compute them), the clients' gradient steps on their generated models,
and the server's SGD step with the authors' clipping and weight decay."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedpers.algorithms.pfedhn import EMBEDDINGS, MODEL, PREFIX
from fedpers.config import RunConfig, load_run_config
from fedpers.settings import ConfigError
from tests.clients.test_fedprox import _forward, _largest_gap, tiny_rounds, training_tensors

LR = 0.05
CLIP = 0.05  # binds for some replies of the tiny problem
DECAY = 0.01
ROUNDS = 3

Params = dict[str, torch.Tensor]


def _theta(phi: Params, v: torch.Tensor, hidden: int) -> torch.Tensor:
    """The authors' MLP: Linear, then (ReLU, Linear) x hidden, then the output layer."""
    a = phi[f"{PREFIX}0.weight"] @ v + phi[f"{PREFIX}0.bias"]
    for layer in range(1, hidden + 1):
        a = phi[f"{PREFIX}{layer}.weight"] @ torch.relu(a) + phi[f"{PREFIX}{layer}.bias"]
    return phi[f"{PREFIX}out.weight"] @ a + phi[f"{PREFIX}out.bias"]


def _oracle(
    config: RunConfig,
    start: dict[str, np.ndarray],
    sampled: list[list[int]],
    *,
    lr: float = LR,
    sign: float = 1.0,
    clip: float = CLIP,
    decay: float = DECAY,
) -> dict[str, np.ndarray]:
    """Per round: theta_i = h(v_i) for each sampled i, ``epochs`` full-batch steps from
    it, then phi <- phi - lr mean_i grad_phi and v_i <- v_i - lr grad_v_i of
    <theta_i, theta_i - theta~_i> (``sign`` -1 steps the other way, so that the test
    can fail)."""
    names = sorted(k[len(MODEL) :] for k in start if k.startswith(MODEL))
    shapes = {n: tuple(int(d) for d in start[MODEL + n]) for n in names}
    phi = {
        k: torch.tensor(v, dtype=torch.float64) for k, v in start.items() if k.startswith(PREFIX)
    }
    hidden = sum(k.endswith(".weight") for k in phi) - 2
    for clients in sampled:
        layer_grads, embedding_grads = [], {}
        for i in clients:
            leaves = {k: v.clone().requires_grad_(True) for k, v in phi.items()}
            flat = _theta(leaves, leaves[EMBEDDINGS][i], hidden)
            sent = flat.detach().float().double()  # the client receives float32
            w, at = {}, 0
            for n in names:
                size = int(np.prod(shapes[n]))
                w[n] = sent[at : at + size].reshape(shapes[n])
                at += size
            x, y = training_tensors(config, i)
            for _ in range(config.epochs):
                p = {k: v.clone().requires_grad_(True) for k, v in w.items()}
                grads = torch.autograd.grad(F.cross_entropy(_forward(p, x), y), list(p.values()))
                w = {k: w[k] - config.lr * d for k, d in zip(w, grads, strict=True)}
            delta = sent - torch.cat([w[n].flatten() for n in names])
            grads = torch.autograd.grad(flat, list(leaves.values()), grad_outputs=sign * delta)
            norm = torch.sqrt(sum((g**2).sum() for g in grads))  # clip_grad_norm_'s
            grads = [g * min(1.0, clip / (float(norm) + 1e-6)) for g in grads]
            by_name = dict(zip(leaves, grads, strict=True))
            embedding_grads[i] = by_name.pop(EMBEDDINGS)[i]
            layer_grads.append(by_name)
        for k in layer_grads[0]:
            mean = torch.stack([g[k] for g in layer_grads]).mean(0)
            phi[k] = phi[k] - lr * (mean + decay * phi[k])
        step = torch.zeros_like(phi[EMBEDDINGS])
        for i, g in embedding_grads.items():
            step[i] = g
        phi[EMBEDDINGS] = phi[EMBEDDINGS] - lr * (step + decay * phi[EMBEDDINGS])
    return {k: v.numpy() for k, v in phi.items()}


def test_three_rounds_of_pfedhn_are_algorithm_1() -> None:
    config, start, result, sampled, _ = tiny_rounds(
        ROUNDS,
        algorithm="pfedhn",
        fraction_train=0.5,
        pfedhn_lr=LR,
        pfedhn_hidden=16,
        pfedhn_layers=2,
        pfedhn_clip=CLIP,
        pfedhn_weight_decay=DECAY,
    )
    assert start[EMBEDDINGS].shape == (config.num_clients, 1 + config.num_clients // 4)
    oracle = _oracle(config, start, sampled)
    trained = {k: v for k, v in result.items() if k.startswith(PREFIX)}
    assert _largest_gap(trained, oracle) < 1e-6
    assert all(np.array_equal(result[k], start[k]) for k in start if k.startswith(MODEL))
    # The test can fail: without the clip, or without the weight decay.
    assert _largest_gap(trained, _oracle(config, start, sampled, clip=1e9)) > 1e-6
    assert _largest_gap(trained, _oracle(config, start, sampled, decay=0.0)) > 1e-6
    # The test can fail: with the step the other way, or with lr off by a tenth.
    assert _largest_gap(trained, _oracle(config, start, sampled, sign=-1.0)) > 1e-4
    assert _largest_gap(trained, _oracle(config, start, sampled, lr=1.1 * LR)) > 1e-4


def test_pfedhn_keeps_nothing_on_devices_and_refuses_dp_and_bad_settings() -> None:
    assert not load_run_config({"algorithm": "pfedhn"}).spec.keeps_state
    with pytest.raises(ConfigError, match="'dp' = 'central' does not cover 'pfedhn'"):
        load_run_config({"algorithm": "pfedhn", "dp": "central"})
    bad = {
        "pfedhn-lr": (0.0, float("nan"), float("inf"), 1e9),
        "pfedhn-hidden": (0, -1),
        "pfedhn-layers": (-1,),
        "pfedhn-embed-dim": (-2,),
        "pfedhn-clip": (0.0, float("inf")),
        "pfedhn-weight-decay": (-1e-3, float("nan")),
    }
    for key, values in bad.items():
        for value in values:
            with pytest.raises(ConfigError, match=key):
                load_run_config({"algorithm": "pfedhn", key: value})
