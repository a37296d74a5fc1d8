"""FedRep's linear experiments (Figures 3 and 4 of Collins et al., 2021), through Flower.

    python -m simulations.fedrep_linear --out DIR [--quick] [--seeds 3] [--clients 10,100,1000] ...

Figure 3: d=10, k=2, m=5 fresh samples per client and round, r=0.1, T=200, for
n in {10, 100, 1000}: FedRep (exact least-squares heads), GD-GD and 10GD-GD (1 or 10
gradient steps on the head instead) and FedSGD (one global model), all from the same
Method-of-Moments start. Reported: the principal angle distance of the global
representation to the ground truth after the last round, and the first round at
which it is below 0.01.

Figure 4: FedRep and FedSGD trained on n=100 clients with d=20, k=2; then new clients
with m_new labelled samples fit only a head on the learned representation, against
Local Only (least squares in all d dimensions). Reported: test MSE on fresh samples,
averaged over the new clients.

Every setting is a flag. Writes DIR/summary.json:
``{"principal_angle_distance": {METHOD: {N: final}}, "rounds_to_0.01": {METHOD: {N: round}},
"new_client_mse": {METHOD: {M_NEW: mse}}}``, means over ``--seeds`` (a seed whose run never
got below 0.01 is left out of that mean), each with ``_std``, ``_ci95`` and ``_per_seed``;
DIR/figure3_nN.png and DIR/figure4.png (first seed), DIR/table.md, and every run's
results under DIR/runs/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fedpers import linear
from fedpers.data.synthetic import LinearTasks
from fedpers.reports import plot_rounds, read_rounds, read_summary
from fedpers.seeding import rng
from fedpers.simulations.flags import (
    add_key_flags,
    output_parser,
    seeds_of,
    settings,
)
from fedpers.simulations.runs import run_all
from fedpers.simulations.stats import add_statistics
from fedpers.simulations.tables import markdown_table, write_summary

# method -> (algorithm, head gradient steps; 0 = exact least squares)
FIGURE3_METHODS: dict[str, tuple[str, int]] = {
    "fedrep": ("fedrep", 0),
    "gd-gd": ("fedrep", 1),
    "10gd-gd": ("fedrep", 10),
    "fedsgd": ("fedsgd", 0),
}
# Step sizes with client gradients averaged over samples and clients (calibrated with a
# plain loop, as in shared/reference/fedrep.md: larger steps diverge for FedSGD at n=10).
STEP_SIZES = {"fedrep": 0.4, "gd-gd": 0.4, "10gd-gd": 0.2, "fedsgd": 0.1}
HEAD_STEP_SIZE = {"gd-gd": 0.4, "10gd-gd": 0.2}
# Figure 3's settings (module docstring); key -> older flag name
SETTINGS: dict[str, Any] = {
    "dataset": "linear",
    "linear-dim": 10,
    "linear-rank": 2,
    "linear-samples": 5,
    "fraction-train": 0.1,
    "num-rounds": 200,
    "linear-noise-std": 0.0316,
}
QUICK = {"num-rounds": 60}
FLAGS = {
    "linear-dim": "dim",
    "linear-rank": "rank",
    "linear-samples": "samples",
    "fraction-train": "fraction",
    "num-rounds": "rounds",
    "linear-noise-std": "noise-std",
}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _step_sizes(text: str) -> dict[str, float]:
    sizes = dict(STEP_SIZES)
    for item in filter(None, (p.strip() for p in text.split(","))):
        method, _, value = item.partition("=")
        if method not in STEP_SIZES:
            raise SystemExit(f"error: --step-sizes names unknown method '{method}'")
        sizes[method] = float(value)
    return sizes


Key = tuple[str, int | None, int]  # (method, n of Figure 3 or None for Figure 4, seed)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run Figures 3 and 4 and write their summary; returns the summary."""
    args = _parser().parse_args(argv)
    if args.quick:
        args.clients, args.new_rounds = [10, 100], 60
        args.m_new = [4, 10, 40]
        args.new_clients = 20
    seeds = seeds_of(args)
    values = settings(args, SETTINGS, QUICK)
    keys, runs = _runs(args, seeds, values)
    directories = run_all(args, runs)  # validated, --out prepared; interruptible, resumable
    out = args.out.expanduser().resolve()
    figure3: dict[int, dict[str, dict[int, Path]]] = {
        s: {m: {} for m in FIGURE3_METHODS} for s in seeds
    }
    figure4: dict[int, dict[str, Path]] = {s: {} for s in seeds}
    for (method, n, seed), directory in zip(keys, directories, strict=True):
        if n is None:
            figure4[seed][method] = directory
        else:
            figure3[seed][method][n] = directory

    summary = _summary(args, seeds, values, figure3, figure4)
    write_summary(out, summary)
    new_client_mse = summary["new_client_mse"]
    _figures(out, figure3[seeds[0]], args.clients, new_client_mse)
    table, table4 = _tables(out, args, seeds, summary)
    print(f"\nFigure 3\n{table}\nFigure 4 (new-client test MSE)\n{table4}\nresults: {out}")
    return summary


def _parser() -> argparse.ArgumentParser:
    parser = output_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=_ints, default=[10, 100, 1000], help="values of n")
    add_key_flags(
        parser,
        list(FLAGS),
        SETTINGS,
        aliases={k: v for k, v in FLAGS.items() if v},
    )
    parser.add_argument(
        "--step-sizes",
        type=_step_sizes,
        default=dict(STEP_SIZES),
        help="e.g. fedrep=0.4,fedsgd=0.1",
    )
    parser.add_argument("--new-dim", type=int, default=20, help="d of Figure 4")
    parser.add_argument("--new-train-clients", type=int, default=100, help="n of Figure 4")
    parser.add_argument("--new-samples", type=int, default=10, help="m of Figure 4 training")
    parser.add_argument("--new-rounds", type=int, default=200, help="T of Figure 4 training")
    parser.add_argument(
        "--m-new",
        type=_ints,
        default=[2, 4, 6, 8, 10, 20, 40],
        help="labelled samples of a new client",
    )
    parser.add_argument("--new-clients", type=int, default=50, help="new clients averaged over")
    return parser


def _runs(
    args: argparse.Namespace, seeds: list[int], values: dict[str, Any]
) -> tuple[list[Key], list[dict[str, Any]]]:
    """Every run of both figures, with its key."""
    common = {
        k: v for k, v in values.items() if k not in ("linear-dim", "linear-samples", "num-rounds")
    }
    common["results-dir"] = str(args.out.expanduser().resolve() / "runs")
    keys: list[Key] = []
    runs: list[dict[str, Any]] = []
    for seed in seeds:
        for n in args.clients:
            for method, (algorithm, head_steps) in FIGURE3_METHODS.items():
                keys.append((method, n, seed))
                runs.append(
                    {
                        **common,
                        "seed": seed,
                        "algorithm": algorithm,
                        "num-clients": n,
                        "num-rounds": values["num-rounds"],
                        "linear-dim": values["linear-dim"],
                        "linear-samples": values["linear-samples"],
                        "linear-lr": args.step_sizes[method],
                        "linear-head-steps": head_steps,
                        "linear-head-lr": HEAD_STEP_SIZE.get(method, 0.4),
                        "run-name": f"figure3-{method}-n{n}-seed{seed}",
                    }
                )
        for method in ("fedrep", "fedsgd"):
            keys.append((method, None, seed))
            runs.append(
                {
                    **common,
                    "seed": seed,
                    "algorithm": method,
                    "num-clients": args.new_train_clients,
                    "num-rounds": args.new_rounds,
                    "linear-dim": args.new_dim,
                    "linear-samples": args.new_samples,
                    "linear-lr": args.step_sizes[method],
                    "run-name": f"figure4-{method}-seed{seed}",
                }
            )
    return keys, runs


def _summary(
    args: argparse.Namespace,
    seeds: list[int],
    values: dict[str, Any],
    figure3: dict[int, dict[str, dict[int, Path]]],
    figure4: dict[int, dict[str, Path]],
) -> dict[str, Any]:
    """The figures' numbers over seeds, from the run directories."""
    distance = {
        m: {
            str(n): [
                read_summary(figure3[s][m][n])["final_principal_angle_distance"] for s in seeds
            ]
            for n in args.clients
        }
        for m in FIGURE3_METHODS
    }
    first_below = {
        m: {
            str(n): [read_summary(figure3[s][m][n])["first_round_below_0.01"] for s in seeds]
            for n in args.clients
        }
        for m in FIGURE3_METHODS
    }
    per_seed_mse: dict[str, dict[str, list[float]]] = {}
    for seed in seeds:
        tasks = LinearTasks(args.new_dim, values["linear-rank"], values["linear-noise-std"], seed)
        representations = {
            m: np.load(d / "final_arrays.npz")["body.weight"].T for m, d in figure4[seed].items()
        }
        mse = new_client_errors(
            tasks,
            representations,
            first_new_client=args.new_train_clients,
            count=args.new_clients,
            m_new_values=args.m_new,
            seed=seed,
        )
        for method, by_m in mse.items():
            for m_new, value in by_m.items():
                per_seed_mse.setdefault(method, {}).setdefault(m_new, []).append(value)
    summary: dict[str, Any] = {"seeds": seeds}
    add_statistics(summary, "principal_angle_distance", distance)
    add_statistics(summary, "rounds_to_0.01", first_below)
    add_statistics(summary, "new_client_mse", per_seed_mse)
    add_statistics(
        summary,
        "figure4_training_distance",
        {
            m: [read_summary(figure4[s][m])["final_principal_angle_distance"] for s in seeds]
            for m in ("fedrep", "fedsgd")
        },
    )
    summary["settings"] = {**values, "clients": args.clients, "m_new": args.m_new}
    return summary


def _tables(
    out: Path, args: argparse.Namespace, seeds: list[int], summary: dict[str, Any]
) -> tuple[str, str]:
    """Write DIR/table.md; return the tables of Figure 3 and Figure 4."""
    new_client_mse = summary["new_client_mse"]
    distance_mean, below_mean = summary["principal_angle_distance"], summary["rounds_to_0.01"]
    table = markdown_table(
        [
            "method",
            *[f"dist n={n}" for n in args.clients],
            *[f"round<0.01 n={n}" for n in args.clients],
        ],
        [
            (
                m,
                *[distance_mean[m][str(n)] for n in args.clients],
                *[below_mean[m][str(n)] for n in args.clients],
            )
            for m in FIGURE3_METHODS
        ],
    )
    table4 = markdown_table(
        ["m_new", *new_client_mse],
        [(m_new, *[new_client_mse[m][str(m_new)] for m in new_client_mse]) for m_new in args.m_new],
    )
    spread = markdown_table(
        ["method", *[f"dist n={n}: std over seeds" for n in args.clients]],
        [
            (m, *[summary["principal_angle_distance_std"][m][str(n)] for n in args.clients])
            for m in FIGURE3_METHODS
        ],
    )
    (out / "table.md").write_text(
        f"Means over seeds {', '.join(map(str, seeds))} (summary.json: std, 95% intervals, "
        f"per seed).\n\n# Figure 3\n\n{table}\n{spread}\n# Figure 4 (test MSE)\n\n{table4}"
    )
    return table, table4


def new_client_errors(
    tasks: LinearTasks,
    representations: dict[str, np.ndarray],
    *,
    first_new_client: int,
    count: int,
    m_new_values: list[int],
    seed: int,
    test_samples: int = 1000,
) -> dict[str, dict[str, float]]:
    """Mean test MSE of new clients that fit a head on each learned representation.

    New clients have ids ``first_new_client ...`` (never seen in training), the same
    ``B*`` and fresh heads. ``local`` fits all ``d`` coefficients by (minimum-norm)
    least squares on the client's own samples.
    """
    errors: dict[str, dict[str, float]] = {m: {} for m in [*representations, "local"]}
    for m_new in m_new_values:
        per_method: dict[str, list[float]] = {m: [] for m in errors}
        for client in range(first_new_client, first_new_client + count):
            generator = rng(seed, "new-client", client, m_new)
            x, y = tasks.sample(client, m_new, generator)
            x_test, y_test = tasks.sample(client, test_samples, generator)
            for method, representation in representations.items():
                head = linear.least_squares_head(x, y, representation)
                per_method[method].append(
                    linear.mean_squared_error(x_test, y_test, representation, head)
                )
            identity = np.eye(tasks.dim)
            coefficients = linear.least_squares_head(x, y, identity)
            per_method["local"].append(
                linear.mean_squared_error(x_test, y_test, identity, coefficients)
            )
        for method, values in per_method.items():
            errors[method][str(m_new)] = float(np.mean(values))
    return errors


def _figures(
    out: Path,
    figure3: dict[str, dict[int, Path]],
    clients: list[int],
    new_client_mse: dict[str, dict[str, float]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    for n in clients:
        plot_rounds(
            [(m, read_rounds(by_n[n])) for m, by_n in figure3.items()],
            "server.principal-angle-distance",
            out / f"figure3_n{n}.png",
            title=f"Figure 3: n = {n}",
            log_scale=True,
        )
    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    for method, by_m in new_client_mse.items():
        m_values = sorted(by_m, key=int)
        axes.plot(
            [int(m) for m in m_values],
            [by_m[m] for m in m_values],
            marker="o",
            label=method,
        )
    axes.set_xlabel("labelled samples of the new client (m_new)")
    axes.set_ylabel("test MSE")
    axes.set_yscale("log")
    axes.set_title("Figure 4: new clients")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out / "figure4.png", dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main(sys.argv[1:])
