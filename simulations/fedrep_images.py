"""FedRep's Table 1 analogue: every personalized and mixture method on one partition.

    python -m simulations.fedrep_images --out DIR [--dataset mnist1d|digits|mnist|femnist|
        fashion-mnist|cifar10|cifar100] [--num-clients N] [--classes-per-client S]
        [--num-rounds T] [--seeds 0,1,2] [--methods fedrep,fedavg,...]
        [--run-config "key=value ..."] [--quick]

Every method runs as its own `flwr run` on the Ray backend, with the same data, model,
partition, local epochs and seed. Accuracy is measured every round on ALL clients
(global shared parts + own personal parts), weighted by test samples; the final
accuracy is the mean of the last 10 rounds, and FedAvg+FT's is measured after 10
head-only epochs on every client. Local trains every client in every round, as the
paper's Local does (``local-all-clients``; the other rows train the round's sample).
FedAvg and FedAvg+FT differ only after the last round, so when both are asked for they
share one training run (the fedavg-ft run records the accuracy before and after
fine-tuning); so do FedProx and SCAFFOLD with their +FT rows.

Every method runs once per seed. Writes DIR/summary.json (``final_accuracy[METHOD]``,
the mean over seeds, with ``final_accuracy_std``, ``final_accuracy_ci95``, ``per_seed``,
``seeds``; ``per_client``, ``client_p10``, ``client_std`` of the first seed;
``megabytes_total``), DIR/table.md, DIR/accuracy.png (mean ± std over seeds),
DIR/clients.png (per-client CDF) and every run's results under DIR/runs/METHOD-seedK/.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from fedpers import algorithms
from fedpers.algorithms import Family
from fedpers.reports import read_config, read_rounds, read_summary
from fedpers.simulations.flags import add_key_flags, output_parser, seeds_of, settings
from fedpers.simulations.plots import plot_client_cdf, plot_seeded
from fedpers.simulations.runs import run_methods
from fedpers.simulations.tables import method_summary, method_table, seeds_note, write_summary


def methods() -> tuple[str, ...]:
    """Every deep algorithm of the personalized and mixture families (a new row appears
    here as is): the mixtures' learners are the table's network."""
    return tuple(
        spec.name
        for spec in algorithms.all_specs()
        if spec.family in (Family.PERSONALIZED, Family.MIXTURE) and spec.deep
    )


# Rows that need a model with BatchNorm layers (FedBN keeps them on the device): left out
# of the default methods, whose table's models have none.
NEEDS_BATCH_NORM = ("fedbn",)
# The paper's Local is every client trained alone, in every round (the authors'
# main_local.py), not only when sampled (issue 42): every data set's table runs that.
PROTOCOL: dict[str, Any] = {"local-all-clients": True}
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
    # Real images that can be had here, run as the paper's CIFAR-10 (100, 2) column: 600
    # images a client, 10 head + 1 body epochs for FedRep, 1 epoch for the others.
    "fashion-mnist": {"lr": 0.01, "epochs": 1},
    "cifar100": {"lr": 0.01, "classes-per-client": 20},
}
# A method's own settings for this table where its defaults serve another, chosen on
# MNIST-1D's validation split (docs/reproducing.md): IFCA's k models are the mixture
# family's `mixture-learners` (FedEM's and FedGMM's stay at their default); Clustered
# FL's split thresholds default to Table 2's, which never split here. --run-config wins.
METHOD_SETTINGS: dict[str, dict[str, Any]] = {
    "ifca": {"mixture-learners": 45},
    "clustered-fl": {"clustered-fl-eps1": 0.7, "clustered-fl-eps2": 2.0},
}
# A method and its +FT row train alike and differ after the last round: when both are
# asked for, they share the +FT run, which records the accuracy before fine-tuning too.
FINETUNED = {"fedavg": "fedavg-ft", "fedprox": "fedprox-ft", "scaffold": "scaffold-ft"}
QUICK = {"num-clients": 20, "num-rounds": 4, "final-rounds": 2, "fraction-train": 0.2}
# The data sets whose whole split is partitioned: --quick keeps the paper's client size
# (20 clients would hold 3,000 Fashion-MNIST images each) and trains 5 of the 100.
QUICK_DATASET: dict[str, dict[str, Any]] = {
    "fashion-mnist": {"num-clients": 100, "fraction-train": 0.05, "num-rounds": 3}
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison and write its summary; returns the summary."""
    parser = output_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dataset",
        default="mnist1d",
        choices=sorted(DATASET_SETTINGS),
        help="run-config key 'dataset', with the paper's settings for it (default: %(default)s)",
    )
    add_key_flags(
        parser,
        ["num-clients", "classes-per-client", "num-rounds", "data-root"],
        aliases={"num-clients": "clients", "num-rounds": "rounds"},
    )
    known = methods()
    usual = [m for m in known if m not in NEEDS_BATCH_NORM]
    parser.add_argument(
        "--methods",
        default=",".join(usual),
        help=f"comma-separated subset of {known} (default: all but {', '.join(NEEDS_BATCH_NORM)}, "
        "which needs a model with BatchNorm layers: --run-config \"model='mnist1d-mlp-bn'\")",
    )
    args = parser.parse_args(argv)
    chosen = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {', '.join(known)}")
    seeds = seeds_of(args)
    values = settings(
        args,
        {"dataset": args.dataset, **PROTOCOL, **DATASET_SETTINGS[args.dataset]},
        {**QUICK, **QUICK_DATASET.get(args.dataset, {})},
    )
    # FedAvg's numbers come from the FedAvg+FT run when both are wanted (FedProx's too).
    directories = run_methods(
        args, values, chosen, seeds, shared=FINETUNED, method_values=METHOD_SETTINGS
    )
    out = args.out.expanduser().resolve()

    final, clients = _accuracies(directories, chosen, seeds)
    config = read_config(directories[(chosen[0], seeds[0])])
    result = {
        "dataset": config["dataset"],
        **method_summary(chosen, seeds, {"final_accuracy": final}, clients, directories),
        "clients": config["num-clients"],
        "classes_per_client": config["classes-per-client"],
        "rounds": config["num-rounds"],
        "quick": args.quick,
    }
    write_summary(out, result)
    table = method_table(result, [("final_accuracy", "final accuracy")])
    title = (
        f"{config['dataset']}, {config['num-clients']} clients x "
        f"{config['classes-per-client']} classes, {config['num-rounds']} rounds"
    )
    (out / "table.md").write_text(f"# {title}\n\n{seeds_note(seeds)}\n\n{table}")
    _plot(out, title, chosen, seeds, directories, result["per_client"])
    print(f"\n{title}\n\n{table}\nresults: {out}")
    return result


def _plot(
    out: Path,
    title: str,
    chosen: list[str],
    seeds: list[int],
    directories: dict[tuple[str, int], Path],
    per_client: dict[str, dict[str, float]],
) -> None:
    """The accuracy curves (the +FT rows noted: their rounds are their base row's) and
    the clients' final accuracies."""
    shared = [m for m in chosen if any(m == ft and b in chosen for b, ft in FINETUNED.items())]
    curves = {m: [read_rounds(directories[(m, s)]) for s in seeds] for m in chosen}
    curves = {m: runs for m, runs in curves.items() if m not in shared}
    note = (
        f"{', '.join(shared)}: the curve of the row without +FT (fine-tuned at the end only)"
        if shared
        else ""
    )
    plot_seeded(
        curves, "evaluate.accuracy", out / "accuracy.png", title=title, note=note, order=chosen
    )
    plot_client_cdf(per_client, out / "clients.png", title=title)


def _accuracies(
    directories: dict[tuple[str, int], Path], chosen: list[str], seeds: list[int]
) -> tuple[dict[tuple[str, int], float], dict[str, dict[str, float]]]:
    """Each run's final accuracy, and each method's per-client accuracies (first seed);
    FedAvg's are those of the FedAvg+FT run before fine-tuning when the two share it, and
    FedProx's and SCAFFOLD's those of their +FT runs."""
    final: dict[tuple[str, int], float] = {}
    for (method, seed), directory in directories.items():
        summary = read_summary(directory)
        before = summary["algorithm"] == FINETUNED.get(method)
        final[(method, seed)] = summary[
            "final_accuracy_before_finetune" if before else "final_accuracy"
        ]
    clients = {}
    for method in chosen:
        summary = read_summary(directories[(method, seeds[0])])
        before = summary["algorithm"] == FINETUNED.get(method)
        clients[method] = summary.get(
            "client_accuracy_before_finetune" if before else "client_accuracy", {}
        )
    return final, clients


if __name__ == "__main__":
    main(sys.argv[1:])
