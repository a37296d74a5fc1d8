"""A Flower strategy as the server step (``server-strategy``, issue 44): rounds of the
tiny problem through the in-process grid with FedAdam and Krum combining FedAvg's
shared model, against their equations computed here in numpy from the replies the
strategy was given (Reddi et al.'s FedAdam with Flower's bias correction; Krum's score
of Blanchard et al.); only replies that passed fedpers' screening reach the strategy;
and every setting that cannot work is refused before a run starts."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from flwr.app import Message

from fedpers import protocol, records
from fedpers.config import load_run_config
from fedpers.settings import ConfigError
from fedpers.strategies.flower_step import FlowerStep
from tests.clients.test_fedprox import _largest_gap, tiny_rounds

Arrays = dict[str, np.ndarray]


def _recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, list[Message], Arrays, Arrays]]:
    """Every ``FlowerStep.aggregate`` call: its round, replies, reference and result."""
    calls: list[tuple[int, list[Message], Arrays, Arrays]] = []
    original = FlowerStep.aggregate

    def record(self: FlowerStep, server_round: int, replies: list[Message], ref: Arrays) -> Arrays:
        result = original(self, server_round, replies, ref)
        calls.append((server_round, list(replies), dict(ref), result))
        return result

    monkeypatch.setattr(FlowerStep, "aggregate", record)
    return calls


def _arrays(reply: Message) -> Arrays:
    record = reply.content.array_records[protocol.ARRAYS]
    return {k: records.values(v).astype(np.float64) for k, v in record.items()}


def _examples(reply: Message) -> float:
    return float(reply.content.metric_records[protocol.METRICS][protocol.NUM_EXAMPLES])


def _fedadam(
    calls: list[Any], eta: float, beta_1: float = 0.9, beta_2: float = 0.99
) -> list[Arrays]:
    """Each round's new model: x + eta_t m / (sqrt(v) + tau), m and v the moments of
    Delta = (the mean of the replies weighted by their samples) - x, with Flower's
    eta_t = eta sqrt(1 - beta_2^(t+1)) / (1 - beta_1^(t+1)) and tau = 1e-3."""
    m: Arrays = {}
    v: Arrays = {}
    out = []
    for server_round, replies, reference, _ in calls:
        weights = np.array([_examples(r) for r in replies])
        models = [_arrays(r) for r in replies]
        new = {}
        for name, x in reference.items():
            mean = sum(w * a[name] for w, a in zip(weights, models, strict=True)) / weights.sum()
            delta = mean - x.astype(np.float64)
            m[name] = beta_1 * m.get(name, 0.0) + (1 - beta_1) * delta
            v[name] = beta_2 * v.get(name, 0.0) + (1 - beta_2) * delta**2
            t = server_round + 1.0
            eta_t = eta * np.sqrt(1 - beta_2**t) / (1 - beta_1**t)
            new[name] = x + eta_t * m[name] / (np.sqrt(v[name]) + 1e-3)
        out.append(new)
    return out


def test_fedadam_is_the_server_step_of_fedavg(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _recorded(monkeypatch)
    _, start, result, _, _ = tiny_rounds(
        3, algorithm="fedavg", server_strategy="fedadam", server_strategy_args="eta=0.05"
    )
    assert [c[0] for c in calls] == [1, 2, 3]
    assert all(len(c[1]) == 4 for c in calls)
    assert _largest_gap(calls[0][2], start) == 0  # round 1 started from the initial model
    expected = _fedadam(calls, eta=0.05)
    for (_, _, _, got), want in zip(calls, expected, strict=True):
        assert _largest_gap(got, want) < 1e-6
    for before, after in itertools.pairwise(calls):  # each result was adopted
        assert _largest_gap(after[2], before[3]) == 0
    assert _largest_gap(result, calls[-1][3]) == 0
    # The test can fail: another eta, or plain FedAvg's mean, is far from it.
    assert _largest_gap(calls[-1][3], _fedadam(calls, eta=0.055)[-1]) > 1e-5
    mean = {
        k: sum(_examples(r) * _arrays(r)[k] for r in calls[0][1])
        / sum(_examples(r) for r in calls[0][1])
        for k in start
    }
    assert _largest_gap(calls[0][3], mean) > 1e-3


def _krum(replies: list[Message], malicious: int) -> Arrays:
    """The reply with the least sum of squared distances to its n - f - 2 nearest."""
    flat = [np.concatenate([a.ravel() for a in _arrays(r).values()]) for r in replies]
    n = len(flat)
    scores = []
    for i, x in enumerate(flat):
        distances = sorted(float(np.sum((x - y) ** 2)) for j, y in enumerate(flat) if j != i)
        scores.append(sum(distances[: n - malicious - 2]))
    return _arrays(replies[int(np.argmin(scores))])


def test_krum_keeps_the_reply_nearest_the_others_and_sees_only_screened_replies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _recorded(monkeypatch)
    *_, grid = tiny_rounds(
        2,
        algorithm="fedavg",
        num_clients=6,
        server_strategy="krum",
        server_strategy_args="num_malicious_nodes=1",
        fault_injection="sign-flip=20:0,nan:1@2",
    )
    assert [len(c[1]) for c in calls] == [6, 5]  # the NaN reply never reached Krum
    flipped = grid.node_of(0)  # its update 20 times against itself: never the choice
    for _, replies, _, got in calls:
        assert _largest_gap(got, _krum(replies, malicious=1)) == 0
        (attacker,) = [r for r in replies if r.metadata.src_node_id == flipped]
        assert _largest_gap(got, _arrays(attacker)) > 1e-3
    # The test can fail: the plain mean of the replies is far from Krum's choice.
    _, replies, _, got = calls[0]
    mean = {k: np.mean([_arrays(r)[k] for r in replies], axis=0) for k in got}
    assert _largest_gap(got, mean) > 1e-3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"server_strategy": "adam"}, "'server-strategy' = 'adam' is not a strategy"),
        ({"server_strategy": "nosuch.module:X"}, "cannot be loaded"),
        ({"server_strategy": "fedpers.config:RunConfig"}, "is not a Flower Strategy"),
        ({"server_strategy": "fedadam", "server_strategy_args": "eta"}, "not 'name=value'"),
        ({"server_strategy": "fedadam", "server_strategy_args": "eta=fast"}, "not a number"),
        ({"server_strategy": "fedadam", "server_strategy_args": "gamma=1"}, "its keywords: "),
        ({"server_strategy": "krum", "server_strategy_args": "min_train_nodes=3"}, "samples"),
        ({"server_strategy_args": "eta=0.1"}, "without 'server-strategy'"),
        ({"server_strategy": "fedadam", "algorithm": "scaffold"}, "has its own server step"),
        ({"server_strategy": "fedadam", "aggregation": "median"}, "aggregation = 'mean'"),
        ({"server_strategy": "fedadam", "dp": "central"}, "set dp = 'none'"),
        ({"server_strategy": "fedadam", "resume": True}, "start the run afresh"),
    ],
)
def test_what_cannot_work_is_refused_before_the_run(
    overrides: dict[str, Any], message: str
) -> None:
    values = {"algorithm": "fedavg", "dataset": "digits", **overrides}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_run_config({k.replace("_", "-"): v for k, v in values.items()})
