"""Per-FedAvg against its equations (Fallah et al., NeurIPS 2020, Algorithm 1, FO and
HF): one round on a tiny problem through the in-process grid (the real ClientApp and
the FedAvg server), against the meta-steps written here in plain torch (float64, the
Hessian-vector product by torch.autograd.functional.hvp); then the one step of
adaptation before a client's test."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord

from fedpers import protocol
from fedpers.config import RunConfig, load_run_config
from fedpers.data.client import client_data
from fedpers.settings import ConfigError
from tests.clients.test_fedprox import (
    TINY,
    _forward,
    _largest_gap,
    tiny_rounds,
    training_tensors,
)
from tests.helpers import client_of, run_config

ALPHA = 0.2


def _loss_of(names: list[str], x: torch.Tensor, y: torch.Tensor) -> Any:
    def loss(*flat: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_forward(dict(zip(names, flat, strict=True)), x), y)

    return loss


def _oracle(
    config: RunConfig, start: dict[str, np.ndarray], alpha: float, *, hessian: bool
) -> dict[str, np.ndarray]:
    """Each epoch one full-batch meta-step (D = D' = D'' = the client's training data):
    w' = w - alpha grad f(w); FO: w <- w - lr grad f(w'); HF: w <- w - lr (grad f(w') -
    alpha H(w) grad f(w')). Then the average of the clients' w weighted by samples."""
    names = list(start)
    total = {k: np.zeros_like(v, dtype=np.float64) for k, v in start.items()}
    samples = 0
    for partition in range(config.num_clients):
        x, y = training_tensors(config, partition)
        loss = _loss_of(names, x, y)
        w = tuple(torch.tensor(start[k], dtype=torch.float64) for k in names)
        for _ in range(config.epochs):
            inner = torch.autograd.functional.jacobian(loss, w)
            adapted = tuple(p - alpha * g for p, g in zip(w, inner, strict=True))
            outer = torch.autograd.functional.jacobian(loss, adapted)
            if hessian:
                _, hv = torch.autograd.functional.hvp(loss, w, outer)
                outer = tuple(g - alpha * h for g, h in zip(outer, hv, strict=True))
            w = tuple(p - config.lr * g for p, g in zip(w, outer, strict=True))
        for k, v in zip(names, w, strict=True):
            total[k] += len(y) * v.numpy()
        samples += len(y)
    return {k: v / samples for k, v in total.items()}


@pytest.mark.parametrize(
    ("algorithm", "hessian", "key", "other"),
    [
        ("per-fedavg", False, "per_fedavg_alpha", "per_fedavg_hf_alpha"),
        ("per-fedavg-hf", True, "per_fedavg_hf_alpha", "per_fedavg_alpha"),
    ],
)
def test_one_round_of_per_fedavg_is_algorithm_1(
    algorithm: str, hessian: bool, key: str, other: str
) -> None:
    # Each row reads its own alpha: the other row's key, set to 0, changes nothing
    config, start, result, _, _ = tiny_rounds(1, algorithm=algorithm, **{key: ALPHA, other: 0.0})
    assert _largest_gap(result, _oracle(config, start, ALPHA, hessian=hessian)) < 1e-6
    # The test can fail: the other variant, and FedAvg's plain steps (alpha = 0), are
    # far from what this one computed.
    assert _largest_gap(result, _oracle(config, start, ALPHA, hessian=not hessian)) > 1e-5
    assert _largest_gap(result, _oracle(config, start, 0.0, hessian=hessian)) > 1e-4


def test_a_client_is_tested_after_one_step_of_adaptation() -> None:
    values = run_config(**{**TINY, "algorithm": "per-fedavg", "per_fedavg_alpha": ALPHA})
    run = RunConfig.from_mapping(values)
    client = client_of(run, 1)
    w = client.initial_arrays()
    metrics = client.evaluate(dict(w), ConfigRecord({protocol.ROUND: 3}))
    data = client_data(run, 1)
    names = list(w)
    x = torch.tensor(data.x_train, dtype=torch.float64)
    y = torch.tensor(data.y_train, dtype=torch.int64)
    params = tuple(torch.tensor(w[k], dtype=torch.float64) for k in names)
    grads = torch.autograd.functional.jacobian(_loss_of(names, x, y), params)

    def test_loss(alpha: float) -> float:
        adapted = tuple(p - alpha * g for p, g in zip(params, grads, strict=True))
        x_test = torch.tensor(data.x_test, dtype=torch.float64)
        y_test = torch.tensor(data.y_test, dtype=torch.int64)
        return float(_loss_of(names, x_test, y_test)(*adapted))

    # (batch-size covers the whole training set here: the step is a full-batch one)
    assert metrics[protocol.LOSS] == pytest.approx(test_loss(ALPHA), rel=1e-5)
    assert abs(metrics[protocol.LOSS] - test_loss(0.0)) > 1e-3  # not the model as sent


@pytest.mark.parametrize("key", ["per-fedavg-alpha", "per-fedavg-hf-alpha"])
def test_alpha_must_not_be_negative(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{key}' = -0\.1 must be at least 0"):
        load_run_config({"algorithm": "per-fedavg", key: -0.1})
