"""What the two Sheaf-FRL scripts share: runs per (setting, seed), seed means, plots."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedpers.results import read_summary
from simulations.common import (
    markdown_table,
    parallelism,
    prepare_output,
    validate_runs,
    write_summary,
)
from simulations.launch import LocalSimulation

METHODS = ("sheaf-frl", "non-cooperative", "non-cooperative-pilots")

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


def run_grid(
    args: argparse.Namespace,
    settings: dict[str, Any],
    values: list[Any],
    overrides: Callable[[Any], dict[str, Any]],
    label: str,
) -> dict[str, Any]:
    """Train Sheaf-FRL and the lambda = 0 baseline for every value and seed.

    Returns the summary ``{"private_accuracy": {METHOD: {V: mean}},
    "communication_accuracy": {...}, "bytes_per_round": {METHOD: v}, "per_seed": ...}``.
    ``non-cooperative`` and ``non-cooperative-pilots`` are the same trained models,
    aligned after training with whitening fitted on training latents (the paper's
    baseline) or on the pilots (as Sheaf-FRL does).
    """
    runs, keys = [], []
    root = args.out.expanduser().resolve() / "runs"
    for value in values:
        for seed in range(args.seeds):
            for algorithm in ("sheaf-frl", "non-cooperative"):
                keys.append((value, seed, algorithm))
                runs.append(
                    {
                        **settings,
                        **overrides(value),
                        "algorithm": algorithm,
                        "seed": seed,
                        "results-dir": str(root),
                        "run-name": f"{algorithm}-{label}{value}-seed{seed}",
                    }
                )
    validate_runs(runs)
    prepare_output(args.out, overwrite=args.overwrite)
    with LocalSimulation() as simulation:
        directories = simulation.run_all(runs, parallel=parallelism(args))
    per_seed: dict[str, dict[str, list[dict[str, float]]]] = {m: {} for m in METHODS}
    bytes_per_round: dict[str, list[float]] = {m: [] for m in METHODS}
    for (value, _, algorithm), directory in zip(keys, directories, strict=True):
        summary = read_summary(directory)
        communication = summary["communication_accuracy"]
        entries = (
            [("sheaf-frl", communication["pilots"])]
            if algorithm == "sheaf-frl"
            else [
                ("non-cooperative", communication["train"]),
                ("non-cooperative-pilots", communication["pilots"]),
            ]
        )
        for method, comm in entries:
            per_seed[method].setdefault(str(value), []).append(
                {"private": summary["private_accuracy"], "communication": comm}
            )
            bytes_per_round[method].append(summary["bytes_per_round"])
    result: dict[str, Any] = {
        "private_accuracy": {
            m: {v: float(np.mean([r["private"] for r in rows])) for v, rows in by.items()}
            for m, by in per_seed.items()
        },
        "communication_accuracy": {
            m: {v: float(np.mean([r["communication"] for r in rows])) for v, rows in by.items()}
            for m, by in per_seed.items()
        },
        "bytes_per_round": {m: float(np.mean(v)) for m, v in bytes_per_round.items()},
        "per_seed": per_seed,
        "seeds": args.seeds,
        "settings": settings,
    }
    write_summary(args.out.expanduser().resolve(), result)
    return result


def report(out: Path, result: dict[str, Any], values: list[Any], label: str, title: str) -> str:
    """Write DIR/table.md and DIR/accuracy.png; return the table."""
    rows = []
    for method in METHODS:
        rows.append(
            (
                method,
                *[100 * result["private_accuracy"][method][str(v)] for v in values],
                *[100 * result["communication_accuracy"][method][str(v)] for v in values],
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
    out = out.expanduser().resolve()
    (out / "table.md").write_text(
        f"# {title}\n\nAccuracies in %, means over {result['seeds']} seed(s).\n\n{table}"
    )
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for axis, metric, name in zip(
        axes,
        ("private_accuracy", "communication_accuracy"),
        ("private", "communication"),
        strict=True,
    ):
        for method in METHODS:
            axis.plot(
                [str(v) for v in values],
                [result[metric][method][str(v)] for v in values],
                marker="o",
                label=method,
            )
        axis.set_xlabel(label)
        axis.set_ylabel(f"average {name} accuracy")
        axis.grid(alpha=0.3)
    axes[0].legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(out / "accuracy.png", dpi=120)
    plt.close(figure)
    return table
