"""A run directory read back, and its rounds plotted: what experiments, tests and a
resumed run use (``fedpers.results`` writes the directory).

The readers take the directory ``fedpers.results.run_directory`` names and return what
the recorder wrote: the round records of ``rounds.jsonl``, the per-client rows of
``clients.jsonl``, ``config.json`` and ``summary.json``. matplotlib is imported only when
a plot is drawn.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from fedpers.results import (
    CLIENTS_FILE,
    CONFIG_FILE,
    ROUNDS_FILE,
    SUMMARY_FILE,
    RoundRecord,
    metric_value,
)

logger = logging.getLogger(__name__)


def read_rounds(directory: Path) -> list[RoundRecord]:
    """The round records of a run directory. A last line cut short (the run was killed
    while writing it) is dropped with a warning; any other bad line is an error."""
    lines = [line for line in (directory / ROUNDS_FILE).read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(RoundRecord(**json.loads(line)))
        except (json.JSONDecodeError, TypeError) as error:
            if number < len(lines):
                raise ValueError(
                    f"{directory / ROUNDS_FILE}, line {number}, is not a round record "
                    f"({error}); the file is damaged beyond its last line"
                ) from error
            logger.warning("%s: dropped a half-written last line", directory / ROUNDS_FILE)
    return records


def read_clients(directory: Path) -> list[dict[str, Any]]:
    """The per-client rows of a run (``clients.jsonl``; empty if it has none): one
    ``{"round": r, "clients": {partition: {metric: value}}}`` per evaluated round. A last
    line cut short is dropped, as in ``read_rounds``."""
    path = directory / CLIENTS_FILE
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
            rows.append({"round": int(row["round"]), "clients": dict(row["clients"])})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            if number < len(lines):
                raise ValueError(
                    f"{path}, line {number}, is not a per-client row ({error})"
                ) from error
            logger.warning("%s: dropped a half-written last line", path)
    return rows


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


def read_config(directory: Path) -> dict[str, Any]:
    """The resolved run configuration (``config.json``) of a run directory."""
    return json.loads((directory / CONFIG_FILE).read_text())


def read_summary(directory: Path) -> dict[str, Any]:
    """The ``summary.json`` of a run directory."""
    return json.loads((directory / SUMMARY_FILE).read_text())


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
