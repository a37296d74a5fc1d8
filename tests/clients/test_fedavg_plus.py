"""FedAvg+ against its test-time adaptation (FedEM's ``--locally_tune_clients``): a
client's test metrics are those of the received global model after ``epochs`` of
full-batch gradient steps on all its parameters, written here in plain torch; nothing
of the adaptation is kept. A cohort of every client gives each member its own figures."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, RecordDict

from fedpers import protocol
from fedpers.cohort import Cohort, Member
from fedpers.config import RunConfig
from fedpers.data.client import adaptation_split, client_data
from tests.clients.test_fedprox import TINY, _forward
from tests.helpers import client_of, run_config


def _adapted_loss(
    start: dict[str, np.ndarray],
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    *,
    epochs: int,
    lr: float,
    parts: tuple[str, ...] = ("body", "head"),
) -> float:
    """Test loss after ``epochs`` gradient steps of ``parts`` on the training set."""
    w = {k: torch.tensor(v, dtype=torch.float64) for k, v in start.items()}
    x, y = torch.tensor(train[0], dtype=torch.float64), torch.tensor(train[1])
    for _ in range(epochs):
        p = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        grads = torch.autograd.grad(F.cross_entropy(_forward(p, x), y), list(p.values()))
        w = {
            k: v - lr * g if k.split(".")[0] in parts else v
            for (k, v), g in zip(w.items(), grads, strict=True)
        }
    xt, yt = torch.tensor(test[0], dtype=torch.float64), torch.tensor(test[1])
    return float(F.cross_entropy(_forward(w, xt), yt))


@pytest.mark.parametrize("unseen", [False, True])
def test_a_fedavg_plus_client_is_tested_after_adapting_all_of_the_global_model(
    unseen: bool,
) -> None:
    values = run_config(**{**TINY, "algorithm": "fedavg-plus"})
    run = RunConfig.from_mapping(values)
    state = RecordDict()
    client = client_of(run, 1, state)
    w = dict(client.initial_arrays())
    config = ConfigRecord({protocol.ROUND: 1, protocol.LR: run.lr})
    data = client_data(run, 1)
    train, test = (data.x_train, data.y_train), (data.x_test, data.y_test)
    if unseen:
        config[protocol.UNSEEN] = 1
        config[protocol.ADAPT_FRACTION] = 0.5
        x_a, y_a, x_t, y_t = adaptation_split(data, 0.5, run.seed, 1)
        train, test = (x_a, y_a), (x_t, y_t)
    metrics = client.evaluate(w, config)
    expected = _adapted_loss(w, train, test, epochs=run.epochs, lr=run.lr)
    assert metrics[protocol.LOSS] == pytest.approx(expected, rel=1e-5)
    # The test can fail: neither the global model unadapted nor its head alone adapted
    for wrong in (
        _adapted_loss(w, train, test, epochs=0, lr=run.lr),
        _adapted_loss(w, train, test, epochs=run.epochs, lr=run.lr, parts=("head",)),
    ):
        assert abs(wrong - metrics[protocol.LOSS]) > 1e-3
    # Nothing is kept: the next test adapts from what it receives, not from the last one
    assert protocol.STATE_PERSONAL not in state
    assert client_of(run, 1, state).evaluate(w, config)[protocol.LOSS] == metrics[protocol.LOSS]


@pytest.mark.parametrize("unseen", [False, True])
def test_a_cohort_adapts_each_members_copy_on_its_own_data(unseen: bool) -> None:
    run = RunConfig.from_mapping(run_config(**{**TINY, "algorithm": "fedavg-plus"}))
    w = dict(client_of(run, 0).initial_arrays())
    config = ConfigRecord({protocol.ROUND: 1, protocol.LR: run.lr})
    if unseen:
        config[protocol.UNSEEN] = 1
        config[protocol.ADAPT_FRACTION] = 0.5
    members = [Member(p, RecordDict(), dict(w)) for p in range(run.num_clients)]
    evaluate = run.spec.update_function("evaluate", run.family)
    assert evaluate is not None
    results = evaluate(Cohort(run, config, members))
    expected = []
    for partition in range(run.num_clients):
        data = client_data(run, partition)
        train, test = (data.x_train, data.y_train), (data.x_test, data.y_test)
        if unseen:
            x_a, y_a, x_t, y_t = adaptation_split(data, 0.5, run.seed, partition)
            train, test = (x_a, y_a), (x_t, y_t)
        expected.append(_adapted_loss(w, train, test, epochs=run.epochs, lr=run.lr))
    for member, metrics, loss in zip(members, results, expected, strict=True):
        assert metrics[protocol.LOSS] == pytest.approx(loss, rel=1e-5)
        assert protocol.STATE_PERSONAL not in member.state
    # The test can fail: the members' figures differ
    assert abs(expected[0] - expected[1]) > 1e-3
