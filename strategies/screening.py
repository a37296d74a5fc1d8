"""Reply screening: pure functions that say why a reply cannot be used, or None.

A strategy screens every reply before it reaches an aggregate; a rejected reply is
recorded with its reason and never averaged. The checks are plain functions of the
reply (and of what the server expects), so they are tested on their own
(tests/strategies/test_screening.py) and an algorithm adds its own invariants as one
more function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, Message

from fedpers import protocol

ArraySpec = tuple[tuple[int, ...], str]  # (shape, dtype) of an array the server sent
Check = Callable[[Message], str | None]


def defect(reply: Message) -> str | None:
    """Why a reply is unusable whatever the algorithm: a client error, or a non-finite
    value in any of its arrays or metrics."""
    if reply.has_error():
        return f"client error: {reply.error.reason}"
    for name, arrays in reply.content.array_records.items():
        for key, array in arrays.items():
            values = array.numpy()
            if np.issubdtype(values.dtype, np.number) and not np.all(np.isfinite(values)):
                return f"non-finite values in array '{name}/{key}'"
    for metrics in reply.content.metric_records.values():
        for key, value in metrics.items():
            if isinstance(value, float) and not np.isfinite(value):
                return f"non-finite metric '{key}'"
    return None


def weight_defect(reply: Message) -> str | None:
    """Why a reply's ``num-examples`` cannot weigh it: missing or negative."""
    metrics = reply.content.metric_records.get(protocol.METRICS)
    if metrics is None or protocol.NUM_EXAMPLES not in metrics:
        return f"no '{protocol.NUM_EXAMPLES}' metric"
    if float(metrics[protocol.NUM_EXAMPLES]) < 0:  # type: ignore[arg-type]
        return "negative number of examples"
    return None


def arrays_mismatch(
    returned: ArrayRecord, sent: Mapping[str, ArraySpec], *, require_all: bool
) -> str | None:
    """Why the arrays a reply returned do not fit those the server sent, or None.

    Every returned array that the server sent must keep its shape and dtype; with
    ``require_all`` every sent array must come back. Arrays the server did not send
    (statistics, gammas) are the algorithm's to check.
    """
    for name, (shape, dtype) in sent.items():
        if name not in returned:
            continue
        value = returned[name]
        if tuple(value.shape) != shape or value.dtype != dtype:
            return (
                f"array '{name}' is {value.dtype}{list(value.shape)}, expected {dtype}{list(shape)}"
            )
    if require_all and set(returned) < set(sent):
        missing = sorted(set(sent) - set(returned))[:3]
        return f"arrays missing from the reply: {missing}"
    return None


def array_specs(arrays: ArrayRecord) -> dict[str, ArraySpec]:
    """Shape and dtype of every array, as ``arrays_mismatch`` expects them."""
    return {name: (tuple(a.shape), a.dtype) for name, a in arrays.items()}


@dataclass(frozen=True)
class Screened:
    """Replies that passed, and ``(partition, reason)`` of those that did not."""

    kept: list[Message]
    rejected: list[tuple[int, str]]


def screen(
    replies: Iterable[Message], checks: Iterable[Check], partition_of: Callable[[Message], int]
) -> Screened:
    """Apply ``checks`` in order to every reply; the first reason rejects it."""
    checks = list(checks)
    kept, rejected = [], []
    for reply in replies:
        reason = next((r for check in checks if (r := check(reply)) is not None), None)
        if reason is None:
            kept.append(reply)
        else:
            rejected.append((partition_of(reply), reason))
    return Screened(kept, rejected)
