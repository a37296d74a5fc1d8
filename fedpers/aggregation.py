"""Weighted averaging of clients' arrays, with its edge cases stated.

``weighted_mean`` is FedAvg's average (McMahan et al., 2017, Algorithm 1) over named
arrays. Each term is scaled before it is summed, so values near the float limit do not
overflow when their mean does not; the result keeps the arrays' dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
    out: dict[str, np.ndarray] = {}
    for name, first in reference.items():
        share = w / total
        accumulator = np.zeros(first.shape, dtype=np.result_type(first.dtype, np.float64))
        for weight, reply in zip(share, arrays, strict=True):
            accumulator += weight * reply[name]
        out[name] = accumulator.astype(first.dtype)
    return out
