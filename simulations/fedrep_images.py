"""FedRep's Table 1 analogue: every personalized method on one partition, through Flower.

    python -m simulations.fedrep_images --out DIR [--dataset mnist1d|digits|mnist|femnist|
        cifar10|cifar100] [--clients N] [--classes-per-client S] [--rounds T] [--seed K]
        [--methods fedrep,fedavg,...] [--quick]

Every method runs as its own `flwr run` on the Ray backend, with the same data, model,
partition, local epochs and seed. Accuracy is measured every round on ALL clients
(global shared parts + own personal parts), weighted by test samples; the final
accuracy is the mean of the last 10 rounds, and FedAvg+FT's is measured after 10
head-only epochs on every client. FedAvg and FedAvg+FT differ only after the last
round, so when both are asked for they share one training run (the fedavg-ft run
records the accuracy before and after fine-tuning).

Writes DIR/summary.json ``{"dataset": ..., "final_accuracy": {METHOD: value}, ...}``,
DIR/table.md, DIR/accuracy.png and every run's results under DIR/runs/.
"""

from __future__ import annotations

import sys
from typing import Any

from fedpers import algorithms
from fedpers.algorithms import Family
from fedpers.results import plot_rounds, read_config, read_rounds, read_summary
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


def methods() -> tuple[str, ...]:
    """Every deep personalized algorithm of the table (a new row appears here as is)."""
    return tuple(
        spec.name
        for spec in algorithms.all_specs()
        if spec.family is Family.PERSONALIZED and spec.deep
    )


# Settings of the paper (Section 5 and Appendix A) per data set; MNIST-1D and the
# digits use the calibrated MLP settings (pyproject defaults).
DATASET_SETTINGS: dict[str, dict[str, Any]] = {
    "mnist1d": {},
    "digits": {},
    "mnist": {"lr": 0.01},
    "femnist": {
        "lr": 0.01,
        "partitioner": "lognormal",
        "samples-per-client": 148,
        "num-clients": 150,
        "classes-per-client": 3,
        "num-rounds": 200,
    },
    "cifar10": {"lr": 0.01, "epochs": 1},
    "cifar100": {"lr": 0.01, "classes-per-client": 20},
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison and write its summary; returns the summary."""
    parser = output_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="mnist1d", choices=sorted(DATASET_SETTINGS))
    parser.add_argument("--clients", type=int, help=config_help("num-clients", script=True))
    parser.add_argument(
        "--classes-per-client", type=int, help=config_help("classes-per-client", script=True)
    )
    parser.add_argument("--rounds", type=int, help=config_help("num-rounds", script=True))
    parser.add_argument("--seed", type=int, default=0, help=config_help("seed", script=True))
    parser.add_argument("--data-root", default="", help=config_help("data-root", script=True))
    known = methods()
    parser.add_argument(
        "--methods", default=",".join(known), help=f"comma-separated subset of {known}"
    )
    args = parser.parse_args(argv)
    chosen = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {', '.join(known)}")

    settings: dict[str, Any] = {
        "dataset": args.dataset,
        "seed": args.seed,
        "data-root": args.data_root,
        **DATASET_SETTINGS[args.dataset],
    }
    if args.quick:
        settings.update(
            {"num-clients": 20, "num-rounds": 4, "final-rounds": 2, "fraction-train": 0.2}
        )
    for key, value in (
        ("num-clients", args.clients),
        ("classes-per-client", args.classes_per_client),
        ("num-rounds", args.rounds),
    ):
        if value is not None:
            settings[key] = value
    # FedAvg's numbers come from the FedAvg+FT run when both are wanted.
    to_run = [m for m in chosen if not (m == "fedavg" and "fedavg-ft" in chosen)]
    runs_dir = args.out.expanduser().resolve() / "runs"
    runs = [
        {**settings, "algorithm": m, "results-dir": str(runs_dir), "run-name": m} for m in to_run
    ]
    validate_runs(runs)
    out = prepare_output(args.out, overwrite=args.overwrite)
    with LocalSimulation() as simulation:
        directories = dict(
            zip(to_run, simulation.run_all(runs, parallel=parallelism(args)), strict=True)
        )
    if "fedavg" in chosen and "fedavg" not in directories:
        directories["fedavg"] = directories["fedavg-ft"]

    final: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for method in chosen:
        summary = read_summary(directories[method])
        if method == "fedavg" and summary["algorithm"] == "fedavg-ft":
            final[method] = summary["final_accuracy_before_finetune"]
        else:
            final[method] = summary["final_accuracy"]
        seconds[method] = summary["wall_seconds"]
    config = read_config(directories[chosen[0]])
    result = {
        "dataset": args.dataset,
        "final_accuracy": final,
        "wall_seconds": seconds,
        "clients": config["num-clients"],
        "classes_per_client": config["classes-per-client"],
        "rounds": config["num-rounds"],
        "seed": args.seed,
        "quick": args.quick,
    }
    write_summary(out, result)
    rows = [(m, 100 * final[m], seconds[m]) for m in chosen]
    table = markdown_table(["method", "final accuracy (%)", "wall seconds"], rows)
    title = (
        f"{args.dataset}, {config['num-clients']} clients x {config['classes-per-client']} "
        f"classes, {config['num-rounds']} rounds"
    )
    (out / "table.md").write_text(f"# {title}\n\n{table}")
    curves = [
        (m, read_rounds(directories[m]))
        for m in chosen
        if m != "fedavg-ft" or "fedavg" not in chosen
    ]
    plot_rounds(curves, "evaluate.accuracy", out / "accuracy.png", title=title)
    print(f"\n{title}\n\n{table}\nresults: {out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
