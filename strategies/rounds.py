"""The round loop: Flower's ``Strategy.start``, and what fedpers needs on top.

Every round calls the strategy as Flower's ``Strategy.start`` does, in its order, so a
strategy written from Flower's documentation works:

1. ``configure_train(round, arrays, config, grid)``: the TRAIN messages, which the
   federation sends, collecting the replies by partition (``Federation.send``);
2. ``screen(round, replies)`` (fedpers): the replies fit to aggregate; the others are
   left out with their reasons, so no reply reaches ``aggregate_train`` unchecked;
3. ``aggregate_train(round, kept)``: the new global arrays and training metrics, adopted
   unless ``state_defect`` names a reason not to;
4. ``configure_evaluate(round, arrays, config, grid)``, in the rounds ``evaluates``
   names (``evaluate-every``), ``screen_evaluate(round, replies)`` (fedpers), then
   ``aggregate_evaluate(round, kept)``: as in training, no reply reaches an aggregate
   or a per-client figure unchecked;
5. ``evaluate_fn(round, arrays)``, the server-side evaluation, as in Flower.

On top of Flower's loop: a resumed run starts after its checkpoint (``first_round``);
nodes that restarted under a new id are re-mapped before each round; a round's results
are values its steps return (``TrainOutcome``, ``EvaluateOutcome``, together a
``RoundOutcome``), reported as a ``RoundRecord`` (the results writer is a callback,
outside any aggregation code); a round with fewer usable replies than ``min-replies``
stops the run after it is recorded, unless enough clients answered and the state sent
was what failed: then the round goes back to the last global state sent that got enough
usable replies (``rolled_back``), and only a round from that state that fails too (or
round 1, with no such state) stops the run. The strategy is anything with the methods of
``RoundStrategy``: ``FedpersStrategy`` (strategies/base.py) and its algorithms.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedpers import protocol, records
from fedpers.results import RoundRecord
from fedpers.strategies import screening
from fedpers.strategies.federation import Federation

logger = logging.getLogger(__name__)

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


class RoundFailedError(RuntimeError):
    """A round got fewer usable replies than ``min-replies``."""


class RoundStrategy(Protocol):
    """What the loop calls: Flower's four round methods and fedpers' round hooks."""

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...

    def configure_train_rejections(self, server_round: int) -> Sequence[str]: ...

    def screen(self, server_round: int, replies: Iterable[Message]) -> screening.Screened: ...

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]: ...

    def state_defect(self, new: ArrayRecord, previous: ArrayRecord) -> str | None: ...

    def evaluates(self, server_round: int, last: int) -> bool: ...

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...

    def screen_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> screening.Screened: ...

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None: ...

    def round_metrics(self, server_round: int) -> dict[str, float]: ...


@dataclass(frozen=True)
class TrainOutcome:
    """What a round's training step returns.

    Attributes
    ----------
    arrays : ArrayRecord
        The global state after the step: ``aggregate_train``'s arrays if adopted, else
        the state the round started from.
    metrics : MetricRecord or None
        ``aggregate_train``'s metrics.
    sampled : int
        Partitions sent a TRAIN message.
    accepted : int
        Replies that passed screening and carry weight (``num-examples`` > 0).
    rejections : tuple of str
        Every answer left out or changed, and a new state not adopted, with why, in the
        order they happened (``partition P: reason``, ``global state not adopted: ...``).
    bytes_sent, bytes_received : int
        Bytes of the TRAIN messages and of the replies without error (``record_bytes``).
    replied : tuple of int
        Partitions whose reply came back without error, screened out or not: a client
        replies after it saved its state (``clients.device_state``), so these hold a
        snapshot of the round.
    """

    arrays: ArrayRecord
    metrics: MetricRecord | None
    sampled: int
    accepted: int
    rejections: tuple[str, ...]
    bytes_sent: int
    bytes_received: int
    replied: tuple[int, ...] = ()


@dataclass(frozen=True)
class EvaluateOutcome:
    """What a round's evaluation step returns (the defaults: no evaluation).

    Attributes
    ----------
    metrics : MetricRecord or None
        ``aggregate_evaluate``'s metrics.
    evaluated : int
        Replies without error.
    clients : mapping of str to dict
        Each evaluated partition's own metrics (``per_client``), of the replies that
        passed ``screen_evaluate``.
    bytes : int
        Bytes of the EVALUATE messages and of their replies, both ways.
    rejections : tuple of str
        Every evaluation reply left out or changed, with why
        (``evaluate: partition P: reason``).
    """

    metrics: MetricRecord | None = None
    evaluated: int = 0
    clients: Mapping[str, dict[str, float]] = field(default_factory=dict)
    bytes: int = 0
    rejections: tuple[str, ...] = ()


@dataclass(frozen=True)
class RoundOutcome:
    """One round's results: its training and evaluation steps and ``evaluate_fn``'s
    metrics of the round's global state."""

    round: int
    train: TrainOutcome
    evaluate: EvaluateOutcome
    server_metrics: MetricRecord | None


def run_rounds(
    strategy: RoundStrategy,
    grid: Grid,
    federation: Federation,
    initial_arrays: ArrayRecord,
    *,
    num_rounds: int,
    timeout: float,
    train_config: ConfigRecord,
    evaluate_config: ConfigRecord,
    min_replies: int,
    evaluate_fn: EvaluateFn | None = None,
    first_round: int = 1,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_checkpoint: Callable[[int, ArrayRecord], None] | None = None,
) -> Result:
    """Rounds ``first_round..num_rounds`` of ``strategy``; see the module docstring.
    Every round gets its own copy of ``train_config`` and ``evaluate_config``.

    Raises
    ------
    RoundFailedError
        When a round has fewer usable training replies than ``min_replies``, unless it
        goes back to an earlier state (``rolled_back``): it has fewer answers than
        ``min_replies``, or no state to go back to (round 1 after a start or a resume,
        or the round after one that went back).
    """
    result = Result()
    arrays = initial_arrays
    result.arrays = arrays
    if evaluate_fn is not None and (metrics := evaluate_fn(first_round - 1, arrays)) is not None:
        result.evaluate_metrics_serverapp[first_round - 1] = metrics
    healthy: tuple[int, ArrayRecord] | None = None  # the last state sent that got enough
    for server_round in range(first_round, num_rounds + 1):
        started = time.monotonic()
        federation.refresh(grid, timeout=timeout)
        config = ConfigRecord(dict(train_config))
        sent = arrays
        train = train_step(strategy, grid, federation, server_round, arrays, config, timeout)
        failed = bool(train.sampled) and train.accepted < min_replies
        back = _back_to(train, sent, healthy, min_replies) if failed else None
        if back is not None:
            train = rolled_back(train, server_round, min_replies, *back)
        arrays = train.arrays
        trained = time.monotonic()
        evaluate = EvaluateOutcome()
        if strategy.evaluates(server_round, num_rounds):
            config = ConfigRecord(dict(evaluate_config))
            evaluate = evaluate_step(
                strategy, grid, federation, server_round, arrays, config, timeout
            )
        server_metrics = evaluate_fn(server_round, arrays) if evaluate_fn else None
        outcome = RoundOutcome(server_round, train, evaluate, server_metrics)
        _keep(result, outcome)
        extra = {
            **strategy.round_metrics(server_round),
            STATE_WELL_FORMED: float(well_formed(arrays, initial_arrays)),
            **({ROLLED_BACK_TO: float(back[0])} if back is not None else {}),
        }
        record = _record(outcome, extra, started=started, trained=trained)
        if on_round is not None:
            on_round(record)
        if failed and back is None:
            raise RoundFailedError(
                f"round {server_round}: {train.accepted} usable replies of {train.sampled}, "
                f"fewer than min-replies = {min_replies}; " + "; ".join(record.rejections[:5])
            )
        healthy = healthy if failed else (server_round - 1, sent)
        if on_checkpoint is not None:
            on_checkpoint(server_round, arrays)
    return result


def train_step(
    strategy: RoundStrategy,
    grid: Grid,
    federation: Federation,
    server_round: int,
    arrays: ArrayRecord,
    config: ConfigRecord,
    timeout: float,
) -> TrainOutcome:
    """``configure_train``, the exchange, ``screen``, ``aggregate_train`` and
    ``state_defect``: a round's training, from the global state ``arrays``."""
    messages = list(strategy.configure_train(server_round, arrays, config, grid))
    rejections = [*federation.take_notes(), *strategy.configure_train_rejections(server_round)]
    exchange = federation.send(grid, messages, timeout=timeout)
    sent, received = _bytes(messages), _reply_bytes(exchange.replies)
    for partition in sorted(set(exchange.failures) - set(exchange.replies)):
        rejections.append(_left_out(server_round, partition, exchange.failures[partition]))
    screened = strategy.screen(server_round, exchange.replies.values())
    rejections += [_left_out(server_round, p, reason) for p, reason in screened.rejected]
    rejections += [_changed(server_round, p, what) for p, what in screened.notes]
    new, metrics, reason = _aggregated(strategy, server_round, screened.kept)
    if new is not None:
        reason = strategy.state_defect(new, arrays)
        arrays = new if reason is None else arrays
    if reason is not None:
        rejections.append(_not_adopted(server_round, reason))
    accepted = sum(
        screening.weight_defect(r) is None and screening.num_examples(r) > 0 for r in screened.kept
    )
    replied = tuple(p for p, reply in exchange.replies.items() if not reply.has_error())
    return TrainOutcome(
        arrays, metrics, len(exchange.sent), accepted, tuple(rejections), sent, received, replied
    )


def _back_to(
    train: TrainOutcome,
    sent: ArrayRecord,
    healthy: tuple[int, ArrayRecord] | None,
    min_replies: int,
) -> tuple[int, ArrayRecord] | None:
    """``healthy`` (the last state sent that got enough usable replies, and its round)
    if a round below ``min-replies`` goes back to it (``rolled_back``): enough clients
    answered (too few of the answers were usable), and it is not the state ``sent``
    this round; else None."""
    answered = len(train.replied) >= min_replies
    return healthy if answered and healthy is not None and healthy[1] is not sent else None


def rolled_back(
    train: TrainOutcome, server_round: int, min_replies: int, last: int, state: ArrayRecord
) -> TrainOutcome:
    """``train``, a round below ``min-replies`` after a healthy one, with the global state
    of round ``last`` (``state``: the last state sent that got enough usable replies) in
    place of the round's. Only for a round where enough clients answered and too few
    answers were usable: the state sent is what failed (a model an attacker in every
    round drove off, or one that diverged, from which every client's training broke the
    value bound), so it is not kept, and the run goes on from one that was usable. Too
    few answers (nodes down, timeouts) say nothing about the state, and stop the run;
    so does a round from ``state`` that fails too (``run_rounds``)."""
    where = "the initial state" if last == 0 else f"round {last}'s"
    reason = (
        f"{train.accepted} usable replies of {train.sampled}, fewer than min-replies = "
        f"{min_replies}: the global state goes back to {where}, the last that got "
        "enough usable replies"
    )
    rejections = (*train.rejections, _not_adopted(server_round, reason))
    return replace(train, arrays=state, rejections=rejections)


def evaluate_step(
    strategy: RoundStrategy,
    grid: Grid,
    federation: Federation,
    server_round: int,
    arrays: ArrayRecord,
    config: ConfigRecord,
    timeout: float,
) -> EvaluateOutcome:
    """``configure_evaluate``, the exchange, ``screen_evaluate`` and
    ``aggregate_evaluate`` of the replies it kept; nothing without a message to send."""
    messages = list(strategy.configure_evaluate(server_round, arrays, config, grid))
    if not messages:
        return EvaluateOutcome()
    exchange = federation.send(grid, messages, timeout=timeout)
    evaluated = sum(not r.has_error() for r in exchange.replies.values())
    kept, rejections = screened_replies(strategy, server_round, exchange.replies)
    try:
        metrics = strategy.aggregate_evaluate(server_round, kept.values())
    except Exception as error:  # the round's evaluation is lost, never the run
        metrics = None
        rejections.append(
            _not_adopted(
                server_round,
                f"evaluation aggregation failed: {type(error).__name__}: {error}",
                what="evaluation",
            )
        )
    return EvaluateOutcome(
        metrics=metrics,
        evaluated=evaluated,
        clients=per_client(kept),
        bytes=_bytes(messages) + _reply_bytes(exchange.replies),
        rejections=tuple(rejections),
    )


class EvaluationScreen(Protocol):
    def screen_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> screening.Screened: ...


def screened_replies(
    strategy: EvaluationScreen, server_round: int, replies: Mapping[int, Message]
) -> tuple[dict[int, Message], list[str]]:
    """The evaluation ``replies`` (by partition) that ``screen_evaluate`` keeps, and why
    each other was left out or changed (``evaluate: partition P: ...``). A reply whose
    error the exchange already reported is left out without a second line."""
    screened = strategy.screen_evaluate(server_round, replies.values())
    kept_ids = {id(reply) for reply in screened.kept}
    kept = {p: r for p, r in replies.items() if id(r) in kept_ids}
    lines = [
        _left_out(server_round, p, reason, phase="evaluate")
        for p, reason in screened.rejected
        if p not in replies or not replies[p].has_error()
    ]
    lines += [_changed(server_round, p, what, phase="evaluate") for p, what in screened.notes]
    return kept, lines


def _aggregated(
    strategy: RoundStrategy, server_round: int, replies: list[Message]
) -> tuple[ArrayRecord | None, MetricRecord | None, str | None]:
    """``strategy.aggregate_train`` and None, or an exception there as the reason the
    previous global state is kept: the round's end, never the run's."""
    try:
        arrays, metrics = strategy.aggregate_train(server_round, replies)
    except Exception as error:
        return None, None, f"aggregation failed: {type(error).__name__}: {error}"
    return arrays, metrics, None


def _left_out(server_round: int, partition: int, reason: str, *, phase: str = "") -> str:
    where = f"{phase} " if phase else ""
    logger.warning(
        "round %d: left out the %sreply of partition %d: %s",
        server_round,
        where,
        partition,
        reason,
    )
    return (
        f"{phase}: partition {partition}: {reason}" if phase else f"partition {partition}: {reason}"
    )


def _changed(server_round: int, partition: int, what: str, *, phase: str = "") -> str:
    logger.warning(
        "round %d: %spartition %d: %s", server_round, f"{phase} " if phase else "", partition, what
    )
    return f"{phase}: partition {partition}: {what}" if phase else f"partition {partition}: {what}"


def _not_adopted(server_round: int, reason: str, *, what: str = "global state") -> str:
    logger.warning("round %d: %s not adopted: %s", server_round, what, reason)
    return f"{what} not adopted: {reason}"


def _keep(result: Result, outcome: RoundOutcome) -> None:
    """Add a round's outcome to Flower's ``Result``."""
    server_round = outcome.round
    result.arrays = outcome.train.arrays
    if outcome.train.metrics is not None:
        result.train_metrics_clientapp[server_round] = outcome.train.metrics
    if outcome.evaluate.metrics is not None:
        result.evaluate_metrics_clientapp[server_round] = outcome.evaluate.metrics
    if outcome.server_metrics is not None:
        result.evaluate_metrics_serverapp[server_round] = outcome.server_metrics


def _record(
    outcome: RoundOutcome, extra: dict[str, float], *, started: float, trained: float
) -> RoundRecord:
    """The round as ``rounds.jsonl`` keeps it; ``extra``: the strategy's own server-side
    figures and the state check."""
    train, evaluate = outcome.train, outcome.evaluate
    return RoundRecord(
        round=outcome.round,
        seconds=time.monotonic() - started,
        train=_plain(train.metrics),
        evaluate=_plain(evaluate.metrics),
        server={
            **_plain(outcome.server_metrics),
            **extra,
            BYTES_SENT: float(train.bytes_sent),
            BYTES_RECEIVED: float(train.bytes_received),
            EVALUATE_BYTES: float(evaluate.bytes),
        },
        sampled=train.sampled,
        replies=train.accepted,
        failures=train.sampled - train.accepted,
        evaluated=evaluate.evaluated,
        rejections=[*train.rejections, *evaluate.rejections],
        train_seconds=trained - started,
        evaluate_seconds=time.monotonic() - trained,
        clients=dict(evaluate.clients),
        trained=list(train.replied),
    )


STATE_WELL_FORMED = "state-well-formed"  # 1: the round's global state is sound
ROLLED_BACK_TO = "rolled-back-to"  # a round below min-replies: the state it went back to


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
    for kind in (content.array_records, content.config_records, content.metric_records):
        for record in kind.values():
            try:
                total += int(record.count_bytes())
            except Exception:  # an empty list, a value of a type Flower does not count
                total += sum(len(str(k)) + len(repr(v)) for k, v in record.items())
    return total


def _bytes(messages: Iterable[Message]) -> int:
    return sum(record_bytes(message.content) for message in messages)


def _reply_bytes(replies: Mapping[int, Message]) -> int:
    """Bytes of the replies that came back without error (error replies carry no
    content)."""
    return sum(record_bytes(r.content) for r in replies.values() if not r.has_error())


def per_client(replies: Mapping[int, Message]) -> dict[str, dict[str, float]]:
    """Each evaluated partition's own metrics (``{"17": {"accuracy": ...}}``), of
    ``replies`` that passed screening (``screened_replies``): a reply that did not is
    skipped here too, whatever it holds."""
    clients: dict[str, dict[str, float]] = {}
    for partition, reply in sorted(replies.items()):
        if screening.defect(reply) is not None:
            continue
        metrics = reply.content.metric_records.get(protocol.METRICS, MetricRecord())
        clients[str(partition)] = {k: records.number(v, k) for k, v in metrics.items()}
    return clients


def _plain(metrics: MetricRecord | None) -> dict[str, float]:
    if metrics is None:
        return {}
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
