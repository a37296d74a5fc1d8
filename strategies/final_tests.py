"""Tests after the last round that the per-round evaluation cannot give.

- ``finetuned``: every client fine-tunes its head for ``finetune-epochs`` on its own
  training data, starting from the final model, then tests (FedAvg+FT in FedRep's
  Table 1, and FedBABU, whose head is trained only here).
- ``unseen``: the clients that never trained adapt on part of their data (FedGMM and
  FedEM: the mixture weights only; FedAvg: nothing), then test on the rest (FedGMM's
  Table 4).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedpers.strategies.rounds import per_client
from flwr.app import ArrayRecord, ConfigRecord, MessageType, RecordDict
from flwr.serverapp import Grid

from fedpers import protocol
from fedpers.protocol import FinetunedTest, UnseenTest

if TYPE_CHECKING:
    from fedpers.strategies.base import FedpersStrategy


def finetuned(
    strategy: FedpersStrategy,
    grid: Grid,
    arrays: ArrayRecord,
    config: ConfigRecord,
    server_round: int,
    timeout: float,
) -> FinetunedTest | None:
    """Every seen client fine-tunes its head on the final model, then tests."""
    config = ConfigRecord(dict(config))
    config[protocol.FINETUNE_EPOCHS] = strategy.run.finetune_epochs
    contents = strategy.evaluate_contents(server_round, arrays, config)
    accuracy, clients = _accuracy(strategy, grid, contents, server_round, timeout)
    return None if accuracy is None else FinetunedTest(accuracy, clients)


def unseen(
    strategy: FedpersStrategy,
    grid: Grid,
    arrays: ArrayRecord,
    config: ConfigRecord,
    server_round: int,
    timeout: float,
) -> UnseenTest | None:
    """The unseen clients adapt on ``adapt-fraction`` of their data, test on the rest."""
    config = ConfigRecord(dict(config))
    config[protocol.ROUND] = server_round
    config[protocol.UNSEEN] = 1
    config[protocol.ADAPT_FRACTION] = strategy.run.adapt_fraction
    content = RecordDict({protocol.ARRAYS: arrays, protocol.CONFIG: config})
    contents = dict.fromkeys(strategy.unseen, content)
    accuracy, clients = _accuracy(strategy, grid, contents, server_round, timeout)
    return None if accuracy is None else UnseenTest(accuracy, clients)


def _accuracy(
    strategy: FedpersStrategy,
    grid: Grid,
    contents: dict[int, RecordDict],
    server_round: int,
    timeout: float,
) -> tuple[float | None, dict[str, float]]:
    """The test-weighted accuracy of the clients that received ``contents``, and each
    one's own accuracy by partition."""
    exchange = strategy.federation.exchange(grid, MessageType.EVALUATE, contents, timeout=timeout)
    metrics = strategy.aggregate_evaluate(server_round, exchange.replies.values())
    clients = {
        partition: values[protocol.ACCURACY]
        for partition, values in per_client(exchange.replies).items()
        if protocol.ACCURACY in values
    }
    if metrics is None:
        return None, clients
    return float(metrics[protocol.ACCURACY]), clients  # type: ignore[arg-type]
