"""Ditto's client: the global update is exactly FedAvg's; the personal model is pulled
toward the global model the client received, more strongly for a larger lambda."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, RecordDict
from numpy.testing import assert_array_equal

from fedpers import protocol
from fedpers.clients.ditto import DittoClient
from fedpers.config import RunConfig
from fedpers.training import evaluate_model as evaluate
from tests.helpers import client_of, run_config

TRAIN = {protocol.ROUND: 1, protocol.EPOCHS: 2, protocol.HEAD_EPOCHS: 2, protocol.LR: 0.05}


def _client(algorithm: str, state: RecordDict, **overrides: Any) -> Any:
    run = RunConfig.from_mapping(
        run_config(algorithm=algorithm, dataset="digits", num_clients=10, **overrides)
    )
    return client_of(run, 2, state)


def _distance(model: torch.nn.Module, arrays: dict[str, np.ndarray]) -> float:
    return float(
        sum(((p.detach().numpy() - arrays[n]) ** 2).sum() for n, p in model.named_parameters())
    )


def test_the_global_update_is_fedavgs_and_lambda_pulls_v_toward_w() -> None:
    # Prepare: the seeded initial model as the global model w^t
    fedavg = _client("fedavg", RecordDict())
    w = fedavg.initial_arrays()
    # Execute: FedAvg's local update, and Ditto's with a weak and a strong pull
    expected, _ = fedavg.fit(dict(w), ConfigRecord(TRAIN))
    personal = {}
    for lam in (0.0, 10.0):
        state = RecordDict()
        ditto = _client("ditto", state, ditto_lambda=lam)
        assert isinstance(ditto, DittoClient)
        reply, metrics = ditto.fit(dict(w), ConfigRecord(TRAIN))
        # Assert: what goes back to the server is FedAvg's update, to the bit
        assert reply.keys() == expected.keys()
        for name in expected:
            assert_array_equal(reply[name], expected[name])
        assert metrics[protocol.NUM_EXAMPLES] == len(ditto.data.y_train)
        assert protocol.STATE_PERSONAL in state
        personal[lam] = _distance(ditto.personal_model, w)
    # lambda = 0 trains v freely; lambda = 10 keeps it much nearer the w it started from
    assert personal[10.0] < 0.2 * personal[0.0]


def test_v_persists_in_the_state_and_is_what_is_evaluated() -> None:
    state = RecordDict()
    first = _client("ditto", state)
    w = first.initial_arrays()
    first.fit(dict(w), ConfigRecord(TRAIN))
    # A fresh process of the same node restores v from context.state
    again = _client("ditto", state)
    for (name, p), q in zip(
        first.personal_model.named_parameters(), again.personal_model.parameters(), strict=True
    ):
        assert torch.equal(p, q), name
    metrics = again.evaluate(dict(w), ConfigRecord({protocol.ROUND: 1}))
    stats = evaluate(
        again.personal_model,
        torch.from_numpy(again.data.x_test),
        torch.from_numpy(again.data.y_test),
    )
    assert metrics[protocol.ACCURACY] == stats.accuracy
    # ... and not the global model's accuracy, which the untrained w would give
    untrained = _client("ditto", RecordDict())
    global_stats = evaluate(
        untrained.model,
        torch.from_numpy(untrained.data.x_test),
        torch.from_numpy(untrained.data.y_test),
    )
    assert metrics[protocol.ACCURACY] != global_stats.accuracy
