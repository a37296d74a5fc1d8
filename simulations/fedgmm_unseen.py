"""FedGMM's Table 4 analogue: clients that never trained adapt their mixture weights.

    python -m simulations.fedgmm_unseen --out DIR [--dataset synthetic|digits] [--seeds 3] [--quick]

80% of the clients train (through Flower, as in ``fedgmm_synthetic``, or on the digits
with the joint-distribution shift); the other 20% never send or receive anything
until the last round. Then each unseen client pools its data, splits it in half,
adapts only its mixture weights on one half with the global components and learners
fixed (FedGMM: over component x learner cells; FedEM: over learners) and is tested on
the other half. FedAvg's global model is tested on the same halves. Seen accuracy is
the mean over the last 10 rounds of the seen clients' test accuracy.

Writes DIR/summary.json ``{"seen_accuracy": {METHOD: mean over seeds}, "unseen_accuracy":
{METHOD: ...}}``, each with ``_std``, ``_ci95`` and ``_per_seed``, the per-client
accuracies of the first seed (``per_client``: seen, ``unseen_per_client``),
DIR/table.md, DIR/unseen_clients.png and the runs under DIR/runs/.
"""

from __future__ import annotations

import sys
from typing import Any

from fedpers.reports import read_summary
from fedpers.simulations.flags import add_key_flags, output_parser, seeds_of, settings
from fedpers.simulations.plots import plot_client_cdf
from fedpers.simulations.runs import run_methods
from fedpers.simulations.tables import method_summary, method_table, seeds_note, write_summary

METHODS = ("fedgmm", "fedem", "fedavg")

SETTINGS: dict[str, dict[str, Any]] = {
    "synthetic": {
        "dataset": "mixture",
        "num-clients": 300,
        "samples-per-client": 300,
        "num-rounds": 100,
        "fraction-train": 0.3,
        "lr": 1.0,  # Table 2's, chosen on validation (simulations/fedgmm_synthetic.py)
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
    # 5 unseen clients; 38 s in process against 58 s for 30 clients x 40 rounds
    "synthetic": {"num-clients": 25, "num-rounds": 30, "fraction-train": 0.5},
    "digits": {"num-clients": 20, "num-rounds": 15},
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train on the seen clients, adapt and test the unseen ones; returns the summary."""
    parser = output_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dataset",
        choices=sorted(SETTINGS),
        default="synthetic",
        help="which experiment (default: %(default)s)",
    )
    add_key_flags(
        parser,
        ["num-clients", "num-rounds", "unseen-fraction"],
        {"unseen-fraction": 0.2},
        aliases={"num-clients": "clients", "num-rounds": "rounds"},
    )
    args = parser.parse_args(argv)
    seeds = seeds_of(args)
    values = settings(
        args,
        {**SETTINGS[args.dataset], "unseen-fraction": 0.2, "adapt-fraction": 0.5},
        QUICK[args.dataset],
    )
    directories = run_methods(args, values, METHODS, seeds)
    out = args.out.expanduser().resolve()
    runs = {key: read_summary(d) for key, d in directories.items()}
    figures = {
        "seen_accuracy": {key: s["final_accuracy"] for key, s in runs.items()},
        "unseen_accuracy": {key: s["unseen_accuracy"] for key, s in runs.items()},
    }
    first = {m: runs[(m, seeds[0])] for m in METHODS}
    clients = {m: s.get("client_accuracy", {}) for m, s in first.items()}
    result = {
        "dataset": args.dataset,
        **method_summary(METHODS, seeds, figures, clients, directories),
        "unseen_per_client": {m: s.get("unseen_client_accuracy", {}) for m, s in first.items()},
        "settings": {**values, "quick": args.quick},
    }
    write_summary(out, result)
    table = method_table(
        result, [("seen_accuracy", "seen clients"), ("unseen_accuracy", "unseen clients")]
    )
    unseen = round(values["unseen-fraction"] * values["num-clients"])
    title = f"unseen clients, {args.dataset}: {values['num-clients']} clients, {unseen} unseen"
    (out / "table.md").write_text(
        f"# {title}\n\n{seeds_note(seeds)} Clients' columns: the seen clients.\n\n{table}"
    )
    plot_client_cdf(result["unseen_per_client"], out / "unseen_clients.png", title=title)
    print(f"\n{title}\n\n{table}\nresults: {out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
