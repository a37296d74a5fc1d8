"""Privacy against utility: client-level DP of the shared parts at every epsilon of a grid.

    python -m simulations.privacy --out DIR [--num-clients 1000] [--num-rounds 100]
        [--fraction-train 0.1] [--epsilons 1,2,4,8,inf] [--seeds 3]
        [--methods fedrep,fedavg,lg-fedavg,ditto,local] [--dp-clip C] [--dp-server-lr LR]
        [--audit-canaries M] [--run-config "key=value ..."] [--in-process] [--parallel N]
        [--quick]

Every (method, epsilon, seed) is one ``flwr run`` on MNIST-1D, 2 classes a client. A
finite epsilon runs ``dp = "central"`` (``fedpers.privacy``): each sampled client's
update of the shared parts clipped to ``dp-clip``, Gaussian noise on their sum, Poisson
sampling at ``fraction-train``, and the noise multiplier chosen before the run so that
``num-rounds`` releases spend that epsilon at ``delta = 1 / N^1.1`` (``dp-target-epsilon``,
Google's PLD accountant). ``inf`` is the non-private run of the same method (its own
sampling and weights: what a user runs without DP). Local shares nothing: it runs once
per seed, costs no privacy, and stands under every epsilon as the floor.

The personal parts (FedRep's head, LG-FedAvg's body, Ditto's personal model) never leave
the device and need no noise; evaluation metrics leave it un-noised (docs/privacy.md
lists what each method sends).

Writes DIR/summary.json: ``final_accuracy[method][epsilon]`` (epsilon keys ``1``, ``2``,
``4``, ``8``, ``inf``; mean over seeds) with ``final_accuracy_std``,
``final_accuracy_ci95``, ``per_seed``; ``client_p10[method][epsilon]`` (first seed);
``epsilon_spent[method][epsilon]`` (what the accountant counted, the largest over seeds);
``audit_epsilon_lower[method][epsilon]`` (with ``--audit-canaries``: the one-run audit's
lower bound, ``fedpers.audit``, the largest over seeds; null where not audited);
``mechanism[method][epsilon]`` (``noise_multiplier``, ``clip``, ``sampling_rate``,
``sampling``, ``neighboring``, ``population``, ``rounds``, ``delta``, ...: enough to
recompute the guarantee with another accountant; null without DP); ``paired``: per
epsilon, the per-seed differences of FedRep - every other method and of every other
method - Local, with their 95% interval; ``smallest_epsilon_above_local`` (the smallest
epsilon of the grid whose FedRep - Local interval lies above 0, or null) and
``smallest_epsilon_above_local_by_method``. Also DIR/table.md, DIR/privacy.png
(accuracy against epsilon per method, ± std over seeds) and the runs under DIR/runs/.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedpers.reports import read_summary
from fedpers.simulations.flags import (
    add_in_process_flag,
    add_key_flags,
    output_parser,
    seeds_of,
    settings,
)
from fedpers.simulations.runs import run_all
from fedpers.simulations.stats import add_statistics, known_mean, percentile, seed_statistics
from fedpers.simulations.tables import interval, markdown_table, seeds_note, write_summary

METHODS = ("fedrep", "fedavg", "lg-fedavg", "ditto", "local")
NON_PRIVATE = "local"  # shares nothing: no noise, no privacy cost
EPSILONS = "1,2,4,8,inf"
AUDIT_QUICK = 200  # canaries of a quick run's private runs
INF = "inf"

# The experiment: MNIST-1D, 1,000 clients x 2 classes, 100 rounds, 10% of the clients a
# round (Poisson). Clip and server step: see docs/privacy.md (how they were chosen).
SCRIPT: dict[str, Any] = {
    "dataset": "mnist1d",
    "partitioner": "classes",
    "classes-per-client": 2,
    "num-clients": 1000,
    "num-rounds": 100,
    "fraction-train": 0.1,
    "final-rounds": 10,
    "dp-clip": 1.0,
    "dp-server-lr": 1.0,
    "dp-sampling": "poisson",
}
QUICK = {
    "num-clients": 20,
    "num-rounds": 3,
    "final-rounds": 1,
    "fraction-train": 0.5,
    "epochs": 1,
    "head-epochs": 2,
}


def parse_epsilons(text: str) -> list[str]:
    """``--epsilons``: comma-separated positive numbers and ``inf``, as the summary's
    keys (``1``, ``2.5``, ``inf``)."""
    keys: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            raise SystemExit(f"error: --epsilons: '{item}' is not a number or inf") from None
        if math.isnan(value) or value <= 0:
            raise SystemExit(f"error: --epsilons: {item} must be above 0 (or inf)")
        key = INF if math.isinf(value) else f"{value:g}"
        if key in keys:
            raise SystemExit(f"error: --epsilons names {key} twice")
        keys.append(key)
    if not keys:
        raise SystemExit("error: --epsilons is empty; give e.g. 1,2,4,8,inf")
    return keys


def private_values(epsilon: str, method: str, canaries: int = 0) -> dict[str, Any]:
    """The run-config keys of ``method`` at ``epsilon``: central DP spending it (audited
    with ``canaries`` canaries, if any), or none."""
    if epsilon == INF or method == NON_PRIVATE:
        return {"dp": "none"}
    audit = {"dp-audit-canaries": canaries} if canaries else {}
    return {"dp": "central", "dp-target-epsilon": float(epsilon), **audit}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the grid and write its summary; returns the summary."""
    parser = output_parser(__doc__.split("\n\n")[0], seeds="3", quick_seeds="2")
    add_key_flags(
        parser,
        ["num-clients", "num-rounds", "fraction-train", "dp-clip", "dp-server-lr", "data-root"],
        SCRIPT,
    )
    parser.add_argument("--epsilons", default=EPSILONS, help="default: %(default)s")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}"
    )
    parser.add_argument(
        "--audit-canaries",
        type=int,
        default=None,
        help="canaries each private run plants for the one-run audit (fedpers.audit; "
        f"{AUDIT_QUICK} with --quick, else 0: the documented grid ran without)",
    )
    add_in_process_flag(parser)
    args = parser.parse_args(argv)
    if args.audit_canaries is None:
        args.audit_canaries = AUDIT_QUICK if args.quick else 0
    epsilons = parse_epsilons(args.epsilons)
    chosen = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(METHODS))
    if unknown or not chosen:
        parser.error(f"unknown method(s) {unknown or chosen}; choose from {', '.join(METHODS)}")
    seeds = seeds_of(args)
    values = settings(args, SCRIPT, QUICK)
    directories = _run_grid(args, values, chosen, epsilons, seeds)
    result = _summary(directories, chosen, epsilons, seeds, values, quick=args.quick)
    out = args.out.expanduser().resolve()
    write_summary(out, result)
    title = (
        f"MNIST-1D, {result['clients']} clients x 2 classes, {result['rounds']} rounds, "
        f"{100 * result['fraction_train']:g}% a round"
    )
    table = _table(result)
    (out / "table.md").write_text(f"# {title}\n\n{seeds_note(seeds)}\n\n{table}")
    _plot(result, out / "privacy.png", title)
    print(f"\n{title}\n\n{table}\nresults: {out}")
    return result


def _run_grid(
    args: Any,
    values: Mapping[str, Any],
    methods: Sequence[str],
    epsilons: Sequence[str],
    seeds: Sequence[int],
) -> dict[tuple[str, str, int], Path]:
    """Every (method, epsilon, seed) run, validated before anything starts; Local's
    one run per seed stands under every epsilon."""
    root = args.out.expanduser().resolve() / "runs"
    # The non-private runs first: a private run's sample and noise are secret, so only
    # those repeat exactly (the first run is the one a test sends through Flower too).
    ordered = sorted(epsilons, key=lambda e: e != INF)
    keys = [
        (m, e, s) for s in seeds for e in ordered for m in methods if m != NON_PRIVATE or e == INF
    ]
    runs = [
        {
            **values,
            **private_values(e, m, args.audit_canaries),
            "algorithm": m,
            "seed": s,
            "results-dir": str(root),
            "run-name": f"{m}-eps{e}-seed{s}",
        }
        for m, e, s in keys
    ]
    directories = dict(zip(keys, run_all(args, runs), strict=True))
    for s in seeds:
        if NON_PRIVATE in methods:
            for e in epsilons:
                directories[(NON_PRIVATE, e, s)] = directories[(NON_PRIVATE, INF, s)]
    return directories


MECHANISM_KEYS = (
    "mode", "noise_multiplier", "clip", "sampling_rate", "sampling", "neighboring",
    "population", "expected_cohort", "rounds", "delta", "accountant", "server_lr",
)  # fmt: skip


def _summary(
    directories: Mapping[tuple[str, str, int], Path],
    methods: Sequence[str],
    epsilons: Sequence[str],
    seeds: Sequence[int],
    values: Mapping[str, Any],
    *,
    quick: bool,
) -> dict[str, Any]:
    runs = {key: read_summary(path) for key, path in directories.items()}
    first = runs[(methods[0], epsilons[0], seeds[0])]
    summary: dict[str, Any] = {
        "methods": list(methods),
        "epsilons": list(epsilons),
        "seeds": list(seeds),
    }
    accuracy = {
        m: {e: [runs[(m, e, s)]["final_accuracy"] for s in seeds] for e in epsilons}
        for m in methods
    }
    add_statistics(summary, "final_accuracy", accuracy, per_seed_key="per_seed")
    summary["client_p10"] = {
        m: {
            e: percentile(list(runs[(m, e, seeds[0])].get("client_accuracy", {}).values()), 10)
            for e in epsilons
        }
        for m in methods
    }
    for key, over_seeds in (("epsilon_spent", _spent), ("audit_epsilon_lower", _audited)):
        summary[key] = {
            m: {e: over_seeds([runs[(m, e, s)] for s in seeds]) for e in epsilons} for m in methods
        }
    summary["mechanism"] = {
        m: {e: _mechanism(runs[(m, e, seeds[0])]) for e in epsilons} for m in methods
    }
    summary["paired"] = {
        f"{a}-{b}": {e: _paired(accuracy[a][e], accuracy[b][e]) for e in epsilons}
        for a, b in _pairs(methods)
    }
    above_local = {
        m: _smallest_above(summary["paired"][f"{m}-{NON_PRIVATE}"], epsilons)
        for m in methods
        if m != NON_PRIVATE and NON_PRIVATE in methods
    }
    summary["smallest_epsilon_above_local"] = above_local.get("fedrep")
    summary["smallest_epsilon_above_local_by_method"] = above_local
    summary["wall_seconds"] = {
        m: {e: known_mean([runs[(m, e, s)].get("wall_seconds") for s in seeds]) for e in epsilons}
        for m in methods
    }
    summary.update(
        dataset=first.get("dataset", values.get("dataset")),
        clients=values["num-clients"],
        rounds=values["num-rounds"],
        fraction_train=values["fraction-train"],
        settings={k: v for k, v in values.items() if k not in ("results-dir", "run-name")},
        quick=quick,
    )
    return summary


def _spent(summaries: Sequence[Mapping[str, Any]]) -> float:
    """The epsilon the accountant counted (0 without DP: nothing private was released)."""
    spent = [(s.get("privacy") or {}).get("epsilon") for s in summaries]
    known = [float(v) for v in spent if v is not None]
    return max(known) if known else 0.0


def _audited(summaries: Sequence[Mapping[str, Any]]) -> float | None:
    """The audit's lower bound on epsilon, the largest over seeds (None: not audited)."""
    found = [((s.get("privacy") or {}).get("audit") or {}).get("epsilon_lower") for s in summaries]
    known = [float(v) for v in found if v is not None]
    return max(known) if known else None


def _mechanism(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    private = summary.get("privacy")
    return {k: private[k] for k in MECHANISM_KEYS if k in private} if private else None


def _pairs(methods: Sequence[str]) -> list[tuple[str, str]]:
    """The paired comparisons of a grid: FedRep against every other method, then every
    other method that shares something against Local (the same seeds, so the same
    partitions, in every run of one invocation)."""
    pairs = [("fedrep", m) for m in methods if m != "fedrep" and "fedrep" in methods]
    pairs += [(m, NON_PRIVATE) for m in methods if m not in ("fedrep", NON_PRIVATE)]
    return [(a, b) for a, b in pairs if b in methods]


def _paired(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Per-seed differences ``a - b``, their mean and 95% interval (Student's t)."""
    differences = [x - y for x, y in zip(a, b, strict=True)]
    mean, std, bounds = seed_statistics(differences)
    return {"per_seed": differences, "mean": mean, "std": std, "ci95": bounds}


def _smallest_above(paired: Mapping[str, Mapping[str, Any]], epsilons: Sequence[str]) -> str | None:
    """The smallest finite epsilon whose paired interval lies above 0 (None if none does,
    or with one seed, which has no interval)."""
    for key in sorted((e for e in epsilons if e != INF and e in paired), key=float):
        low = paired[key]["ci95"][0]
        if low is not None and not math.isnan(low) and low > 0:
            return key
    return None


def _table(summary: Mapping[str, Any]) -> str:
    """Accuracy (%) at every epsilon, mean ± std with the 95% interval; the paired rows."""
    epsilons = summary["epsilons"]
    header = ["method", *[f"eps {e}" for e in epsilons], "p10 at eps " + epsilons[0]]
    rows: list[list[Any]] = []
    for m in summary["methods"]:
        cells = []
        for e in epsilons:
            mean, std = summary["final_accuracy"][m][e], summary["final_accuracy_std"][m][e]
            spread = "" if std is None or math.isnan(std) else f" ± {100 * std:.1f}"
            bounds = interval(summary["final_accuracy_ci95"][m][e], digits=1)
            cells.append(f"{100 * mean:.1f}{spread} {bounds}")
        rows.append([m, *cells, f"{100 * summary['client_p10'][m][epsilons[0]]:.1f}"])
    for name, by_epsilon in summary["paired"].items():
        cells = [
            f"{100 * by_epsilon[e]['mean']:+.1f} {interval(by_epsilon[e]['ci95'], digits=1)}"
            for e in epsilons
        ]
        rows.append([f"paired {name}", *cells, ""])
    noise = []
    for e in epsilons:
        mechanism = next(
            (summary["mechanism"][m][e] for m in summary["methods"] if summary["mechanism"][m][e]),
            None,
        )
        noise.append("none" if mechanism is None else f"z = {mechanism['noise_multiplier']:.3g}")
    rows.append(["noise multiplier", *noise, ""])
    return markdown_table(header, rows)


def _plot(summary: Mapping[str, Any], path: Path, title: str) -> None:
    """Accuracy against epsilon per method (inf drawn at the right, past the grid)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from fedpers.reports import finish_figure, method_styles

    epsilons = summary["epsilons"]
    finite = [float(e) for e in epsilons if e != INF]
    where = {e: float(e) for e in epsilons if e != INF}
    if INF in epsilons:
        where[INF] = 2 * max(finite) if finite else 1.0
    order = sorted(epsilons, key=lambda e: where[e])
    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    styles = method_styles(list(summary["methods"]))
    for m in summary["methods"]:
        means = [100 * summary["final_accuracy"][m][e] for e in order]
        stds = [100 * (summary["final_accuracy_std"][m][e] or 0.0) for e in order]
        stds = [0.0 if math.isnan(s) else s for s in stds]
        style = {"marker": "o", **styles[m]}
        axes.errorbar([where[e] for e in order], means, yerr=stds, capsize=3, label=m, **style)
    axes.set_xscale("log", base=2)
    axes.set_xticks([where[e] for e in order], [("∞" if e == INF else e) for e in order])
    axes.set_xlabel("epsilon (client-level, delta = 1/N^1.1)")
    axes.set_ylabel("final accuracy (%)")
    axes.set_title(title, fontsize=9)
    finish_figure(figure, axes, path, percent=True, integer_x=False)


if __name__ == "__main__":
    main(sys.argv[1:])
