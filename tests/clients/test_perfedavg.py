"""Per-FedAvg against its equations (Fallah et al., NeurIPS 2020, Algorithm 1, FO and
HF): one round on a tiny problem through the in-process grid (the real ClientApp and
the FedAvg server), and the update of a cohort of every client at once, against the
meta-steps written here in plain torch (float64, the Hessian-vector product by
torch.autograd.functional.hvp); then the one step of adaptation before a client's test,
alone and in a cohort."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, RecordDict

from fedpers import protocol
from fedpers.cohort import Cohort, Member
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


def _client_oracle(
    config: RunConfig,
    start: dict[str, np.ndarray],
    partition: int,
    alpha: float,
    *,
    hessian: bool,
) -> dict[str, np.ndarray]:
    """One client's ``w`` after each epoch's full-batch meta-step (D = D' = D'' = its
    training data): w' = w - alpha grad f(w); FO: w <- w - lr grad f(w'); HF: w <- w -
    lr (grad f(w') - alpha H(w) grad f(w'))."""
    names = list(start)
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
    return {k: v.numpy() for k, v in zip(names, w, strict=True)}


def _oracle(
    config: RunConfig, start: dict[str, np.ndarray], alpha: float, *, hessian: bool
) -> dict[str, np.ndarray]:
    """Every client's meta-steps (``_client_oracle``), then the average of the clients'
    w weighted by samples."""
    total = {k: np.zeros_like(v, dtype=np.float64) for k, v in start.items()}
    samples = 0
    for partition in range(config.num_clients):
        n = len(client_data(config, partition).y_train)
        w = _client_oracle(config, start, partition, alpha, hessian=hessian)
        for k, v in w.items():
            total[k] += n * v
        samples += n
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


@pytest.mark.parametrize(
    ("algorithm", "hessian", "key"),
    [("per-fedavg", False, "per_fedavg_alpha"), ("per-fedavg-hf", True, "per_fedavg_hf_alpha")],
)
def test_a_cohort_takes_each_members_own_meta_steps(
    algorithm: str, hessian: bool, key: str
) -> None:
    # Every client in one cohort (their training sets of different sizes: padded
    # batches), each member's reply against its own meta-steps
    run = RunConfig.from_mapping(run_config(**{**TINY, "algorithm": algorithm, key: ALPHA}))
    w = client_of(run, 0).initial_arrays()
    config = ConfigRecord({protocol.ROUND: 1, protocol.LR: run.lr, protocol.EPOCHS: run.epochs})
    members = [Member(p, RecordDict(), dict(w)) for p in range(run.num_clients)]
    fit = run.spec.update_function("fit", run.family)
    assert fit is not None
    replies = fit(Cohort(run, config, members))
    sizes = [len(client_data(run, p).y_train) for p in range(run.num_clients)]
    assert len(set(sizes)) > 1
    for partition, (arrays, metrics) in enumerate(replies):
        own = _client_oracle(run, w, partition, ALPHA, hessian=hessian)
        assert _largest_gap(arrays, own) < 1e-6
        assert metrics[protocol.NUM_EXAMPLES] == sizes[partition]
    # The test can fail: a member's result is not another's, nor the other variant's
    assert _largest_gap(replies[0][0], _client_oracle(run, w, 1, ALPHA, hessian=hessian)) > 1e-5
    other = _client_oracle(run, w, 0, ALPHA, hessian=not hessian)
    assert _largest_gap(replies[0][0], other) > 1e-5


def _adapted_test_loss(
    run: RunConfig, w: dict[str, np.ndarray], partition: int, alpha: float
) -> float:
    """The client's test loss after one full-batch step ``w - alpha grad f(w)``."""
    data = client_data(run, partition)
    names = list(w)
    x = torch.tensor(data.x_train, dtype=torch.float64)
    y = torch.tensor(data.y_train, dtype=torch.int64)
    params = tuple(torch.tensor(w[k], dtype=torch.float64) for k in names)
    grads = torch.autograd.functional.jacobian(_loss_of(names, x, y), params)
    adapted = tuple(p - alpha * g for p, g in zip(params, grads, strict=True))
    x_test = torch.tensor(data.x_test, dtype=torch.float64)
    y_test = torch.tensor(data.y_test, dtype=torch.int64)
    return float(_loss_of(names, x_test, y_test)(*adapted))


def test_a_client_is_tested_after_one_step_of_adaptation() -> None:
    values = run_config(**{**TINY, "algorithm": "per-fedavg", "per_fedavg_alpha": ALPHA})
    run = RunConfig.from_mapping(values)
    client = client_of(run, 1)
    w = client.initial_arrays()
    metrics = client.evaluate(dict(w), ConfigRecord({protocol.ROUND: 3}))
    # (batch-size covers the whole training set here: the step is a full-batch one)
    assert metrics[protocol.LOSS] == pytest.approx(_adapted_test_loss(run, w, 1, ALPHA), rel=1e-5)
    # not the model as sent
    assert abs(metrics[protocol.LOSS] - _adapted_test_loss(run, w, 1, 0.0)) > 1e-3


def test_a_cohort_tests_each_member_after_its_own_step_of_adaptation() -> None:
    values = run_config(**{**TINY, "algorithm": "per-fedavg", "per_fedavg_alpha": ALPHA})
    run = RunConfig.from_mapping(values)
    w = client_of(run, 0).initial_arrays()
    members = [Member(p, RecordDict(), dict(w)) for p in range(run.num_clients)]
    evaluate = run.spec.update_function("evaluate", run.family)
    assert evaluate is not None
    results = evaluate(Cohort(run, ConfigRecord({protocol.ROUND: 3}), members))
    for partition, metrics in enumerate(results):
        expected = _adapted_test_loss(run, w, partition, ALPHA)
        assert metrics[protocol.LOSS] == pytest.approx(expected, rel=1e-5)
        assert abs(metrics[protocol.LOSS] - _adapted_test_loss(run, w, partition, 0.0)) > 1e-3
        assert not members[partition].state  # nothing of the step is kept


@pytest.mark.parametrize("key", ["per-fedavg-alpha", "per-fedavg-hf-alpha"])
def test_alpha_must_not_be_negative(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{key}' = -0\.1 must be at least 0"):
        load_run_config({"algorithm": "per-fedavg", key: -0.1})
