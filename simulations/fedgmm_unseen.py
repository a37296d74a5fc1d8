"""FedGMM's Table 4 analogue: clients that never trained adapt their mixture weights.

    python -m simulations.fedgmm_unseen --out DIR [--dataset synthetic|digits] [--quick]

80% of the clients train (through Flower, as in ``fedgmm_synthetic``, or on the digits
with the joint-distribution shift); the other 20% never send or receive anything
until the last round. Then each unseen client pools its data, splits it in half,
adapts only its mixture weights on one half with the global components and learners
fixed (FedGMM: over component x learner cells; FedEM: over learners) and is tested on
the other half. FedAvg's global model is tested on the same halves. Seen accuracy is
the mean over the last 10 rounds of the seen clients' test accuracy.

Writes DIR/summary.json ``{"seen_accuracy": {METHOD: v}, "unseen_accuracy": {METHOD:
v}}``, DIR/table.md and the runs under DIR/runs/.
"""

from __future__ import annotations

import sys
from typing import Any

from fedpers.results import read_summary
from simulations.common import (
    config_help,
    markdown_table,
    output_parser,
    parallelism,
    prepare_output,
    validate_runs,
    write_summary,
)
from simulations.launch import LocalSimulation

METHODS = ("fedgmm", "fedem", "fedavg")

SETTINGS: dict[str, dict[str, Any]] = {
    "synthetic": {
        "dataset": "mixture",
        "num-clients": 300,
        "samples-per-client": 300,
        "num-rounds": 100,
        "fraction-train": 0.3,
        "lr": 0.5,
        "momentum": 0.0,
        "weight-decay": 0.0,
        "batch-size": 128,
        "epochs": 2,
    },
    "digits": {
        "dataset": "digits",
        "joint-shift": True,
        "num-clients": 50,
        "num-rounds": 100,
        "fraction-train": 0.3,
        "partitioner": "dirichlet",
        "dirichlet-alpha": 0.4,
        "test-split": "per-client",
        "gmm-embedding": "pca",
        "lr": 0.05,
        "momentum": 0.5,
        "batch-size": 10,
        "epochs": 5,
    },
}
QUICK: dict[str, dict[str, Any]] = {
    "synthetic": {"num-clients": 30, "num-rounds": 40, "fraction-train": 0.5},
    "digits": {"num-clients": 20, "num-rounds": 15},
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train on the seen clients, adapt and test the unseen ones; returns the summary."""
    parser = output_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=sorted(SETTINGS), default="synthetic")
    parser.add_argument("--clients", type=int, help=config_help("num-clients", script=True))
    parser.add_argument("--rounds", type=int, help=config_help("num-rounds", script=True))
    parser.add_argument(
        "--unseen-fraction",
        type=float,
        default=0.2,
        help=config_help("unseen-fraction", script=True),
    )
    parser.add_argument("--seed", type=int, default=0, help=config_help("seed", script=True))
    args = parser.parse_args(argv)
    settings = dict(SETTINGS[args.dataset])
    if args.quick:
        settings.update(QUICK[args.dataset])
    if args.clients is not None:
        settings["num-clients"] = args.clients
    if args.rounds is not None:
        settings["num-rounds"] = args.rounds
    settings.update(
        {
            "unseen-fraction": args.unseen_fraction,
            "adapt-fraction": 0.5,
            "seed": args.seed,
            "results-dir": str(args.out.expanduser().resolve() / "runs"),
        }
    )
    runs = [{**settings, "algorithm": m, "run-name": m} for m in METHODS]
    validate_runs(runs)
    out = prepare_output(args.out, overwrite=args.overwrite)
    with LocalSimulation() as simulation:
        directories = dict(
            zip(METHODS, simulation.run_all(runs, parallel=parallelism(args)), strict=True)
        )
    summaries = {m: read_summary(d) for m, d in directories.items()}
    result = {
        "dataset": args.dataset,
        "seen_accuracy": {m: s["final_accuracy"] for m, s in summaries.items()},
        "unseen_accuracy": {m: s["unseen_accuracy"] for m, s in summaries.items()},
        "settings": {**settings, "quick": args.quick},
    }
    write_summary(out, result)
    table = markdown_table(
        ["method", "seen clients (%)", "unseen clients (%)"],
        [
            (m, 100 * result["seen_accuracy"][m], 100 * result["unseen_accuracy"][m])
            for m in METHODS
        ],
    )
    title = f"unseen clients, {args.dataset}: {settings['num-clients']} clients, " + (
        f"{round(args.unseen_fraction * settings['num-clients'])} unseen"
    )
    (out / "table.md").write_text(f"# {title}\n\n{table}")
    print(f"\n{title}\n\n{table}\nresults: {out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
