"""The figures of a script: per-round curves over seeds (mean, shaded std) and the
distribution of the clients' final accuracy."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def plot_seeded(
    curves: Mapping[str, Sequence[Sequence[Any]]],
    metric: str,
    path: Path,
    *,
    title: str = "",
    scale: float = 100.0,
    ylabel: str = "",
    note: str = "",
    order: Sequence[str] = (),
) -> None:
    """One line per method: the mean over seeds of ``metric`` per round, shaded
    ± one std where there are several seeds (``curves[method]`` = each seed's round
    records); values times ``scale`` (100: in %, as the tables); ``note`` is written
    under the axes (e.g. why some rows have no curve); ``order``: the methods whose
    positions give the styles (so that a method looks the same in every figure of a
    script, where some figures leave methods out)."""
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np
    from matplotlib import pyplot as plt

    from fedpers.reports import finish_figure, method_styles
    from fedpers.results import metric_value

    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    styles = method_styles([*order, *curves])
    missing = []
    for label, runs in curves.items():
        by_round: dict[int, list[float]] = {}
        for records in runs:
            for record in records:
                value = metric_value(record, metric)
                if not math.isnan(value):
                    by_round.setdefault(record.round, []).append(scale * value)
        if not by_round:
            missing.append(label)
            continue
        rounds = sorted(by_round)
        means = np.array([np.mean(by_round[r]) for r in rounds])
        (line,) = axes.plot(rounds, means, label=label, **styles[label])
        if len(runs) > 1:
            spread = np.array(
                [np.std(by_round[r], ddof=1) if len(by_round[r]) > 1 else 0.0 for r in rounds]
            )
            axes.fill_between(
                rounds, means - spread, means + spread, color=line.get_color(), alpha=0.2
            )
    axes.set_xlabel("round")
    axes.set_ylabel(ylabel or metric.split(".", 1)[-1] + (" (%)" if scale == 100 else ""))
    axes.set_title(title or metric, fontsize=9)
    finish_figure(figure, axes, path, missing=missing, percent=scale == 100, note=note)


def plot_client_cdf(
    per_client: Mapping[str, Mapping[str, float]], path: Path, *, title: str = ""
) -> None:
    """The distribution of final per-client accuracy per method: empirical CDFs (in %),
    the 10th percentile marked."""
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np
    from matplotlib import pyplot as plt

    from fedpers.reports import finish_figure, method_styles

    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    styles = method_styles(list(per_client))
    missing = []
    for method, clients in per_client.items():
        values = np.sort(100 * np.asarray(list(clients.values()), dtype=float))
        if values.size == 0:
            missing.append(method)
            continue
        fractions = np.arange(1, values.size + 1) / values.size
        axes.step(values, fractions, where="post", label=method, **styles[method])
    axes.axhline(0.1, color="grey", lw=0.8, ls="--")
    axes.set_xlabel("final accuracy of a client (%)")
    axes.set_ylabel("fraction of clients at or below")
    axes.set_title(title or "clients' final accuracy", fontsize=9)
    finish_figure(figure, axes, path, missing=missing, integer_x=False)
