"""The tables and the ``summary.json`` of a script: a methods x seeds summary, its
markdown table, cells with their spread over seeds, and what the spread is over."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedpers.results import write_json
from fedpers.simulations.stats import add_statistics, known_mean, percentile, population_std

SUMMARY = "summary.json"


def with_spread(mean: float, std: float, scale: float = 100.0, digits: int = 2) -> str:
    """``84.72 ± 0.31`` (``scale`` times the values; the mean alone for one seed)."""
    if mean is None or math.isnan(mean):
        return "n/a"
    if std is None or math.isnan(std):
        return f"{scale * mean:.{digits}f}"
    return f"{scale * mean:.{digits}f} ± {scale * std:.{digits}f}"


def interval(bounds: Sequence[float] | None, scale: float = 100.0, digits: int = 2) -> str:
    """``[84.1, 85.3]``, or ``n/a`` without one (a single seed)."""
    if not bounds or bounds[0] is None or math.isnan(bounds[0]):
        return "n/a"
    return f"[{scale * bounds[0]:.{digits}f}, {scale * bounds[1]:.{digits}f}]"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table; floats with 4 significant digits."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "n/a" if math.isnan(value) else f"{value:.4g}"
        return "n/a" if value is None else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_summary(out: Path, summary: Mapping[str, Any]) -> Path:
    """Write ``out/summary.json`` atomically."""
    path = out / SUMMARY
    write_json(path, summary)
    return path


def method_summary(
    methods: Sequence[str],
    seeds: Sequence[int],
    figures: Mapping[str, Mapping[tuple[str, int], float]],
    clients: Mapping[str, Mapping[str, float]],
    directories: Mapping[tuple[str, int], Path],
) -> dict[str, Any]:
    """The summary of a methods x seeds table.

    ``figures[NAME][(method, seed)]`` are the per-seed figures (the first is the
    table's main one: ``final_accuracy``); each becomes ``NAME`` (mean over seeds) with
    ``NAME_std``, ``NAME_ci95`` and ``NAME_per_seed`` (``final_accuracy``'s per-seed
    lists are ``per_seed``). ``clients[method]`` are the first seed's final per-client
    accuracies: ``per_client``, ``client_p10`` and ``client_std`` (over clients).
    Communication (``megabytes_total``: training messages sent and received, all rounds;
    evaluation messages are not counted), ``wall_seconds`` (the ServerApp's whole run),
    ``startup_seconds`` (its start-up: nodes, their data, the initial model) and
    ``rounds_seconds`` (the rest) are seed means from the runs' summaries.
    """
    from fedpers.reports import read_summary

    summary: dict[str, Any] = {"seeds": list(seeds), "methods": list(methods)}
    for name, values in figures.items():
        add_statistics(
            summary,
            name,
            {m: [values.get((m, s)) for s in seeds] for m in methods},
            per_seed_key="per_seed" if name == "final_accuracy" else None,
        )
    summary["per_client"] = {m: clients.get(m, {}) for m in methods}
    summary["client_p10"] = {m: percentile(list(clients.get(m, {}).values()), 10) for m in methods}
    summary["client_std"] = {m: population_std(list(clients.get(m, {}).values())) for m in methods}
    runs = {key: read_summary(directory) for key, directory in directories.items()}
    summary["megabytes_total"] = {
        m: known_mean([runs[(m, s)].get("megabytes_total") for s in seeds]) for m in methods
    }
    for key in ("wall_seconds", "startup_seconds"):
        summary[key] = {m: known_mean([runs[(m, s)].get(key) for s in seeds]) for m in methods}
    summary["rounds_seconds"] = {
        m: known_mean(
            [
                _difference(runs[(m, s)].get("wall_seconds"), runs[(m, s)].get("startup_seconds"))
                for s in seeds
            ]
        )
        for m in methods
    }
    return summary


def _difference(whole: Any, part: Any) -> float | None:
    """``whole - part``, None where either is missing (a run from before the split)."""
    return None if whole is None or part is None else float(whole) - float(part)


def method_table(summary: Mapping[str, Any], figures: Sequence[tuple[str, str]]) -> str:
    """A markdown table of ``method_summary``: per method, each figure (``(name,
    label)``, in %) as mean ± std with its 95% interval, then the clients' 10th
    percentile and spread (first seed), megabytes sent and received, the rounds' wall
    seconds and the start-up's apart."""
    header = ["method"]
    for _, label in figures:
        header += [f"{label} (%)", "95% interval"]
    header += ["clients p10 (%)", "clients std (%)", "MB trained", "rounds s", "start-up s"]
    rows = []
    for m in summary["methods"]:
        row: list[Any] = [m]
        for name, _ in figures:
            row += [
                with_spread(summary[name][m], summary[f"{name}_std"][m]),
                interval(summary[f"{name}_ci95"][m]),
            ]
        row += [
            _percent(summary["client_p10"][m]),
            _percent(summary["client_std"][m]),
            summary["megabytes_total"][m],
            summary.get("rounds_seconds", summary["wall_seconds"])[m],
            summary.get("startup_seconds", {}).get(m),
        ]
        rows.append(row)
    return markdown_table(header, rows)


def seeds_note(seeds: Sequence[int]) -> str:
    """What a table's spread is over."""
    if len(seeds) == 1:
        return f"One seed ({seeds[0]}): no spread over seeds; pass --seeds 3 for one."
    return (
        f"Mean ± sample std over seeds {', '.join(map(str, seeds))}; 95% interval of the mean "
        f"by Student's t ({len(seeds) - 1} degrees of freedom). Clients' 10th percentile and "
        f"std: final per-client accuracies of seed {seeds[0]}."
    )


def _percent(value: float) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{100 * value:.2f}"
