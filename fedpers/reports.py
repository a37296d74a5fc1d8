"""A run directory read back, and its rounds plotted: what experiments and tests use
(``fedpers.results`` writes the directory and holds its readers, which a resumed run
uses too; they are here as well).

The readers take the directory ``fedpers.results.run_directory`` names and return what
the recorder wrote: the round records of ``rounds.jsonl``, the per-client rows of
``clients.jsonl``, ``config.json`` and ``summary.json``. matplotlib is imported only when
a plot is drawn.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from fedpers.results import (
    RoundRecord,
    metric_value,
    read_clients,
    read_config,
    read_rounds,
    read_summary,
)

__all__ = [
    "final_client_metric",
    "plot_rounds",
    "read_clients",
    "read_config",
    "read_rounds",
    "read_summary",
]

logger = logging.getLogger(__name__)


def final_client_metric(directory: Path, metric: str = "accuracy") -> dict[str, float]:
    """Each client's ``metric`` in the last round that evaluated clients."""
    rows = read_clients(directory)
    if not rows:
        return {}
    return {
        partition: float(values[metric])
        for partition, values in rows[-1]["clients"].items()
        if values.get(metric) is not None
    }


def plot_rounds(
    runs: list[tuple[str, list[RoundRecord]]],
    metric: str,
    path: Path,
    *,
    title: str = "",
    log_scale: bool | None = None,
) -> None:
    """One line per run of ``metric`` against the round; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    if log_scale is None:
        log_scale = "distance" in metric or "loss" in metric
    percent = "accuracy" in metric  # in %, as the tables
    scale = 100.0 if percent else 1.0
    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    for label, records in runs:
        points = [(r.round, scale * metric_value(r, metric)) for r in records]
        points = [(x, y) for x, y in points if not math.isnan(y)]
        if points:
            axes.plot(*zip(*points, strict=True), label=label)
    axes.set_xlabel("round")
    axes.set_ylabel(metric.split(".", 1)[-1] + (" (%)" if percent else ""))
    if log_scale:
        axes.set_yscale("log")
    if title:
        axes.set_title(title)
    axes.grid(alpha=0.3)
    if len(runs) > 1:
        axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
