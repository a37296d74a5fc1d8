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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    "finish_figure",
    "method_styles",
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
    """One line per run of ``metric`` against the round; saved as PNG. The title names
    the run (one run) and the metric; styles, legend and axes as ``finish_figure``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    if log_scale is None:
        log_scale = "distance" in metric or "loss" in metric
    percent = "accuracy" in metric  # in %, as the tables
    scale = 100.0 if percent else 1.0
    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    styles = method_styles([label for label, _ in runs])
    missing = []
    for label, records in runs:
        points = [(r.round, scale * metric_value(r, metric)) for r in records]
        points = [(x, y) for x, y in points if not math.isnan(y)]
        if points:
            axes.plot(*zip(*points, strict=True), label=label, **styles[label])
        else:
            missing.append(label)
    axes.set_xlabel("round")
    axes.set_ylabel(metric.split(".", 1)[-1] + (" (%)" if percent else ""))
    if log_scale:
        axes.set_yscale("log")
    axes.set_title(title or (f"{runs[0][0]}: {metric}" if len(runs) == 1 else metric), fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    finish_figure(figure, axes, path, missing=missing, percent=percent and not log_scale)


LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "v", "D", "x")


def method_styles(labels: list[str]) -> dict[str, dict[str, Any]]:
    """A distinct look per label, by position: matplotlib's ten default colours solid,
    then the same ten dashed, dotted and dash-dotted (40 labels), then again with a
    marker each further 40. Line plots take them as keyword arguments."""
    styles: dict[str, dict[str, Any]] = {}
    for i, label in enumerate(dict.fromkeys(labels)):
        style: dict[str, Any] = {
            "color": f"C{i % 10}",
            "linestyle": LINE_STYLES[(i // 10) % len(LINE_STYLES)],
        }
        if i >= 10 * len(LINE_STYLES):
            style.update(marker=MARKERS[(i // 40 - 1) % len(MARKERS)], markevery=0.1)
        styles[label] = style
    return styles


def finish_figure(
    figure: Any,
    axes: Any,
    path: Path,
    *,
    missing: Sequence[str] = (),
    percent: bool = False,
    integer_x: bool = True,
    note: str = "",
) -> None:
    """Every figure's finish: a light grid; whole-number ticks on a rounds axis; a %
    axis spanning at least 10 points (a 2-point drift does not fill the figure); the
    legend beside the axes, in columns of at most 20, once there are more than four
    lines (inside them otherwise); ``note`` and a note naming the labels without values
    to draw under the axes;
    saved at 120 dpi with everything in the picture, and closed."""
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    axes.grid(alpha=0.3)
    if integer_x:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    if percent:
        low, high = axes.get_ylim()
        if high - low < 10:
            middle = (low + high) / 2
            low, high = max(0.0, middle - 5), min(100.0, middle + 5)
            axes.set_ylim(low, max(high, low + 10))
    handles, _ = axes.get_legend_handles_labels()
    if len(handles) > 4:
        axes.legend(
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize=7,
            ncol=math.ceil(len(handles) / 20),
            frameon=False,
        )
    elif len(handles) > 1:
        axes.legend(fontsize=8)
    notes = [note] if note else []
    if missing:
        notes.append("not drawn (no value in any round): " + ", ".join(missing))
    if notes:
        axes.annotate(
            "\n".join(notes),
            xy=(0.0, -0.16),
            xycoords="axes fraction",
            fontsize=7,
            va="top",
            wrap=True,
        )
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
