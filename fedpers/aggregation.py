"""Combining clients' arrays: FedAvg's weighted mean and robust alternatives.

``weighted_mean`` is FedAvg's average (McMahan et al., 2017, Algorithm 1) over named
arrays. Each term is scaled before it is summed, so values near the float limit do not
overflow when their mean does not; the result keeps the arrays' dtype. The robust
aggregations (``Aggregation``) compose with every algorithm's shared parts: the
coordinate-wise trimmed mean and median (Yin et al., "Byzantine-Robust Distributed
Learning", ICML 2018) and a mean of norm-clipped updates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from enum import StrEnum

import numpy as np


class AggregationError(ValueError):
    """Replies that cannot be averaged (none, zero total weight, mismatched arrays)."""


def weighted_mean(
    arrays: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]
) -> dict[str, np.ndarray]:
    """``sum_c w_c a_c / sum_c w_c`` for every array name.

    Raises
    ------
    AggregationError
        With no replies, negative or non-finite weights, a total weight of zero, or
        replies whose names, shapes or dtypes differ.
    """
    if len(arrays) == 0:
        raise AggregationError("no replies to average")
    if len(arrays) != len(weights):
        raise AggregationError(f"{len(arrays)} replies but {len(weights)} weights")
    w = np.asarray(weights, dtype=float)
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise AggregationError(f"weights must be finite and non-negative, got {w.tolist()}")
    total = float(w.sum())
    if total <= 0:
        raise AggregationError("the weights sum to zero: no reply reported any examples")
    _check_same(arrays)
    reference = arrays[0]
    out: dict[str, np.ndarray] = {}
    for name, first in reference.items():
        share = w / total
        accumulator = np.zeros(first.shape, dtype=np.result_type(first.dtype, np.float64))
        for weight, reply in zip(share, arrays, strict=True):
            accumulator += weight * reply[name]
        out[name] = accumulator.astype(first.dtype)
    return out


class Aggregation(StrEnum):
    """How the server combines the clients' shared arrays (run-config ``aggregation``)."""

    MEAN = "mean"  # FedAvg's weighted mean
    TRIMMED_MEAN = "trimmed-mean"  # coordinate-wise, a fraction cut at each end
    MEDIAN = "median"  # coordinate-wise
    CLIPPED_MEAN = "clipped-mean"  # weighted mean of norm-clipped updates


def trim_count(replies: int, trim: float) -> int:
    """Values cut at each end of ``replies`` by a ``trim`` fraction: ``ceil(trim x
    replies)`` (a product within 1e-9 of a whole number counts as that number, so
    ``0.1 x 30`` cuts 3), at least one for any ``trim > 0``."""
    return max(0, math.ceil(trim * replies - 1e-9))


def trims_all(replies: int, trim: float) -> bool:
    """Whether cutting ``trim_count(replies, trim)`` at each end leaves no value."""
    return 2 * trim_count(replies, trim) >= replies


def trimmed_mean(arrays: Sequence[Mapping[str, np.ndarray]], trim: float) -> dict[str, np.ndarray]:
    """Coordinate-wise mean after cutting ``trim_count(k, trim)`` of the lowest and of the
    highest of the ``k`` values (Yin et al., ICML 2018). Unweighted: a client's claimed
    size cannot move it. Any ``trim > 0`` cuts at least one value at each end, at any
    reply count: with 4 replies and ``trim = 0.2``, the lowest and the highest.

    Raises
    ------
    AggregationError
        When the cut leaves no value (``2 x trim_count >= k``).
    """
    _check_same(arrays)
    k = len(arrays)
    cut = trim_count(k, trim)
    if trims_all(k, trim):
        raise AggregationError(
            f"trimmed-mean with aggregation-trim = {trim} cuts {cut} of {k} replies at "
            "each end and leaves none: lower aggregation-trim, or sample more clients"
        )
    out = {}
    for name, first in arrays[0].items():
        stacked = np.stack([a[name] for a in arrays])
        # The values kept are found as scipy.stats.trim_mean finds them (a partition at
        # both cuts), so that the same cut gives the same bits.
        middle = np.partition(stacked, (cut, k - cut - 1), axis=0)[cut : k - cut]
        out[name] = np.asarray(np.mean(middle, axis=0)).astype(first.dtype).reshape(first.shape)
    return out


def coordinate_median(arrays: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Coordinate-wise median (``numpy.median``; Yin et al., ICML 2018). Unweighted."""
    _check_same(arrays)
    return {
        name: np.median(np.stack([a[name] for a in arrays]), axis=0).astype(first.dtype)
        for name, first in arrays[0].items()
    }


def clipped_mean(
    arrays: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float],
    reference: Mapping[str, np.ndarray],
    clip: float,
) -> dict[str, np.ndarray]:
    """Weighted mean of the updates ``a_c - reference``, each scaled down to a norm of at
    most ``clip`` times the median update norm (all arrays of a reply as one vector).

    A client that scales its update up cannot move the mean by more than ``clip``
    typical updates times its weight share.
    """
    _check_same(arrays)
    if set(reference) != set(arrays[0]):
        raise AggregationError(
            f"the reference has arrays {sorted(reference)}, the replies {sorted(arrays[0])}"
        )
    updates = [{n: a[n].astype(np.float64) - reference[n] for n in reference} for a in arrays]
    norms = np.array([np.sqrt(sum(float(np.sum(u * u)) for u in d.values())) for d in updates])
    bound = clip * float(np.median(norms))
    scales = np.minimum(1.0, bound / np.maximum(norms, np.finfo(float).tiny))
    clipped = [
        {n: reference[n] + scale * u for n, u in d.items()}
        for scale, d in zip(scales, updates, strict=True)
    ]
    averaged = weighted_mean(clipped, weights)
    return {n: v.astype(arrays[0][n].dtype) for n, v in averaged.items()}


def aggregate(
    method: Aggregation | str,
    arrays: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float],
    *,
    reference: Mapping[str, np.ndarray],
    trim: float,
    clip: float,
) -> dict[str, np.ndarray]:
    """The clients' arrays combined by ``method`` (see ``Aggregation``).

    ``mean`` is ``weighted_mean`` exactly; ``trimmed-mean`` and ``median`` ignore the
    weights; ``clipped-mean`` needs the current global values as ``reference``.
    """
    if len(arrays) == 0:
        raise AggregationError("no replies to aggregate")
    if method == Aggregation.MEAN:
        return weighted_mean(arrays, weights)
    if method == Aggregation.TRIMMED_MEAN:
        return trimmed_mean(arrays, trim)
    if method == Aggregation.MEDIAN:
        return coordinate_median(arrays)
    if method == Aggregation.CLIPPED_MEAN:
        return clipped_mean(arrays, weights, reference, clip)
    raise AggregationError(f"unknown aggregation '{method}'")


def _check_same(arrays: Sequence[Mapping[str, np.ndarray]]) -> None:
    """Every reply has the arrays of the first, with the same shapes and dtypes."""
    if len(arrays) == 0:
        raise AggregationError("no replies to aggregate")
    reference = arrays[0]
    for index, reply in enumerate(arrays[1:], start=1):
        if set(reply) != set(reference):
            raise AggregationError(
                f"reply {index} has arrays {sorted(reply)}, reply 0 {sorted(reference)}"
            )
        for name, value in reply.items():
            if value.shape != reference[name].shape or value.dtype != reference[name].dtype:
                raise AggregationError(
                    f"array '{name}': reply {index} has {value.dtype}{list(value.shape)}, "
                    f"reply 0 {reference[name].dtype}{list(reference[name].shape)}"
                )
