"""Ditto's client: the global update is exactly FedAvg's; the personal model is pulled
toward the global model the client received, more strongly for a larger lambda."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, RecordDict
from numpy.testing import assert_array_equal

from fedpers import protocol
from fedpers.config import RunConfig
from fedpers.models import build_model, load_part_arrays
from fedpers.seeding import int_seed
from fedpers.training import evaluate_model as evaluate
from tests.helpers import client_of, run_config

TRAIN = {protocol.ROUND: 1, protocol.EPOCHS: 2, protocol.HEAD_EPOCHS: 2, protocol.LR: 0.05}


def _client(algorithm: str, state: RecordDict, **overrides: Any) -> Any:
    run = RunConfig.from_mapping(
        run_config(algorithm=algorithm, dataset="digits", num_clients=10, **overrides)
    )
    return client_of(run, 2, state)


def _distance(model: dict[str, np.ndarray], arrays: dict[str, np.ndarray]) -> float:
    return float(sum(((model[n] - arrays[n]) ** 2).sum() for n in arrays))


def _kept(state: RecordDict) -> dict[str, np.ndarray]:
    """The personal model ``v`` a node stored."""
    return {k: v.numpy() for k, v in state[protocol.STATE_PERSONAL].items()}


def _model(run: RunConfig, arrays: dict[str, np.ndarray]) -> torch.nn.Module:
    """The run's model with ``arrays``."""
    model = build_model(
        run.model_name, run.num_classes, int_seed(run.seed, "model"), run.input_shape
    )
    load_part_arrays(model, arrays)
    return model


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
        assert ditto.run.spec.update == "fedpers.algorithms.ditto"
        reply, metrics = ditto.fit(dict(w), ConfigRecord(TRAIN))
        # Assert: what goes back to the server is FedAvg's update, to the bit
        assert reply.keys() == expected.keys()
        for name in expected:
            assert_array_equal(reply[name], expected[name])
        assert metrics[protocol.NUM_EXAMPLES] == len(ditto.data.y_train)
        assert protocol.STATE_PERSONAL in state
        personal[lam] = _distance(_kept(state), w)
    # lambda = 0 trains v freely; lambda = 10 keeps it much nearer the w it started from
    assert personal[10.0] < 0.2 * personal[0.0]


def test_v_persists_in_the_state_and_is_what_is_evaluated() -> None:
    state = RecordDict()
    first = _client("ditto", state)
    w = first.initial_arrays()
    first.fit(dict(w), ConfigRecord(TRAIN))
    v = _kept(state)
    assert _distance(v, w) > 0  # v trained
    # A fresh process of the same node restores v from context.state
    again = _client("ditto", state)
    metrics = again.evaluate(dict(w), ConfigRecord({protocol.ROUND: 1}))
    x_test, y_test = torch.from_numpy(again.data.x_test), torch.from_numpy(again.data.y_test)
    stats = evaluate(_model(again.run, v), x_test, y_test)
    assert metrics[protocol.ACCURACY] == stats.accuracy
    assert metrics[protocol.LOSS] == stats.loss
    # ... and not the global model's accuracy, which the untrained w would give
    global_stats = evaluate(_model(again.run, w), x_test, y_test)
    assert metrics[protocol.ACCURACY] != global_stats.accuracy
