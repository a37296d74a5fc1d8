"""The round loop: train, aggregate, evaluate, record, checkpoint.

Flower's ``Strategy.start`` with what fedpers needs on top: a resumed run starts after
its checkpoint (``first_round``), every round is reported as a ``RoundRecord`` (the
results writer is a callback, outside any aggregation code), nodes that restarted
under a new id are re-mapped before each round, evaluation may skip rounds
(``evaluate-every``), and a round with fewer usable replies than ``min-replies`` stops
the run after it is recorded. The algorithm's part is in the strategy's hooks
(``strategies.base.FedpersStrategy``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedpers import protocol
from fedpers.results import RoundRecord

if TYPE_CHECKING:
    from fedpers.strategies.base import FedpersStrategy

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


class RoundFailedError(RuntimeError):
    """A round got fewer usable replies than ``min-replies``."""


def run_rounds(
    strategy: FedpersStrategy,
    grid: Grid,
    initial_arrays: ArrayRecord,
    *,
    num_rounds: int,
    timeout: float,
    train_config: ConfigRecord | None = None,
    evaluate_config: ConfigRecord | None = None,
    evaluate_fn: EvaluateFn | None = None,
    first_round: int = 1,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_checkpoint: Callable[[int, ArrayRecord], None] | None = None,
) -> Result:
    """Rounds ``first_round..num_rounds`` of ``strategy``; see the module docstring.
    ``train_config`` and ``evaluate_config`` default to the strategy's own.

    Raises
    ------
    RoundFailedError
        When a round has fewer usable training replies than ``min-replies``.
    """
    strategy.summary()
    federation = strategy.federation
    train_config = strategy.train_config() if train_config is None else train_config
    evaluate_config = strategy.evaluate_config() if evaluate_config is None else evaluate_config
    result = Result()
    arrays = initial_arrays
    result.arrays = arrays
    if evaluate_fn is not None and (metrics := evaluate_fn(first_round - 1, arrays)) is not None:
        result.evaluate_metrics_serverapp[first_round - 1] = metrics
    for server_round in range(first_round, num_rounds + 1):
        started = time.monotonic()
        federation.refresh(grid, timeout=timeout)
        contents = strategy.train_contents(
            server_round, arrays, ConfigRecord(dict(train_config)), grid
        )
        exchange = federation.exchange(grid, MessageType.TRAIN, contents, timeout=timeout)
        traffic = Traffic()
        traffic.add(contents, exchange.replies)
        for partition in sorted(set(exchange.failures) - set(exchange.replies)):
            strategy.reject(server_round, partition, exchange.failures[partition])
        replies = list(exchange.replies.values())
        strategy.accepted[server_round] = sum(not r.has_error() for r in replies)
        new_arrays, train_metrics = _aggregated(strategy, server_round, replies)
        if new_arrays is not None:
            reason = strategy.state_defect(new_arrays, arrays)
            if reason is None:
                arrays = new_arrays
                result.arrays = arrays
            else:
                strategy.reject_state(server_round, reason)
        if train_metrics is not None:
            result.train_metrics_clientapp[server_round] = train_metrics
        trained = time.monotonic()
        evaluate_metrics, evaluated = None, 0
        evaluated_clients: dict[str, dict[str, float]] = {}
        if strategy.evaluates(server_round, num_rounds):
            to_evaluate = strategy.evaluate_contents(
                server_round, arrays, ConfigRecord(dict(evaluate_config))
            )
            if to_evaluate:
                evaluation = federation.exchange(
                    grid, MessageType.EVALUATE, to_evaluate, timeout=timeout
                )
                evaluate_replies = list(evaluation.replies.values())
                evaluated = sum(not r.has_error() for r in evaluate_replies)
                evaluate_metrics = strategy.aggregate_evaluate(server_round, evaluate_replies)
                evaluated_clients = per_client(evaluation.replies)
                traffic.add(to_evaluate, evaluation.replies, evaluate=True)
        if evaluate_metrics is not None:
            result.evaluate_metrics_clientapp[server_round] = evaluate_metrics
        server_metrics = evaluate_fn(server_round, arrays) if evaluate_fn else None
        if server_metrics is not None:
            result.evaluate_metrics_serverapp[server_round] = server_metrics
        accepted = strategy.accepted.get(server_round, 0)
        checked = {STATE_WELL_FORMED: float(well_formed(arrays, initial_arrays))}
        record = RoundRecord(
            round=server_round,
            seconds=time.monotonic() - started,
            train=_plain(train_metrics),
            evaluate=_plain(evaluate_metrics),
            server={
                **_plain(server_metrics),
                **strategy.round_metrics(server_round),
                **checked,
                **traffic.metrics(),
            },
            sampled=len(contents),
            replies=accepted,
            failures=len(contents) - accepted,
            evaluated=evaluated,
            rejections=list(strategy.rejections.get(server_round, [])),
            train_seconds=trained - started,
            evaluate_seconds=time.monotonic() - trained,
            clients=evaluated_clients,
        )
        if on_round is not None:
            on_round(record)
        if contents and accepted < strategy.run.min_replies:
            raise RoundFailedError(
                f"round {server_round}: {accepted} usable replies of {len(contents)}, "
                f"fewer than min-replies = {strategy.run.min_replies}; "
                + "; ".join(record.rejections[:5])
            )
        if on_checkpoint is not None:
            on_checkpoint(server_round, arrays)
    return result


STATE_WELL_FORMED = "state-well-formed"  # 1: the round's global state is sound


def well_formed(state: ArrayRecord, initial: ArrayRecord) -> bool:
    """Whether ``state`` has the arrays of ``initial`` (names, shapes, dtypes) and only
    finite values: an independent check of every adopted global state, recorded each
    round (``server.state-well-formed`` in rounds.jsonl)."""
    if [(n, tuple(a.shape), a.dtype) for n, a in state.items()] != [
        (n, tuple(a.shape), a.dtype) for n, a in initial.items()
    ]:
        return False
    return all(bool(np.all(np.isfinite(a.numpy()))) for a in state.values())


# The round's communication, counted from its messages: training messages (the
# algorithm's cost), server -> nodes and the replies back; evaluation messages (the
# cost of measuring, both ways) apart.
BYTES_SENT = "bytes-sent"
BYTES_RECEIVED = "bytes-received"
EVALUATE_BYTES = "evaluate-bytes"


def record_bytes(content: RecordDict) -> int:
    """Bytes of a message's content as Flower counts them (every array, config and
    metric record: values and keys), without the message's envelope. Never raises: a
    malformed reply (which screening rejects) is counted by a rougher rule where
    Flower's count fails on it."""
    total = 0
    for records in (content.array_records, content.config_records, content.metric_records):
        for record in records.values():
            try:
                total += int(record.count_bytes())
            except Exception:  # an empty list, a value of a type Flower does not count
                total += sum(len(str(k)) + len(repr(v)) for k, v in record.items())
    return total


class Traffic:
    """Bytes of one round's training and evaluation exchanges, counted from the
    messages (contents sent, and the replies that came back: error replies carry no
    content)."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.evaluate = 0

    def add(
        self,
        contents: Mapping[int, RecordDict],
        replies: Mapping[int, Message],
        *,
        evaluate: bool = False,
    ) -> None:
        sent = sum(record_bytes(content) for content in contents.values())
        received = sum(
            record_bytes(reply.content) for reply in replies.values() if not reply.has_error()
        )
        if evaluate:
            self.evaluate += sent + received
        else:
            self.sent += sent
            self.received += received

    def metrics(self) -> dict[str, float]:
        return {
            BYTES_SENT: float(self.sent),
            BYTES_RECEIVED: float(self.received),
            EVALUATE_BYTES: float(self.evaluate),
        }


def per_client(replies: Mapping[int, Message]) -> dict[str, dict[str, float]]:
    """Each evaluated partition's own metrics (``{"17": {"accuracy": ...}}``)."""
    clients: dict[str, dict[str, float]] = {}
    for partition, reply in sorted(replies.items()):
        if reply.has_error():
            continue
        metrics = reply.content.metric_records.get(protocol.METRICS)
        if metrics is None:
            continue
        values = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if all(math.isfinite(v) for v in values.values()):
            clients[str(partition)] = values
    return clients


def _aggregated(
    strategy: FedpersStrategy, server_round: int, replies: list[Message]
) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """``strategy.aggregate_train``; an exception there keeps the previous global state
    and is recorded as the round's, never the run's end."""
    try:
        return strategy.aggregate_train(server_round, replies)
    except Exception as error:
        strategy.reject_state(server_round, f"aggregation failed: {type(error).__name__}: {error}")
        return None, None


def _plain(metrics: MetricRecord | None) -> dict[str, float]:
    if metrics is None:
        return {}
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
