"""Statistics over seeds and clients: mean, sample std and Student's t 95% interval of
the mean over seeds, a percentile over clients (the 10th: ``client_p10``), and the
population std over clients."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def seed_statistics(values: Sequence[float]) -> tuple[float, float, list[float]]:
    """Mean, sample standard deviation and the 95% interval of the mean (Student's t,
    ``n - 1`` degrees of freedom) of per-seed values. With one value the std and the
    interval are NaN (written as null): one seed says nothing about the spread.
    Missing values (None, NaN) are left out."""
    kept = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not kept:
        return math.nan, math.nan, [math.nan, math.nan]
    mean = math.fsum(kept) / len(kept)
    if len(kept) < 2:
        return mean, math.nan, [math.nan, math.nan]
    from scipy import stats

    std = math.sqrt(math.fsum((v - mean) ** 2 for v in kept) / (len(kept) - 1))
    half = float(stats.t.ppf(0.975, len(kept) - 1)) * std / math.sqrt(len(kept))
    return mean, std, [mean - half, mean + half]


def add_statistics(
    summary: dict[str, Any], name: str, per_seed: Any, *, per_seed_key: str | None = None
) -> None:
    """Set ``summary[name]`` to the means of ``per_seed`` (a list of per-seed values,
    or nested dicts of such lists) and add its companions ``NAME_std``, ``NAME_ci95``
    (``[low, high]``) and the per-seed lists (``per_seed_key``, default
    ``NAME_per_seed``), with the same nesting."""

    def walk(tree: Any, index: int) -> Any:
        if isinstance(tree, Mapping):
            return {k: walk(v, index) for k, v in tree.items()}
        return seed_statistics(tree)[index]

    summary[name] = walk(per_seed, 0)
    summary[f"{name}_std"] = walk(per_seed, 1)
    summary[f"{name}_ci95"] = walk(per_seed, 2)
    summary[per_seed_key or f"{name}_per_seed"] = per_seed


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (numpy's linear interpolation); NaN without values."""
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else math.nan


def known_mean(values: Sequence[Any]) -> float:
    """The mean of the known values (None left out); NaN without any."""
    kept = [float(v) for v in values if v is not None]
    return math.fsum(kept) / len(kept) if kept else math.nan


def population_std(values: Sequence[float]) -> float:
    """The population standard deviation (``n`` in the denominator: the spread of these
    clients, not an estimate of a larger population's); NaN without values."""
    if not values:
        return math.nan
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
