"""Flower's strategy contract: the round loop calls ``configure_train``,
``aggregate_train``, ``configure_evaluate`` and ``aggregate_evaluate`` as Flower's
``Strategy.start`` does, so a subclass that overrides them as Flower's documentation
says (``super()``, then change the result) changes the run. Each test overrides one
method and sees its effect through the real ClientApp, in process."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import FrozenInstanceError
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from numpy.testing import assert_allclose, assert_array_equal

from fedpers import protocol
from fedpers.clients.client_app import app as client_app
from fedpers.config import RunConfig
from fedpers.results import RoundRecord
from fedpers.strategies.base import FedpersStrategy
from fedpers.strategies.rounds import evaluate_step, record_bytes, train_step
from tests.helpers import InProcessGrid, run_config

NODES = 4  # every node trains every round (fraction-train 1) and every node evaluates


def _run(
    cls: type[FedpersStrategy], rounds: int = 2, **overrides: Any
) -> tuple[InProcessGrid, Any, ArrayRecord, Result, list[RoundRecord]]:
    values = run_config(
        algorithm="fedavg", dataset="digits", num_clients=NODES, fraction_train=1.0, **overrides
    )
    grid = InProcessGrid(client_app, values, NODES)
    strategy = cls(RunConfig.from_mapping(values))
    strategy.federation.connect(grid, timeout=5)
    initial = strategy.initial_arrays(grid, timeout=5)
    records: list[RoundRecord] = []
    result = strategy.start(grid, initial, num_rounds=rounds, on_round=records.append)
    return grid, strategy, initial, result, records


def _sent(grid: InProcessGrid, kind: str) -> list[Message]:
    return [m for m in grid.sent if m.metadata.message_type == kind]


def _numpy(arrays: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in arrays.items()}


class TwoNodesStandStill(FedpersStrategy):
    """``configure_train``: the first two of the messages, with learning rate 0."""

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))[:2]
        for message in messages:
            message.content[protocol.CONFIG][protocol.LR] = 0.0
        return messages


def test_configure_train_chooses_the_nodes_and_the_config_the_clients_read() -> None:
    grid, _, initial, result, records = _run(TwoNodesStandStill)
    trains = _sent(grid, MessageType.TRAIN)
    # Only the two messages it kept were sent, in both rounds
    assert [m.metadata.dst_node_id for m in trains] == [grid.node_of(p) for p in (0, 1)] * 2
    assert [(r.sampled, r.replies) for r in records] == [(2, 2), (2, 2)]
    # The clients read lr = 0: no weight moved, so the average is the initial model
    final = _numpy(result.arrays)
    for name, values in _numpy(initial).items():
        assert_allclose(final[name], values, rtol=0, atol=1e-6)


class Halved(FedpersStrategy):
    """``aggregate_train``: ``super()``'s average times one half, and a metric more."""

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.returned: dict[int, ArrayRecord] = {}

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        assert arrays is not None
        assert metrics is not None
        halved = ArrayRecord({k: Array(0.5 * v.numpy()) for k, v in arrays.items()})
        self.returned[server_round] = halved
        metrics["aggregated-in"] = float(server_round)
        return halved, metrics


def test_aggregate_train_gives_the_arrays_the_next_round_receives() -> None:
    grid, strategy, initial, result, records = _run(Halved)
    assert [r.train.get("aggregated-in") for r in records] == [1.0, 2.0]
    assert result.train_metrics_clientapp[2]["aggregated-in"] == 2.0
    # Round 2 sends exactly what round 1's aggregate_train returned; the run ends on
    # what round 2's returned
    second_round = _sent(grid, MessageType.TRAIN)[NODES:]
    assert len(second_round) == NODES
    for message in second_round:
        received = _numpy(message.content[protocol.ARRAYS])
        for name, values in _numpy(strategy.returned[1]).items():
            assert_array_equal(received[name], values)
    for name, values in _numpy(strategy.returned[2]).items():
        assert_array_equal(_numpy(result.arrays)[name], values)
    assert not np.allclose(_numpy(result.arrays)["head.weight"], _numpy(initial)["head.weight"])


class EvaluateOneAndTwo(FedpersStrategy):
    """``configure_evaluate``: only the messages to partitions 1 and 2."""

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = super().configure_evaluate(server_round, arrays, config, grid)
        chosen = {self.federation.node_of_partition[p] for p in (1, 2)}
        return [m for m in messages if m.metadata.dst_node_id in chosen]


def test_configure_evaluate_chooses_the_nodes_evaluated() -> None:
    grid, _, _, result, records = _run(EvaluateOneAndTwo)
    evaluations = _sent(grid, MessageType.EVALUATE)
    assert [m.metadata.dst_node_id for m in evaluations] == [grid.node_of(p) for p in (1, 2)] * 2
    assert [r.evaluated for r in records] == [2, 2]
    assert [set(r.clients) for r in records] == [{"1", "2"}, {"1", "2"}]
    # The round's figure is the test-weighted mean of those two clients alone
    last = records[-1].clients
    weights = np.array([last[p][protocol.NUM_EXAMPLES] for p in ("1", "2")])
    accuracies = np.array([last[p][protocol.ACCURACY] for p in ("1", "2")])
    expected = float(weights @ accuracies / weights.sum())
    assert records[-1].evaluate[protocol.ACCURACY] == expected
    assert result.evaluate_metrics_clientapp[2][protocol.ACCURACY] == expected


class Quarters(FedpersStrategy):
    """``aggregate_evaluate``: a figure of its own instead of the weighted mean."""

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        replies = list(replies)
        assert super().aggregate_evaluate(server_round, replies) is not None
        return MetricRecord({protocol.ACCURACY: 0.25 * server_round, "replies": len(replies)})


def test_aggregate_evaluate_gives_the_recorded_evaluation() -> None:
    _, _, _, result, records = _run(Quarters)
    assert [r.evaluate for r in records] == [
        {protocol.ACCURACY: 0.25, "replies": float(NODES)},
        {protocol.ACCURACY: 0.5, "replies": float(NODES)},
    ]
    assert result.evaluate_metrics_clientapp[1][protocol.ACCURACY] == 0.25


class Logged(FedpersStrategy):
    """Every one of Flower's four methods, logged, then ``super()``'s."""

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.calls: list[tuple[str, int]] = []
        self.aggregated: dict[int, list[int]] = {}  # partitions aggregate_train got

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.calls.append(("configure_train", server_round))
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self.calls.append(("aggregate_train", server_round))
        replies = list(replies)
        self.aggregated[server_round] = [self.federation.partition(r) for r in replies]
        return super().aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.calls.append(("configure_evaluate", server_round))
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        self.calls.append(("aggregate_evaluate", server_round))
        return super().aggregate_evaluate(server_round, replies)


def test_the_four_methods_are_called_in_flowers_order_on_screened_replies() -> None:
    # Partition 2 answers NaN in round 1: screening leaves it out before aggregate_train
    _, strategy, _, _, records = _run(Logged, fault_injection="nan:2@1")
    steps = ["configure_train", "aggregate_train", "configure_evaluate", "aggregate_evaluate"]
    assert strategy.calls == [(step, r) for r in (1, 2) for step in steps]
    assert strategy.aggregated == {1: [0, 1, 3], 2: [0, 1, 2, 3]}
    assert records[0].rejections == [
        "partition 2: non-finite values in array 'arrays/body.0.weight'"
    ]
    assert [r.replies for r in records] == [3, 4]


def test_a_rounds_results_are_the_values_its_steps_return() -> None:
    # Partition 2 answers NaN, partition 3 claims 1e12 samples (capped, kept)
    values = run_config(
        algorithm="fedavg",
        dataset="digits",
        num_clients=NODES,
        fraction_train=1.0,
        fault_injection="nan:2@1,inflate:3@1",
    )
    grid = InProcessGrid(client_app, values, NODES)
    strategy = FedpersStrategy(RunConfig.from_mapping(values))
    federation = strategy.federation
    federation.connect(grid, timeout=5)
    initial = strategy.initial_arrays(grid, timeout=5)
    train = train_step(strategy, grid, federation, 1, initial, strategy.train_config(), 5)
    assert (train.sampled, train.accepted) == (NODES, 3)
    assert train.rejections == (
        "partition 2: non-finite values in array 'arrays/body.0.weight'",
        f"partition 3: num-examples 1000000000000.0 capped at {federation.train_sizes[3]}",
    )
    assert train.bytes_sent == sum(record_bytes(m.content) for m in _sent(grid, "train"))
    assert train.arrays is not initial
    evaluate = evaluate_step(strategy, grid, federation, 1, train.arrays, ConfigRecord(), 5)
    assert evaluate.evaluated == NODES
    assert set(evaluate.clients) == {str(p) for p in range(NODES)}
    # Both ways: the messages sent, and the replies back
    assert evaluate.bytes > sum(record_bytes(m.content) for m in _sent(grid, "evaluate"))
    with pytest.raises(FrozenInstanceError):
        train.accepted = 0  # type: ignore[misc]
    # The strategy keeps no round results of its own
    assert not {"accepted", "rejections"} & set(vars(strategy))
