"""Tests after the last round that the per-round evaluation cannot give.

- ``finetuned``: every client fine-tunes its head for ``finetune-epochs`` on its own
  training data, starting from the final model, then tests (FedAvg+FT in FedRep's
  Table 1, and FedBABU, whose head is trained only here).
- ``unseen``: the clients that never trained adapt on part of their data (FedGMM and
  FedEM: the mixture weights only; FedAvg: nothing), then test on the rest (FedGMM's
  Table 4).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedpers import protocol, records
from fedpers.families import personalized as personalized_family
from fedpers.protocol import UnseenTest
from fedpers.strategies import screening
from fedpers.strategies.federation import Federation
from fedpers.strategies.rounds import per_client, screened_replies


class Evaluator(Protocol):
    """What a final test needs of the strategy: its federation, what an EVALUATE
    message carries, and how replies are aggregated."""

    federation: Federation

    def evaluate_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> dict[int, RecordDict]: ...

    def screen_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> screening.Screened: ...

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None: ...


def finetuned(
    strategy: Evaluator,
    grid: Grid,
    arrays: ArrayRecord,
    config: ConfigRecord,
    server_round: int,
    timeout: float,
    *,
    epochs: int,
) -> personalized_family.FinetunedTest | None:
    """Every seen client fine-tunes its head for ``epochs`` on the final model, then
    tests."""
    config = ConfigRecord(dict(config))
    config[protocol.FINETUNE_EPOCHS] = epochs
    contents = strategy.evaluate_contents(server_round, arrays, config)
    accuracy, clients = _accuracy(strategy, grid, contents, server_round, timeout)
    return None if accuracy is None else personalized_family.FinetunedTest(accuracy, clients)


def unseen(
    strategy: Evaluator,
    grid: Grid,
    arrays: ArrayRecord,
    config: ConfigRecord,
    server_round: int,
    timeout: float,
    *,
    partitions: list[int],
    adapt_fraction: float,
) -> UnseenTest | None:
    """The unseen clients (``partitions``) adapt on ``adapt_fraction`` of their data,
    then test on the rest."""
    config = ConfigRecord(dict(config))
    config[protocol.ROUND] = server_round
    config[protocol.UNSEEN] = 1
    config[protocol.ADAPT_FRACTION] = adapt_fraction
    content = RecordDict({protocol.ARRAYS: arrays, protocol.CONFIG: config})
    contents = dict.fromkeys(partitions, content)
    accuracy, clients = _accuracy(strategy, grid, contents, server_round, timeout)
    return None if accuracy is None else UnseenTest(accuracy, clients)


def _accuracy(
    strategy: Evaluator,
    grid: Grid,
    contents: dict[int, RecordDict],
    server_round: int,
    timeout: float,
) -> tuple[float | None, dict[str, float]]:
    """The test-weighted accuracy of the clients that received ``contents``, and each
    one's own accuracy by partition."""
    exchange = strategy.federation.exchange(grid, MessageType.EVALUATE, contents, timeout=timeout)
    kept, _ = screened_replies(strategy, server_round, exchange.replies)
    metrics = strategy.aggregate_evaluate(server_round, kept.values())
    clients = {
        partition: values[protocol.ACCURACY]
        for partition, values in per_client(kept).items()
        if protocol.ACCURACY in values
    }
    if metrics is None or protocol.ACCURACY not in metrics:
        return None, clients
    return records.number(metrics[protocol.ACCURACY], protocol.ACCURACY), clients
