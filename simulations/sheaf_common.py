"""What the two Sheaf-FRL scripts share: runs per (setting, seed), seed means, plots."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedpers.reports import read_summary
from fedpers.simulations.flags import seeds_of
from fedpers.simulations.runs import run_all
from fedpers.simulations.stats import add_statistics, percentile
from fedpers.simulations.tables import (
    interval,
    markdown_table,
    seeds_note,
    with_spread,
    write_summary,
)

TRAINED = ("sheaf-frl", "non-cooperative")  # the algorithms every script trains
METHODS = ("sheaf-frl", "non-cooperative", "non-cooperative-pilots")
PILOTS = "-pilots"  # a baseline's row aligned on the pilots (the plain row: training latents)
# How the paper aligns a baseline for its plain row, where not by whitening on the
# training latents: CoMFed through its own learned maps.
PAPER_ALIGNMENT = {"comfed": "projection"}


def methods(baselines: Sequence[str] = ()) -> tuple[str, ...]:
    """The rows of a figure: Sheaf-FRL, and each baseline aligned after training with
    whitening fitted on training latents (the paper's, or ``PAPER_ALIGNMENT``; the row
    named after the algorithm) and on the pilots (``<algorithm>-pilots``)."""
    return (*METHODS, *(f"{b}{suffix}" for b in baselines for suffix in ("", PILOTS)))


# Local training of the paper's experiment (Section 6): SGD lr 0.05, momentum 0.9,
# weight decay 5e-4, batch 64, gradients clipped at norm 1, K = 64 pilots per step.
TRAINING: dict[str, Any] = {
    "dataset": "digits",
    "fraction-train": 1.0,
    "lr": 0.05,
    "momentum": 0.9,
    "weight-decay": 5e-4,
    "batch-size": 64,
    "sheaf-pilot-batch": 64,
    "sheaf-clip": 1.0,
    "final-rounds": 10,
}


def add_baselines_flag(parser: argparse.ArgumentParser, default: Sequence[str]) -> None:
    """``--baselines``: the other rows of the sheaf family a script trains beside
    Sheaf-FRL and the lambda = 0 baseline."""
    parser.add_argument(
        "--baselines",
        default=",".join(default),
        help="comma-separated algorithms of the sheaf family to train as well, each "
        "aligned after training like the lambda = 0 baseline (default: %(default)s; "
        "empty: none)",
    )


def baselines_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The ``--baselines`` asked for, each checked to be a row of the sheaf family."""
    from fedpers.algorithms import all_specs

    known = [
        spec.name for spec in all_specs() if spec.family == "sheaf" and spec.name not in TRAINED
    ]
    asked = [b.strip() for b in args.baselines.split(",") if b.strip()]
    unknown = [b for b in asked if b not in known]
    if unknown:
        parser.error(
            f"--baselines: {', '.join(unknown)} is not a baseline of the sheaf family; "
            f"choose from: {', '.join(known)}"
        )
    return asked


def run_grid(
    args: argparse.Namespace,
    values: dict[str, Any],
    swept: list[Any],
    overrides: Callable[[Any], dict[str, Any]],
    label: str,
    baselines: Sequence[str] = (),
) -> dict[str, Any]:
    """Train Sheaf-FRL, the lambda = 0 baseline and ``baselines`` (other rows of the
    sheaf family, aligned after training) for every swept value and seed.

    Returns the summary ``{"private_accuracy": {METHOD: {V: mean over seeds}},
    "communication_accuracy": {...}, "bytes_per_round": {METHOD: v}}``, each accuracy
    with ``_std``, ``_ci95`` and ``_per_seed`` of the same nesting, and ``seeds``;
    ``per_client[ALGORITHM][V]`` (each agent's private accuracy, first seed) and
    ``client_p10`` (its 10th percentile over agents).
    ``non-cooperative`` and ``non-cooperative-pilots`` are the same trained models,
    aligned after training with whitening fitted on training latents (the paper's
    baseline) or on the pilots (as Sheaf-FRL does); so are each baseline's two rows.
    ``methods`` lists the rows.
    """
    seeds = seeds_of(args)
    runs, keys = [], []
    root = args.out.expanduser().resolve() / "runs"
    for value in swept:
        for seed in seeds:
            for algorithm in (*TRAINED, *baselines):
                keys.append((value, seed, algorithm))
                runs.append(
                    {
                        **values,
                        **overrides(value),
                        "algorithm": algorithm,
                        "seed": seed,
                        "results-dir": str(root),
                        "run-name": f"{algorithm}-{label}{value}-seed{seed}",
                    }
                )
    directories = run_all(args, runs)  # validated, --out prepared; interruptible, resumable
    result = _grid_summary(keys, directories, seeds, values, baselines)
    write_summary(args.out.expanduser().resolve(), result)
    return result


def _grid_summary(
    keys: list[tuple[Any, int, str]],
    directories: list[Path],
    seeds: list[int],
    values: dict[str, Any],
    baselines: Sequence[str],
) -> dict[str, Any]:
    """The summary of ``run_grid`` from its runs (``keys[i]`` = (value, seed,
    algorithm) of ``directories[i]``)."""
    rows = methods(baselines)
    private: dict[str, dict[str, list[float]]] = {m: {} for m in rows}
    communication: dict[str, dict[str, list[float]]] = {m: {} for m in rows}
    bytes_per_round: dict[str, list[float]] = {m: [] for m in rows}
    agents: dict[str, dict[str, dict[str, float]]] = {a: {} for a in (*TRAINED, *baselines)}
    for (value, seed, algorithm), directory in zip(keys, directories, strict=True):
        summary = read_summary(directory)
        if seed == seeds[0]:
            agents[algorithm][str(value)] = summary.get("agent_private_accuracy", {})
        reached = summary["communication_accuracy"]
        entries = (
            [("sheaf-frl", reached["pilots"])]
            if algorithm == "sheaf-frl"
            else [
                (algorithm, reached[PAPER_ALIGNMENT.get(algorithm, "train")]),
                (algorithm + PILOTS, reached["pilots"]),
            ]
        )
        for method, comm in entries:
            private[method].setdefault(str(value), []).append(summary["private_accuracy"])
            communication[method].setdefault(str(value), []).append(comm)
            bytes_per_round[method].append(summary["bytes_per_round"])
    result: dict[str, Any] = {"seeds": seeds, "methods": list(rows)}
    add_statistics(result, "private_accuracy", private)
    add_statistics(result, "communication_accuracy", communication)
    result["bytes_per_round"] = {m: float(np.mean(v)) for m, v in bytes_per_round.items()}
    # each agent's private accuracy (first seed) and its 10th percentile over agents
    result["per_client"] = agents
    result["client_p10"] = {
        m: {v: percentile(list(by.values()), 10) for v, by in values_.items()}
        for m, values_ in agents.items()
    }
    result["settings"] = values
    return result


def report(out: Path, result: dict[str, Any], values: list[Any], label: str, title: str) -> str:
    """Write DIR/table.md and DIR/accuracy.png; return the table."""
    rows = []
    for method in result["methods"]:
        rows.append(
            (
                method,
                *[_cell(result, "private_accuracy", method, v) for v in values],
                *[_cell(result, "communication_accuracy", method, v) for v in values],
                result["bytes_per_round"][method],
            )
        )
    table = markdown_table(
        [
            "method",
            *[f"private {label}={v}" for v in values],
            *[f"comm {label}={v}" for v in values],
            "bytes/round",
        ],
        rows,
    )
    intervals = markdown_table(
        ["method", *[f"comm {label}={v}: 95% interval" for v in values]],
        [
            (m, *[interval(result["communication_accuracy_ci95"][m][str(v)]) for v in values])
            for m in result["methods"]
        ],
    )
    out = out.expanduser().resolve()
    (out / "table.md").write_text(
        f"# {title}\n\nAccuracies in %. {seeds_note(result['seeds'])}\n\n{table}\n{intervals}"
    )
    _plot(out / "accuracy.png", result, values, label, title)
    return table


def _plot(path: Path, result: dict[str, Any], values: list[Any], label: str, title: str) -> None:
    """Private and communication accuracy against the swept value, mean ± std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from fedpers.reports import method_styles

    styles = method_styles(list(result["methods"]))
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for axis, metric, name in zip(
        axes,
        ("private_accuracy", "communication_accuracy"),
        ("private", "communication"),
        strict=True,
    ):
        for method in result["methods"]:
            means = np.array([100 * result[metric][method][str(v)] for v in values])
            spread = np.nan_to_num(
                np.array([100 * result[f"{metric}_std"][method][str(v)] for v in values])
            )
            style = {"marker": "o", **styles[method]}
            (line,) = axis.plot([str(v) for v in values], means, label=method, **style)
            axis.fill_between(
                [str(v) for v in values],
                means - spread,
                means + spread,
                color=line.get_color(),
                alpha=0.2,
            )
        axis.set_xlabel(label)
        axis.set_ylabel(f"average {name} accuracy (%)")
        axis.grid(alpha=0.3)
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def _cell(result: dict[str, Any], metric: str, method: str, value: Any) -> str:
    return with_spread(
        result[metric][method][str(value)], result[f"{metric}_std"][method][str(value)]
    )
