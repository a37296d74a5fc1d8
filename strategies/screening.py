"""Reply screening: pure functions that say why a reply cannot be used, or None.

A strategy screens every reply before it reaches an aggregate; a rejected reply is
recorded with its reason and never averaged. The checks are plain functions of the
reply (and of what the server expects), tested on their own
(tests/strategies/test_screening.py); an algorithm adds its invariants as one more
function. ``screen`` never raises: a check that fails with an exception rejects the
reply with that exception as its reason, so no client can crash a run.

What every reply must be, whatever the algorithm (``defect``), checked by type and not
by name alone:

- no error; at most two records, each of its name's kind: ``arrays`` an ArrayRecord,
  ``metrics`` a MetricRecord (``records_defect``);
- every array serialized as numpy, decoding to the shape and dtype it declares,
  numeric, finite;
- every metric key a metric name (``METRIC_KEY``: lower-case ASCII words joined by
  ``-`` or ``.``, at most 64 characters) and every value a finite int or float (not a
  list, not a bool) within its declared range (``metric_range``: accuracy in [0, 1],
  counts and losses non-negative);
- ``num-examples`` present (``weight_defect``);
- exactly the arrays the server expects, with their shapes and dtypes
  (``arrays_defect``).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SType

from fedpers import families, privacy, protocol, records
from fedpers.logs import one_line

ArraySpec = tuple[tuple[int, ...], str]  # (shape, dtype) of an array the server expects
Check = Callable[[Message], str | None]


class ScreeningError(ValueError):
    """A reply's content is not what the protocol says it is; the message says why."""


def decode(name: str, array: Array) -> np.ndarray:
    """The values of ``array``, checked against what it declares.

    Raises
    ------
    ScreeningError
        If it is not numpy-serialized, does not decode, decodes to another shape or
        dtype than it declares, is not numeric, or holds a non-finite value.
    """
    if array.stype != SType.NUMPY:
        raise ScreeningError(
            f"array {shown(name)} is serialized as {shown(array.stype)}, not numpy"
        )
    try:
        values = records.values(array)
    except Exception as error:
        raise ScreeningError(f"array '{name}' does not decode ({type(error).__name__})") from None
    if tuple(values.shape) != tuple(array.shape) or _dtype_name(values.dtype) != array.dtype:
        raise ScreeningError(
            f"array '{name}' declares {array.dtype}{list(array.shape)} but holds "
            f"{values.dtype}{list(values.shape)}"
        )
    if values.dtype.kind not in "biuf":
        raise ScreeningError(f"array '{name}' has non-numeric dtype {values.dtype}")
    if values.dtype.kind == "f" and not np.all(np.isfinite(values)):
        raise ScreeningError(f"non-finite values in array '{protocol.ARRAYS}/{name}'")
    return values


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype: np.dtype[Any]) -> str:
    """``str(dtype)``, once per dtype: numpy builds the name anew on every call, 6 % of a
    10,000-client round's screening."""
    return str(dtype)


def arrays_of(reply: Message) -> dict[str, np.ndarray]:
    """The decoded arrays of a reply's ``arrays`` record (empty without one).

    Raises
    ------
    ScreeningError
        As ``decode``.
    """
    record = reply.content.array_records.get(protocol.ARRAYS, ArrayRecord())
    return {name: decode(name, array) for name, array in record.items()}


# The kind of each record a reply may carry, by name: nothing else may come back.
RECORD_KINDS: dict[str, type] = {protocol.ARRAYS: ArrayRecord, protocol.METRICS: MetricRecord}
# A metric key: lower-case ASCII words joined by '-' or '.' ("num-examples", "edge.3").
METRIC_KEY = re.compile(r"[a-z][a-z0-9]*(?:[-.][a-z0-9]+)*", re.ASCII)
MAX_KEY = 64
_LARGEST_INT = 2**63  # a MetricRecord int is an int64 on the wire


def shown(name: object, limit: int = 40) -> str:
    """A name a client chose, safe to log: ASCII-escaped, quoted, at most ``limit``."""
    text = ascii(name)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def records_defect(content: RecordDict) -> str | None:
    """Why a reply's records are not those of the protocol, or None: each record's kind
    must be its name's (``RECORD_KINDS``), and there is no other."""
    for name, record in content.items():
        kind = RECORD_KINDS.get(name)
        if kind is None:
            return (
                f"a record named {shown(name)}: a reply carries only 'arrays' (an "
                "ArrayRecord) and 'metrics' (a MetricRecord)"
            )
        if not isinstance(record, kind):
            return f"record '{name}' is a {type(record).__name__}, not a {kind.__name__}"
    return None


def metric_range(key: str) -> tuple[float, float]:
    """The closed range of metric ``key``: the protocol's (``protocol.METRIC_RANGES``),
    else the first family pattern that matches it (``FamilySpec.metric_ranges``), else
    every finite number."""
    if key in protocol.METRIC_RANGES:
        return protocol.METRIC_RANGES[key]
    for family in families.all_families():
        for pattern, low, high in family.metric_ranges:
            if re.fullmatch(pattern, key, re.ASCII):
                return low, high
    return -math.inf, math.inf


def metric_defect(key: object, value: object) -> str | None:
    """Why ``key: value`` is not a metric, or None: the key a metric name, the value a
    finite int or float within ``metric_range(key)``."""
    if not isinstance(key, str) or len(key) > MAX_KEY or not METRIC_KEY.fullmatch(key):
        return (
            f"metric key {shown(key)} is not a metric name (lower-case ASCII words joined "
            f"by '-' or '.', at most {MAX_KEY} characters)"
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"metric '{key}' is {type(value).__name__}, not a number"
    if isinstance(value, int) and not -_LARGEST_INT <= value < _LARGEST_INT:
        return f"metric '{key}' is an integer beyond int64"
    if not math.isfinite(value):
        return f"non-finite metric '{key}'"
    low, high = metric_range(key)
    if not low <= value <= high:
        return f"metric '{key}' = {value:.6g} is outside its range [{low:g}, {high:g}]"
    return None


def defect(reply: Message) -> str | None:
    """Why a reply is unusable whatever the algorithm: a client error, a record that is
    not the protocol's (by name and kind), an array that is not what it declares or not
    finite, or a metric that is not a metric (``metric_defect``)."""
    if reply.has_error():
        return f"client error: {one_line(reply.error.reason)}"
    content = reply.content
    if reason := records_defect(content):
        return reason
    try:
        arrays_of(reply)
    except ScreeningError as error:
        return str(error)
    for key, value in content.metric_records.get(protocol.METRICS, MetricRecord()).items():
        if reason := metric_defect(key, value):
            return reason
    return None


def num_examples(reply: Message) -> float:
    """The reply's ``num-examples`` (after ``weight_defect`` passed)."""
    value = reply.content.metric_records[protocol.METRICS][protocol.NUM_EXAMPLES]
    return records.number(value, protocol.NUM_EXAMPLES)


def weight_defect(reply: Message) -> str | None:
    """Why a reply's ``num-examples`` cannot weigh it: missing from a ``metrics``
    MetricRecord, or not a number in its range (``metric_defect``)."""
    if reason := records_defect(reply.content):
        return reason
    metrics = reply.content.metric_records.get(protocol.METRICS)
    if metrics is None or protocol.NUM_EXAMPLES not in metrics:
        return f"no '{protocol.NUM_EXAMPLES}' metric"
    return metric_defect(protocol.NUM_EXAMPLES, metrics[protocol.NUM_EXAMPLES])


def arrays_defect(
    returned: ArrayRecord, expected: Mapping[str, ArraySpec], *, exact: bool = True
) -> str | None:
    """Why the arrays of a reply are not those the server expects, or None.

    Every expected array that came back must keep its shape and dtype; with ``exact``
    every expected array must come back and nothing else may.
    """
    for name, (shape, dtype) in expected.items():
        if name not in returned:
            continue
        value = returned[name]
        if tuple(value.shape) != shape or value.dtype != dtype:
            return (
                f"array '{name}' is {value.dtype}{list(value.shape)}, expected {dtype}{list(shape)}"
            )
    if exact:
        missing = sorted(set(expected) - set(returned))
        if missing:
            return f"arrays missing from the reply: {missing[:3]}"
        extra = sorted(set(returned) - set(expected))
        if extra:
            return f"arrays the server did not expect: {extra[:3]}"
    return None


def array_specs(arrays: ArrayRecord) -> dict[str, ArraySpec]:
    """Shape and dtype of every array, as ``arrays_defect`` expects them."""
    return {name: (tuple(a.shape), a.dtype) for name, a in arrays.items()}


HUGE = 1e6  # how many times larger than what was sent a returned value may be


def magnitude_defect(
    returned: Mapping[str, np.ndarray], sent: Mapping[str, np.ndarray], *, factor: float = HUGE
) -> str | None:
    """Why returned arrays cannot be an update of what was sent, or None: a value more
    than ``factor`` times the largest sent value (at least 1) is no training step; it
    is an overflow or an attack (values of 1e30 or float32's maximum)."""
    for name, values in returned.items():
        if name not in sent or values.dtype.kind != "f":
            continue
        bound = factor * max(1.0, float(np.max(np.abs(sent[name]), initial=0.0)))
        largest = float(np.max(np.abs(values), initial=0.0))
        if largest > bound:
            return f"array '{name}' holds {largest:.3g}, beyond {factor:g} x what was sent"
    return None


def update_norm(returned: Mapping[str, np.ndarray], sent: Mapping[str, np.ndarray]) -> float:
    """The norm of ``returned - sent`` over the floating-point arrays both hold, all of
    them as one vector (``privacy.update_norm`` of those, in float64)."""
    shared = {
        name: values
        for name, values in returned.items()
        if name in sent and values.dtype.kind == "f" and values.shape == sent[name].shape
    }
    return privacy.update_norm(shared, sent)


def lower_median(values: Iterable[float]) -> float:
    """The ``(n+1)//2``-th smallest of ``values``: with one value changed, it moves at
    most one rank, so a minority cannot set it. Raises ValueError when empty."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("the lower median of no values")
    return ordered[(len(ordered) - 1) // 2]


def norm_outliers(norms: Sequence[float], cap: float) -> tuple[float, list[int]]:
    """``cap`` times the lower median of ``norms``, and the indices of the norms beyond
    it. With fewer than two norms, or a lower median of zero (most replies returned what
    was sent), there is no scale to compare with: the bound is infinite."""
    if len(norms) < 2:
        return math.inf, []
    typical = lower_median(norms)
    if not typical > 0:
        return math.inf, []
    bound = cap * typical
    return bound, [index for index, norm in enumerate(norms) if not norm <= bound]


def dtype_defect(arrays: Mapping[str, np.ndarray], dtype: str = "float64") -> str | None:
    """Why ``arrays`` are not all of ``dtype`` (what honest start-up answers send), or
    None. Integers would break the bounds computed on them: ``abs`` of int64's least
    value is negative, and products wrap around (an int64 sum of -2**63 squares to 0)."""
    for name, values in arrays.items():
        if values.dtype != np.dtype(dtype):
            return f"array '{name}' is {values.dtype}, expected {dtype}"
    return None


def symmetric_psd_defect(name: str, matrices: np.ndarray, *, tolerance: float = 1e-6) -> str | None:
    """Why ``matrices`` (``(..., d, d)``) are not symmetric positive semi-definite within
    ``tolerance`` relative to each matrix's own scale, or None.

    Each matrix is judged by its own largest entry: a scale shared by all let one huge
    matrix widen the tolerance of the others, so that a reply could make another
    component negative definite and void every round's pooled covariance.
    """
    stack = matrices.reshape(-1, *matrices.shape[-2:])
    d = matrices.shape[-1]
    for index, matrix in enumerate(stack):
        where = f"'{name}'" if len(stack) == 1 else f"'{name}' [{index}]"
        if not np.all(np.isfinite(matrix)):  # finite inputs can overflow on the way here
            return f"{where} is not finite"
        scale = max(1.0, float(np.max(np.abs(matrix), initial=0.0)))
        if not np.allclose(matrix, matrix.T, rtol=0, atol=tolerance * scale):
            return f"{where} is not symmetric"
        lowest = float(np.min(np.linalg.eigvalsh(matrix), initial=0.0))
        if lowest < -tolerance * scale * d:
            return f"{where} is not positive semi-definite (eigenvalue {lowest:.3g})"
    return None


def statistics_defect(
    count: np.ndarray, first: np.ndarray, second: np.ndarray, *, full: bool
) -> str | None:
    """Why ``(sum r, sum r (z - c), sum r (z - c)(z - c)^T)`` per component cannot be the
    statistics of any data, or None: counts non-negative, second moments symmetric
    positive semi-definite (``full``; else non-negative variances), and so the
    covariances they imply."""
    if np.any(count < 0):
        return "negative statistics counts"
    safe = np.maximum(count, 1e-12)
    if full:
        if reason := symmetric_psd_defect("second moments", second):
            return reason
        implied = second - np.einsum("ki,kj->kij", first, first) / safe[:, None, None]
        return symmetric_psd_defect("implied covariance", implied, tolerance=1e-5)
    if np.any(second < 0):
        return "negative second moments of a diagonal covariance"
    implied = second - first**2 / safe[:, None]
    if np.any(implied < -1e-5 * max(1.0, float(np.max(np.abs(second), initial=0.0)))):
        return "implied variances are negative"
    return None


def outliers(sizes: Mapping[int, float], *, factor: float = 100.0) -> set[int]:
    """Keys whose size exceeds ``factor`` times the median size (with at least three
    keys; fewer cannot outvote one). Honest clients of one task send values of one
    scale; a value scaled up by orders of magnitude stands out."""
    if len(sizes) < 3:
        return set()
    median = float(np.median(list(sizes.values())))
    return {key for key, size in sizes.items() if size > factor * max(median, 1e-12)}


def pilots_defect(name: str, values: np.ndarray, *, tolerance: float = 1e-3) -> str | None:
    """Why ``values`` are not pilot latents as Sheaf-FRL relays them, or None: whitened
    by their own statistics (or rotated or transported after that, which keeps it), so
    every column's mean square is at most one."""
    if values.ndim != 2:
        return f"'{name}' is not a matrix"
    largest = float(np.max(np.mean(values**2, axis=0), initial=0.0))
    if not largest <= 1.0 + tolerance:
        return f"'{name}' is not whitened (a column's mean square is {largest:.3g})"
    return None


def orthonormal_defect(name: str, values: np.ndarray, *, tolerance: float = 1e-6) -> str | None:
    """Why ``values`` do not have orthonormal columns (a Stiefel map), or None."""
    if values.ndim != 2 or values.shape[0] < values.shape[1]:
        return f"'{name}' is not a tall matrix"
    gram = values.T @ values
    if not np.allclose(gram, np.eye(values.shape[1]), rtol=0, atol=tolerance):
        return f"'{name}' does not have orthonormal columns"
    return None


@dataclass(frozen=True)
class Screened:
    """Replies that passed, ``(partition, reason)`` of those that did not, and
    ``(partition, what)`` of kept replies the server changed (``notes``: a weight
    capped)."""

    kept: list[Message]
    rejected: list[tuple[int, str]]
    notes: list[tuple[int, str]] = field(default_factory=list)


def first_defect(reply: Message, checks: Iterable[Check]) -> str | None:
    """The reason of the first check that rejects ``reply``, or None; a check that
    raises rejects it with the exception as its reason."""
    for check in checks:
        try:
            reason = check(reply)
        except Exception as error:
            reason = f"screening failed: {type(error).__name__}: {error}"
        if reason is not None:
            return reason
    return None


def screen(
    replies: Iterable[Message], checks: Iterable[Check], partition_of: Callable[[Message], int]
) -> Screened:
    """Apply ``checks`` in order to every reply; the first reason rejects it
    (``first_defect``)."""
    checks = list(checks)
    kept, rejected = [], []
    for reply in replies:
        reason = first_defect(reply, checks)
        if reason is None:
            kept.append(reply)
        else:
            rejected.append((partition_of(reply), reason))
    return Screened(kept, rejected)
