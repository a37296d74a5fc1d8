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

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedpers.results import RoundRecord

if TYPE_CHECKING:
    from strategies.base import FedpersStrategy

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
            server={**_plain(server_metrics), **strategy.round_metrics(server_round), **checked},
            sampled=len(contents),
            replies=accepted,
            failures=len(contents) - accepted,
            evaluated=evaluated,
            rejections=list(strategy.rejections.get(server_round, [])),
            train_seconds=trained - started,
            evaluate_seconds=time.monotonic() - trained,
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
