"""Choose a setting on validation data: a grid over one run-config key, through Flower.

    python -m simulations.tune --out DIR --key sheaf-lambda --values 0.01,0.1,0.3,1 \
        --metric communication_accuracy.pilots --run-config conf/sheaf_shift.toml \
        [--seeds 3] [--minimize] [--quick] [--in-process] [--parallel N]

Every (value, seed) is one ``flwr run`` (or, with ``--in-process``, the same run in
process, without the SuperLink and Ray: large federations start in seconds) with
``evaluate-split = "validation"``: every evaluation of the run reports the clients'
validation samples (the per-client protocol's 20%, or 20% of each client's training
samples held out of its training), never their test samples. The score of a value is
the mean over seeds of ``--metric``, a (dotted) key of the run's ``summary.json``
(``final_accuracy``, ``communication_accuracy.pilots``,
``final_principal_angle_distance``, ...); the chosen value has the highest mean (the
lowest with ``--minimize``), ties going to the value listed first.

Writes DIR/summary.json ``{"key", "values", "metric", "split": "validation", "score":
{V: mean}, "score_std", "score_ci95", "score_per_seed", "chosen", "seeds", "settings"}``,
DIR/table.md, DIR/tune.png and the runs under DIR/runs/. Report the chosen value's
test figures from a separate run (the scripts, or ``flwr run`` with the value).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Mapping
from typing import Any

from fedpers.config import schema
from fedpers.reports import read_summary
from fedpers.simulations.flags import add_in_process_flag, output_parser, seeds_of, settings
from fedpers.simulations.runs import run_all
from fedpers.simulations.stats import add_statistics
from fedpers.simulations.tables import interval, markdown_table, write_summary

QUICK = {"num-rounds": 3}


def parse_values(key: str, text: str) -> list[Any]:
    """The grid of ``--values``, typed as the schema declares ``key``.

    Raises
    ------
    SystemExit
        On an unknown key, an empty grid, or a value of the wrong type.
    """
    known = schema()
    if key not in known:
        raise SystemExit(f"error: --key '{key}' is not a run-config key")
    if key in ("seed", "evaluate-split", "results-dir", "run-name"):
        raise SystemExit(f"error: --key '{key}' is not a setting to tune")
    kind = known[key].kind
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise SystemExit("error: --values is empty; give comma-separated values (0.01,0.1)")
    values: list[Any] = []
    for item in items:
        try:
            if kind is bool:
                value: Any = {"true": True, "false": False}[item.lower()]
            elif kind in (int, float):
                value = kind(item)
            else:
                value = item
        except (KeyError, ValueError):
            raise SystemExit(
                f"error: --values item '{item}' is not a {known[key].type_name} "
                f"(run-config key '{key}')"
            ) from None
        if value in values:
            raise SystemExit(f"error: --values lists {item} twice")
        values.append(value)
    return values


def metric_of(summary: Mapping[str, Any], metric: str) -> float:
    """``summary``'s value at the dotted path ``metric`` (NaN if absent)."""
    value: Any = summary
    for part in metric.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return math.nan
        value = value[part]
    return math.nan if value is None else float(value)


def choose(scores: Mapping[str, float], *, minimize: bool) -> str:
    """The value with the best finite mean score; ties to the first listed.

    Raises
    ------
    SystemExit
        If no value has a finite score.
    """
    finite = {v: s for v, s in scores.items() if not math.isnan(s)}
    if not finite:
        raise SystemExit("error: no value of the grid produced the metric; check --metric")
    best = min(finite.values()) if minimize else max(finite.values())
    return next(v for v, s in finite.items() if s == best)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the grid and record the choice; returns the summary."""
    parser = output_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--key", required=True, help="the run-config key to choose")
    parser.add_argument("--values", required=True, help="comma-separated values to try")
    parser.add_argument(
        "--metric",
        default="final_accuracy",
        help="dotted key of each run's summary.json to compare (default: %(default)s)",
    )
    parser.add_argument(
        "--minimize", action="store_true", help="lower is better (distances, losses)"
    )
    add_in_process_flag(parser)
    args = parser.parse_args(argv)
    grid = parse_values(args.key, args.values)
    seeds = seeds_of(args)
    base = settings(args, {}, QUICK)
    base.pop(args.key, None)
    base["evaluate-split"] = "validation"
    keys, runs = _runs(args, grid, seeds, base)
    directories = run_all(args, runs)  # validated, and --out prepared, before any run
    out = args.out.expanduser().resolve()
    per_seed: dict[str, list[float]] = {str(v): [] for v in grid}
    for (value, _), directory in zip(keys, directories, strict=True):
        per_seed[value].append(metric_of(read_summary(directory), args.metric))
    result: dict[str, Any] = {
        "key": args.key,
        "values": grid,
        "metric": args.metric,
        "split": "validation",
        "minimize": args.minimize,
        "seeds": seeds,
    }
    add_statistics(result, "score", per_seed)
    result["chosen"] = grid[
        [str(v) for v in grid].index(choose(result["score"], minimize=args.minimize))
    ]
    result["settings"] = base
    write_summary(out, result)
    table = _table(args, grid, result)
    title = f"{args.key} on validation, {len(seeds)} seed(s)"
    (out / "table.md").write_text(f"# {title}\n\n{table}")
    _plot(out, result, title)
    print(f"\n{title}\n\n{table}\nchosen: {args.key} = {result['chosen']}; results: {out}")
    return result


def _runs(
    args: argparse.Namespace, grid: list[Any], seeds: list[int], base: dict[str, Any]
) -> tuple[list[tuple[str, int]], list[dict[str, Any]]]:
    """A run per value and seed, with its key ``(str(value), seed)``."""
    root = args.out.expanduser().resolve() / "runs"
    keys, runs = [], []
    for index, value in enumerate(grid):
        label = _label(value, index)
        for seed in seeds:
            keys.append((str(value), seed))
            runs.append(
                {
                    **base,
                    args.key: value,
                    "seed": seed,
                    "results-dir": str(root),
                    "run-name": f"{args.key}-{label}-seed{seed}",
                }
            )
    return keys, runs


def _label(value: Any, index: int) -> str:
    """``value`` as a part of a run's name: itself where it is one path segment's
    characters (numbers, names), else those characters with the others as ``_`` and
    its place in the grid (``eta_0.01-v2`` for ``eta=0.01``), so that no two values
    share a directory."""
    text = str(value)
    plain = re.sub(r"[^A-Za-z0-9._+-]", "_", text)
    return text if plain == text else f"{plain}-v{index}"


def _table(args: argparse.Namespace, grid: list[Any], result: Mapping[str, Any]) -> str:
    rows = [
        (
            value,
            result["score"][str(value)],
            result["score_std"][str(value)],
            interval(result["score_ci95"][str(value)], scale=1, digits=4),
            "chosen" if value == result["chosen"] else "",
        )
        for value in grid
    ]
    return markdown_table(
        [args.key, f"{args.metric} (validation)", "std", "95% interval", ""], rows
    )


def _plot(out: Any, result: Mapping[str, Any], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    labels = [str(v) for v in result["values"]]
    means = [result["score"][v] for v in labels]
    spread = [0.0 if math.isnan(s := result["score_std"][v]) else s for v in labels]
    figure, axes = plt.subplots(figsize=(5.6, 3.6))
    axes.errorbar(labels, means, yerr=spread, marker="o", capsize=3)
    axes.set_xlabel(result["key"])
    axes.set_ylabel(f"{result['metric']} (validation)")
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out / "tune.png", dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main(sys.argv[1:])
