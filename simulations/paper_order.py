"""A table's order against a paper's: Kendall's tau and every pair that flips.

    python -m simulations.paper_order SUMMARY [--paper fedrep-cifar10|fedrep-femnist]
        [--out FILE.md]

Reads a ``summary.json`` of ``simulations.fedrep_images`` (``final_accuracy`` and
``per_seed``) and compares the rows it shares with a column of the FedRep paper's
Table 1 (Collins et al., 2021; the figures of ``shared/reference/fedrep.md``: FEMNIST
as published, CIFAR-10 (100, 2) as commonly quoted, for order rather than digits).
Prints, and with ``--out`` writes, the two rankings side by side, Kendall's tau-b over
the common rows (scipy) with its two-sided p-value, and every pair the table orders
the other way from the paper: the paper's gap, fedpers' gap and fedpers' 95% interval
of the gap paired by seed (Student's t; none with one seed), marked "within noise"
where that interval holds 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedpers.simulations.stats import seed_statistics
from fedpers.simulations.tables import markdown_table

# The FedRep paper's Table 1, average local test accuracy (%), keyed by fedpers' rows.
PAPER_COLUMNS: dict[str, dict[str, float]] = {
    # CIFAR-10, 100 clients x 2 classes, as commonly quoted (approximate).
    "fedrep-cifar10": {
        "local": 89.79, "fedrep": 87.70, "fedavg-ft": 87.65, "fedper": 87.13,
        "scaffold-ft": 86.35, "fedprox-ft": 85.81, "ditto": 85.39, "lg-fedavg": 84.14,
        "apfl": 83.77, "per-fedavg": 82.27, "l2gd": 81.04, "fed-mtl": 80.46,
        "fedavg": 42.65, "fedprox": 39.92, "scaffold": 37.72,
    },
    # FEMNIST, 150 clients x 3 letters (published).
    "fedrep-femnist": {
        "fedrep": 78.56, "fedper": 76.91, "fedavg-ft": 72.41, "per-fedavg": 71.51,
        "apfl": 70.74, "ditto": 68.28, "l2gd": 66.18, "lg-fedavg": 62.08, "local": 60.86,
        "fed-mtl": 54.11, "fedprox-ft": 53.54, "scaffold-ft": 52.11, "fedavg": 51.64,
        "fedprox": 18.89, "scaffold": 17.65,
    },
}  # fmt: skip


def compare(
    paper: Mapping[str, float],
    ours: Mapping[str, float],
    per_seed: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, Any]:
    """The common rows' order in both, Kendall's tau-b and the flipped pairs.

    Parameters
    ----------
    paper, ours : mapping of row -> accuracy
        The paper's column (%) and the table's figures (fractions or %, any scale:
        only the order and fedpers' own gaps are used).
    per_seed : mapping of row -> per-seed figures, optional
        For the paired interval of each flipped pair (the same seeds in every row).

    Raises
    ------
    ValueError
        If fewer than two rows are common.
    """
    from scipy import stats

    rows = [r for r in paper if r in ours]
    if len(rows) < 2:
        raise ValueError(
            f"only {rows} of the table's rows {sorted(ours)} are in the paper's column "
            f"{sorted(paper)}: at least two are needed for an order"
        )
    tau = stats.kendalltau([paper[r] for r in rows], [ours[r] for r in rows])
    flips = []
    for a, b in itertools.combinations(rows, 2):
        if _sign(paper[a] - paper[b]) * _sign(ours[a] - ours[b]) >= 0:
            continue  # (signs, not the product of the gaps: that can underflow to 0)
        high, low = (a, b) if paper[a] > paper[b] else (b, a)  # the paper's order
        flip: dict[str, Any] = {
            "paper_above": high,
            "paper_below": low,
            "paper_gap": paper[high] - paper[low],
            "our_gap": ours[high] - ours[low],
            "our_ci95": None,
        }
        if per_seed is not None and high in per_seed and low in per_seed:
            differences = [x - y for x, y in zip(per_seed[high], per_seed[low], strict=True)]
            _, _, bounds = seed_statistics(differences)
            flip["our_ci95"] = None if math.isnan(bounds[0]) else bounds
        flips.append(flip)
    return {
        "rows": rows,
        "paper_order": sorted(rows, key=lambda r: -paper[r]),
        "our_order": sorted(rows, key=lambda r: -ours[r]),
        "kendall_tau": float(tau.statistic),
        "p_value": float(tau.pvalue),
        "flips": flips,
    }


def _sign(value: float) -> int:
    return (value > 0) - (value < 0)


def report(result: Mapping[str, Any], paper: Mapping[str, float], ours: Mapping[str, float]) -> str:
    """The comparison as markdown (fedpers' figures as percentages)."""
    rows = [
        [i + 1, p, f"{paper[p]:.2f}", o, f"{100 * ours[o]:.2f}"]
        for i, (p, o) in enumerate(zip(result["paper_order"], result["our_order"], strict=True))
    ]
    text = markdown_table(["rank", "paper", "paper (%)", "fedpers", "fedpers (%)"], rows)
    text += (
        f"\nKendall's tau-b over {len(result['rows'])} rows: {result['kendall_tau']:.3f} "
        f"(two-sided p = {result['p_value']:.2g}); {len(result['flips'])} pair(s) flip.\n"
    )
    if result["flips"]:
        flips = []
        for f in result["flips"]:
            bounds = f["our_ci95"]
            paired = (
                "n/a" if bounds is None else f"[{100 * bounds[0]:+.2f}, {100 * bounds[1]:+.2f}]"
            )
            noise = bounds is not None and bounds[0] <= 0 <= bounds[1]
            flips.append(
                [
                    f"{f['paper_above']} > {f['paper_below']}",
                    f"{f['paper_gap']:+.2f}",
                    f"{100 * f['our_gap']:+.2f}",
                    paired + (" (within noise)" if noise else ""),
                ]
            )
        header = ["paper's order", "paper's gap", "fedpers' gap", "fedpers' paired 95% interval"]
        text += "\n" + markdown_table(header, flips)
    return text


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Compare a summary with a paper's column; print (and write) the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summary", type=Path, help="summary.json of simulations.fedrep_images")
    parser.add_argument("--paper", default="fedrep-cifar10", choices=sorted(PAPER_COLUMNS))
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    try:
        summary = json.loads(args.summary.read_text())
        ours, per_seed = summary["final_accuracy"], summary.get("per_seed")
    except (OSError, ValueError, KeyError, TypeError) as error:
        parser.error(
            f"{args.summary} is not a summary.json of simulations.fedrep_images "
            f"({type(error).__name__}: {error})"
        )
    paper = PAPER_COLUMNS[args.paper]
    try:
        result = compare(paper, ours, per_seed)
    except ValueError as error:
        parser.error(str(error))
    text = f"# {args.summary}: order against {args.paper}\n\n" + report(result, paper, ours)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
