"""FedProx against its equations (Li et al., MLSys 2020, Algorithm 2): one round on a
tiny problem through the in-process grid (the real ClientApp and the FedAvg server),
against full-batch gradient steps on ``F_k(w) + (mu / 2) ||w - w^t||^2`` written here
in plain torch, the server's average weighted by training samples."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, RecordDict
from numpy.testing import assert_array_equal

from fedpers import protocol
from fedpers.clients.client_app import app as client_app
from fedpers.config import RunConfig
from fedpers.data.client import client_data
from fedpers.strategies import build_strategy
from tests.helpers import InProcessGrid, client_of, run_config

# One full batch per epoch, plain gradient steps: the order of the samples cannot
# matter, so the oracle needs no copy of the batch order.
TINY = {
    "dataset": "digits",
    "num_clients": 4,
    "fraction_train": 1.0,
    "batch_size": 100_000,
    "momentum": 0.0,
    "weight_decay": 0.0,
    "epochs": 3,
    "lr": 0.1,
}


class Rounds(NamedTuple):
    """What ``tiny_rounds`` ran: the configuration, the initial and final global arrays,
    the partitions sampled in each round, and the grid (its nodes' states)."""

    config: RunConfig
    start: dict[str, np.ndarray]
    result: dict[str, np.ndarray]
    sampled: list[list[int]]
    grid: InProcessGrid


def tiny_rounds(num_rounds: int, **overrides: Any) -> Rounds:
    """``num_rounds`` rounds of the TINY problem (with ``overrides``) through the
    in-process grid: the real ClientApp and the row's strategy."""
    values = run_config(**{**TINY, **overrides})
    config = RunConfig.from_mapping(values)
    grid = InProcessGrid(client_app, values, config.num_clients)
    strategy = build_strategy(config)
    strategy.federation.connect(grid, timeout=5)
    initial = strategy.initial_arrays(grid, timeout=5)
    result = strategy.start(grid, initial, num_rounds=num_rounds, timeout=5)
    return Rounds(
        config,
        {k: v.numpy() for k, v in initial.items()},
        {k: v.numpy() for k, v in result.arrays.items()},
        [strategy.sample(r) for r in range(1, num_rounds + 1)],
        grid,
    )


def training_tensors(config: RunConfig, partition: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A client's training inputs (float64, for the oracles) and labels."""
    data = client_data(config, partition)
    return (
        torch.tensor(data.x_train, dtype=torch.float64),
        torch.tensor(data.y_train, dtype=torch.int64),
    )


def _forward(w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The digits MLP, 64-128-64 | 64-10 with ReLU (``fedpers.models``), written out."""
    h = torch.relu(x @ w["body.0.weight"].T + w["body.0.bias"])
    h = torch.relu(h @ w["body.2.weight"].T + w["body.2.bias"])
    return h @ w["head.weight"].T + w["head.bias"]


def _fedprox_oracle(
    config: RunConfig, start: dict[str, np.ndarray], mu: float
) -> dict[str, np.ndarray]:
    """w_k <- w_k - lr (grad F_k(w_k) + mu (w_k - w^t)), ``epochs`` times from w^t on each
    client; then the average of the w_k weighted by training samples."""
    anchor = {k: torch.tensor(v, dtype=torch.float64) for k, v in start.items()}
    total = {k: np.zeros_like(v, dtype=np.float64) for k, v in start.items()}
    samples = 0
    for partition in range(config.num_clients):
        x, y = training_tensors(config, partition)
        w = {k: v.clone().requires_grad_(True) for k, v in anchor.items()}
        for _ in range(config.epochs):
            loss = F.cross_entropy(_forward(w, x), y)
            grads = torch.autograd.grad(loss, list(w.values()))
            with torch.no_grad():
                w = {
                    k: (v - config.lr * (g + mu * (v - anchor[k]))).requires_grad_(True)
                    for (k, v), g in zip(w.items(), grads, strict=True)
                }
        for k, v in w.items():
            total[k] += len(y) * v.detach().numpy()
        samples += len(y)
    return {k: v / samples for k, v in total.items()}


def _largest_gap(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def test_one_round_of_fedprox_is_the_proximal_gradient_steps_averaged() -> None:
    mu = 0.5
    config, start, result, _, _ = tiny_rounds(1, algorithm="fedprox", fedprox_mu=mu)
    oracle = _fedprox_oracle(config, start, mu)
    assert _largest_gap(result, oracle) < 1e-6
    # The test can fail: without the proximal term (FedAvg's steps), or with mu off by
    # a tenth, the oracle is far from what FedProx computed.
    assert _largest_gap(result, _fedprox_oracle(config, start, 0.0)) > 1e-4
    assert _largest_gap(result, _fedprox_oracle(config, start, 1.1 * mu)) > 1e-5


def test_mu_zero_is_fedavgs_update_to_the_bit_and_mu_pulls_toward_the_global_model() -> None:
    def client(algorithm: str, **overrides: Any) -> Any:
        run = RunConfig.from_mapping(
            run_config(algorithm=algorithm, dataset="digits", num_clients=10, **overrides)
        )
        return client_of(run, 2, RecordDict())

    train = ConfigRecord(
        {protocol.ROUND: 1, protocol.EPOCHS: 2, protocol.HEAD_EPOCHS: 2, protocol.LR: 0.05}
    )
    fedavg = client("fedavg")
    w = fedavg.initial_arrays()
    expected, _ = fedavg.fit(dict(w), train)
    reply, _ = client("fedprox", fedprox_mu=0.0).fit(dict(w), train)
    for name in expected:
        assert_array_equal(reply[name], expected[name])
    drift = {}
    for mu in (0.0, 10.0):
        reply, _ = client("fedprox", fedprox_mu=mu).fit(dict(w), train)
        drift[mu] = sum(float(((reply[k] - w[k]) ** 2).sum()) for k in w)
    assert drift[10.0] < 0.5 * drift[0.0]


@pytest.mark.parametrize("algorithm", ["fedprox", "fedprox-ft"])
def test_fedprox_shares_the_whole_model_and_keeps_nothing(algorithm: str) -> None:
    config = RunConfig.from_mapping(run_config(algorithm=algorithm, dataset="digits"))
    assert config.spec.shared == ("body", "head")
    assert not config.spec.keeps_state  # a resume needs no client-state-dir
    assert (config.spec.final_test == "finetune") == algorithm.endswith("-ft")
