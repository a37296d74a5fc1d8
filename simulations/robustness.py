"""Robustness, through Flower: a fuzz sweep of malformed replies, attacks against
every aggregation, and attacks over a whole run against the rows' own exchanges.

    python -m simulations.robustness --out DIR [--quick] [--scale S] [--parallel N]
                                     [--sweep-replies N] [--replies-per-round 4,10,40]
                                     [--exchange-rounds N] [--in-process]
                                     [--skip-fuzz] [--skip-attacks] [--skip-exchanges]

1. **Fuzz.** For each family (FedRep, FedAvg, FedGMM, Sheaf-FRL; without ``--quick``
   also the comparison rows with an exchange of their own: SCAFFOLD, Clustered FL,
   FedProto) and each kind of
   malformed reply or attack that applies to it (``fedpers.faults.KINDS``), a case: one
   client sends it in one round. The cases of a family run in one `flwr run`, one case
   per round, at partitions taking turns; start-up cases (FedGMM's queries) before the
   first round of the FedGMM run. Per case: did the run finish, was the faulty reply left out with a
   reason (malformed kinds) or capped (inflated sizes), and was every adopted global
   state well formed (``server.state-well-formed`` of every round, and the final arrays
   read back here).
   These cases are the fault list of ``fedpers.faults``: a regression suite.
2. **Reply sweep.** ``--sweep-replies`` replies per family and phase (training and
   evaluation), generated from the record grammar (``fedpers.simulations.reply_fuzz``,
   hypothesis, seeded by the first seed) and sent in place of one node's reply, in
   process, and in place of its answers to the start-up vote on the initial model
   (FedAvg, FedRep, FedGMM); every property the server guarantees is checked on every
   reply and every violation counted (default 1,250 per case: 13,750 in all; 10 with
   ``--quick``).
3. **Attacks.** MNIST-1D, 100 clients x 2 classes (``fedrep_images``' defaults),
   FedRep and FedAvg; 10% of the clients (partitions 0-9) attack from round 1:
   ``sign-flip`` (the update sent as ``-scale`` times itself) or ``inflate-examples``
   (1e12 samples claimed); under each aggregation, at each of ``--replies-per-round``
   (``fraction-train`` = replies / clients; the trimmed mean cuts ``ceil(trim x k)``
   of k). ``clean`` is the plain mean without attackers; every accuracy is the usual
   final accuracy (mean of the last 10 rounds). ``--in-process`` runs them without the
   SuperLink and Ray (``fedpers.simulations.inprocess``): the same numbers, each run in
   about 40% of the time (a 4-reply run: 34 s against 82 s).

4. **Attacks over a run.** SCAFFOLD, Fed-MTL, FedProto, Clustered FL, pFedMe, L2GD and
   FedGMM (the rows whose server carries state of their own from round to round), 10
   clients each, client 0 sending its update sign-flipped x``--scale`` in every one of
   50 rounds (``--exchange-rounds``; with ``--quick`` 2, SCAFFOLD under the mean and
   the median): a reply inside every per-round bound. Clean and attacked under each
   aggregation the row accepts, the rounds completed, and whether the attack moved the
   final state at all (``fedpers.simulations.exchange_attacks``).

Writes DIR/summary.json ``{"fuzz": {"cases": N, "runs_crashed": n, "replies_rejected":
n, "corrupt_states_adopted": n, ...}, "sweep": {"replies": N, "exceptions": n,
"violations": {KIND: n}, "by_case": [...]}, "attack": {REPLIES: {ALGO: {"clean": acc,
ATTACK: {AGGREGATION: acc}}}}, "exchanges": {ROW: {"clean" | "sign-flip": {"accuracy":
{AGGREGATION: acc}, "rounds": {AGGREGATION: n}}, "stopped": [...], ...}}}``,
DIR/table.md, DIR/cases.json (every case) and the runs under DIR/runs/.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedpers.aggregation import Aggregation
from fedpers.reports import read_rounds, read_summary
from fedpers.results import final_mean, write_json
from fedpers.simulations import exchange_attacks
from fedpers.simulations.flags import output_parser, parallelism, resources, seeds_of, settings
from fedpers.simulations.launch import FlowerRunError, LocalSimulation
from fedpers.simulations.runs import prepare_output, run_in_process_pool, validate_runs
from fedpers.simulations.stats import add_statistics
from fedpers.simulations.tables import markdown_table

# Kinds of malformed replies: the faulty reply must be left out with a reason
MALFORMED = (
    "raise",
    "nan",
    "shape",
    "dtype",
    "rename",
    "extra",
    "drop",
    "corrupt-data",
    "bad-stype",
    "examples-list",
    "loss-list",
    "huge",
    "huge=3.4e38",
)
MIXTURE_MALFORMED = (
    "responsibilities",
    "responsibilities=1e12",
    "responsibilities-shape",
    "non-psd",
    "asymmetric",
)
# Attacks a mean cannot tell from training: the run must go on with a sound state
ATTACKS = ("sign-flip=100", "noise=0.1", "inflate", "zero-examples")
PILOT_KINDS = ("pilots-scale", "pilots-nan", "raise", "loss-list", "examples-list", "inflate")
STARTUP_KINDS = ("startup-scale", "startup-nan")

CLIENTS = 6  # clients of a fuzz run; every one trains every round
FAMILIES: dict[str, dict[str, Any]] = {
    "fedrep": {"algorithm": "fedrep", "dataset": "digits", "head-epochs": 2, "epochs": 1},
    "fedavg": {"algorithm": "fedavg", "dataset": "digits", "epochs": 1},
    "fedgmm": {
        "algorithm": "fedgmm",
        "dataset": "mixture",
        "samples-per-client": 100,
        "lr": 0.5,
        "momentum": 0.0,
        "epochs": 1,
    },
    "sheaf-frl": {"algorithm": "sheaf-frl", "dataset": "digits", "epochs": 1},
    # The comparison rows with an exchange of their own (the others send FedAvg's or
    # FedRep's records): SCAFFOLD's control variates, Clustered FL's models of several
    # clusters (split from the first round on), FedProto's class prototypes and counts.
    "scaffold": {"algorithm": "scaffold", "dataset": "digits", "epochs": 1},
    "clustered-fl": {
        "algorithm": "clustered-fl",
        "dataset": "digits",
        "epochs": 1,
        "clustered-fl-eps1": 1e9,
        "clustered-fl-eps2": 0.0,
    },
    "fedproto": {
        "algorithm": "fedproto",
        "dataset": "digits",
        "epochs": 1,
        "sheaf-latent-dims": ",".join(["8"] * CLIENTS),  # one per client, all equal
    },
}
# Fuzzed in the full form only (``--quick`` keeps to the four families)
COMPARISON_FAMILIES = ("scaffold", "clustered-fl", "fedproto")
SIGN_FLIP_SCALE = 10.0
SWEEP_REPLIES = 1250  # per case: 10 federations x 2 phases, 3 votes, 3 FedGMM statistics
QUICK_SWEEP_REPLIES = 10
REPLIES_PER_ROUND = (4, 10, 40)
ALGORITHMS = ("fedrep", "fedavg")
ATTACK_NAMES = ("clean", "sign-flip", "inflate-examples")
QUICK_REPLIES_PER_ROUND = (4, 10)


@dataclass(frozen=True)
class Selection:
    """The part of the attack table to run (``--algorithms``, ``--aggregations``,
    ``--attacks``): a run is made if its algorithm, aggregation and attack are chosen."""

    algorithms: frozenset[str] = frozenset(ALGORITHMS)
    aggregations: frozenset[str] = frozenset(a.value for a in Aggregation)
    attacks: frozenset[str] = frozenset(ATTACK_NAMES)

    def __contains__(self, run: tuple[str, str, str]) -> bool:
        algorithm, aggregation, attack = run
        return (
            algorithm in self.algorithms
            and aggregation in self.aggregations
            and attack in self.attacks
        )


@dataclass
class Case:
    """One fuzz case and what happened to it."""

    family: str
    kind: str
    partition: int
    round: int
    expect: str  # "rejected", "capped", "accepted" or "bounded" (either, by update-cap)
    finished: bool = False
    rejected: bool = False
    reason: str = ""
    state_well_formed: bool = True


def fuzz_cases(quick: bool) -> dict[str, list[Case]]:
    """The cases of every fuzz run, by run name."""
    positions = (1,) if quick else (1, 4)  # the faulty partitions; each kind at each

    def schedule(family: str, kinds: tuple[str, ...]) -> list[Case]:
        cases: list[Case] = []
        for partition in positions:
            for kind in kinds:
                expect = "rejected"
                if family == "fedgmm" and kind in ("inflate", "zero-examples"):
                    expect = "rejected"  # the responsibilities expose the claimed size
                elif family == "fedproto":
                    expect = "rejected"  # the prototype counts expose any other size
                elif kind.startswith(("sign-flip", "noise")):
                    expect = "bounded"  # accepted, or left out by the update bound
                elif kind == "zero-examples":
                    expect = "accepted"
                elif kind == "inflate":
                    expect = "capped"
                cases.append(Case(family, kind, partition, len(cases) + 1, expect))
        return cases

    runs = {
        "fedrep": schedule("fedrep", MALFORMED + ATTACKS),
        "fedavg": schedule("fedavg", MALFORMED + ATTACKS),
        "fedgmm": schedule("fedgmm", MALFORMED + MIXTURE_MALFORMED + ATTACKS),
        "sheaf-frl": schedule("sheaf-frl", PILOT_KINDS),
    }
    if quick:  # a few kinds of each family, enough to exercise every path
        keep = {"nan", "rename", "corrupt-data", "huge", "sign-flip=100", "inflate"}
        keep |= {"non-psd", "responsibilities", "pilots-scale", "raise"}
        for name in runs:
            kinds = keep if name != "fedavg" else {"nan", "corrupt-data", "inflate"}
            chosen = [c for c in runs[name] if c.kind in kinds]
            runs[name] = [
                Case(c.family, c.kind, c.partition, r, c.expect)
                for r, c in enumerate(chosen, start=1)
            ]
    else:
        runs.update({name: schedule(name, MALFORMED + ATTACKS) for name in COMPARISON_FAMILIES})
    # Start-up answers (round 0) are screened in the FedGMM run, before its first round
    runs["fedgmm"] += [
        Case("fedgmm", kind, partition, 0, "rejected")
        for kind, partition in zip(STARTUP_KINDS, (1, 2), strict=True)
    ]
    return runs


def fuzz_overrides(name: str, cases: list[Case], runs_dir: Path) -> dict[str, Any]:
    """The run config of one fuzz run."""
    family = FAMILIES[name]
    spec = ",".join(f"{c.kind}:{c.partition}@{c.round}" for c in cases)
    return {
        **family,
        "num-clients": CLIENTS,
        "fraction-train": 1.0,
        "num-rounds": max(1, max(c.round for c in cases)),
        "final-rounds": 1,
        "fault-injection": spec,
        "results-dir": str(runs_dir),
        "run-name": f"fuzz-{name}",
    }


def judge(cases: list[Case], directory: Path | None) -> None:
    """Fill in what happened to each case of a run from what the run wrote."""
    if directory is None:
        return
    records = {r.round: r for r in read_rounds(directory)}
    summary = read_summary(directory)
    startup = summary.get("startup_rejections", [])
    final_ok = _final_arrays_sound(directory)
    for case in cases:
        case.finished = True
        if case.round == 0:
            reasons = [r for r in startup if r.startswith(f"partition {case.partition}: ")]
        else:
            record = records.get(case.round)
            reasons = [
                r
                for r in (record.rejections if record else [])
                if r.startswith(f"partition {case.partition}: ")
            ]
            case.state_well_formed = bool(
                record and record.server.get("state-well-formed", 0.0) == 1.0 and final_ok
            )
        case.rejected = bool(reasons) and not all("capped at" in r for r in reasons)
        case.reason = reasons[0].split(": ", 1)[1] if reasons else ""


def _final_arrays_sound(directory: Path) -> bool:
    """The final global arrays, read back: all finite."""
    path = directory / "final_arrays.npz"
    if not path.exists():
        return True  # Sheaf-FRL shares no model
    with np.load(path, allow_pickle=False) as stored:
        return all(bool(np.all(np.isfinite(stored[name]))) for name in stored.files)


def attack_runs(
    quick: bool,
    scale: float,
    runs_dir: Path,
    seeds: Sequence[int] = (0,),
    values: Mapping[str, Any] | None = None,
    replies: Sequence[int] = REPLIES_PER_ROUND,
    selection: Selection = Selection(),
) -> list[dict[str, Any]]:
    """Every run of the attack table (as run-config overrides) in ``selection``, once
    per seed and per count of ``replies`` per round; ``values`` (from ``--run-config``)
    change any key of every run."""
    runs = []
    for seed in seeds:
        for count in replies:
            for overrides in _attack_runs(quick, scale, runs_dir, count, selection):
                runs.append(
                    {
                        **overrides,
                        **(values or {}),
                        "seed": seed,
                        "run-name": f"{overrides['run-name']}-seed{seed}",
                    }
                )
    return runs


def _attack_runs(
    quick: bool, scale: float, runs_dir: Path, replies: int, selection: Selection
) -> list[dict[str, Any]]:
    clients = 20 if quick else 100
    base: dict[str, Any] = {
        "dataset": "mnist1d",
        "results-dir": str(runs_dir),
        "num-clients": clients,
        "fraction-train": replies / clients,
    }
    if quick:
        base.update({"num-rounds": 3, "final-rounds": 2})
    attackers = "0-9" if not quick else "0-1"  # 10% of the clients
    attacks = {
        "sign-flip": f"sign-flip={scale:g}:{attackers}",
        "inflate-examples": f"inflate=1e12:{attackers}",
    }
    runs: list[dict[str, Any]] = []

    def add(algorithm: str, aggregation: Aggregation, attack: str) -> None:
        if (algorithm, aggregation.value, attack) not in selection:
            return
        runs.append(
            {
                **base,
                "algorithm": algorithm,
                "aggregation": aggregation.value,
                "fault-injection": attacks.get(attack, ""),
                "run-name": f"{algorithm}-r{replies}-{attack}-{aggregation.value}",
            }
        )

    for algorithm in ("fedrep", "fedavg"):
        if quick:  # 10 replies: FedRep, each attack on the mean, the sign flip on the
            # trimmed mean; FedAvg, the sign flip on the mean. 4 replies: FedRep's sign
            # flip on the trimmed mean (which cut nothing there before ceil)
            if replies != 10:
                if algorithm == "fedrep":
                    add(algorithm, Aggregation.TRIMMED_MEAN, "sign-flip")
                continue
            attacked = ("clean", *attacks) if algorithm == "fedrep" else ("clean", "sign-flip")
            for attack in attacked:
                add(algorithm, Aggregation.MEAN, attack)
            if algorithm == "fedrep":
                add(algorithm, Aggregation.TRIMMED_MEAN, "sign-flip")
            continue
        for aggregation in Aggregation:
            # FedRep's clean runs under every aggregation: what robustness costs it
            if algorithm == "fedrep" or aggregation == Aggregation.MEAN:
                add(algorithm, aggregation, "clean")
            for attack in attacks:
                add(algorithm, aggregation, attack)
    return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the fuzz sweep and the attack table; returns the summary."""
    args = _parser().parse_args(argv)
    seeds = seeds_of(args)
    runs_dir = args.out.expanduser().resolve() / "runs"
    cases = {} if args.skip_fuzz else fuzz_cases(args.quick)
    # the fuzz sweep checks what is rejected, not accuracy: one run per family, first seed
    fuzz = {
        name: {**fuzz_overrides(name, c, runs_dir), "seed": seeds[0]} for name, c in cases.items()
    }
    attacks = _planned_attacks(args, runs_dir, seeds)
    exchanges, refused = _planned_exchanges(args, runs_dir, seeds)
    validate_runs([*fuzz.values(), *attacks, *exchanges])
    sweep_replies = args.sweep_replies
    if sweep_replies is None:
        sweep_replies = QUICK_SWEEP_REPLIES if args.quick else SWEEP_REPLIES
    if sweep_replies and importlib.util.find_spec("hypothesis") is None:
        raise SystemExit(
            "error: the reply sweep needs hypothesis: pip install 'fedpers[dev]', "
            "or --sweep-replies 0 to leave it out"
        )
    out = prepare_output(args.out, overwrite=args.overwrite, resumable=False)
    sweep = _reply_sweep(sweep_replies, seeds[0])
    if args.in_process:  # the fuzz cases through Flower, the attack table in process
        done = [
            *_run_all(args, list(fuzz.values())),
            *run_in_process_pool([*attacks, *exchanges], parallelism(args), keep_going=True),
        ]
    else:
        done = _run_all(args, [*fuzz.values(), *attacks, *exchanges])
    fuzz_dirs = dict(zip(fuzz, done[: len(fuzz)], strict=True))
    every = [case for name, run in cases.items() for case in run]
    for name, run in cases.items():
        judge(run, fuzz_dirs[name])
    fuzz_summary = _fuzz_summary(every, fuzz_dirs) if cases else {}  # {}: --skip-fuzz
    if cases:
        write_json(out / "cases.json", {"cases": [asdict(c) for c in every]})
    attack_summary = _attack_table(attacks, done[len(fuzz) : len(fuzz) + len(attacks)])
    exchange_summary = exchange_attacks.summarize(
        exchanges, done[len(fuzz) + len(attacks) :], refused
    )
    result = {
        "fuzz": fuzz_summary,
        "sweep": sweep,
        "attack": attack_summary,
        "exchanges": exchange_summary,
        "sign_flip_scale": args.scale,
        "seeds": seeds,
        "quick": args.quick,
    }
    write_json(out / "summary.json", result)
    table = _report(fuzz_summary, sweep, attack_summary, every)
    table += "\n".join(["", *exchange_attacks.section(exchange_summary, args.scale)])
    (out / "table.md").write_text(table)
    print(f"\n{table}\nresults: {out}")
    return result


def _planned_attacks(
    args: argparse.Namespace, runs_dir: Path, seeds: list[int]
) -> list[dict[str, Any]]:
    """The attack table's runs as the flags select them (none with --skip-attacks)."""
    if args.skip_attacks:
        return []
    replies = args.replies_per_round or (
        QUICK_REPLIES_PER_ROUND if args.quick else REPLIES_PER_ROUND
    )
    return attack_runs(
        args.quick,
        args.scale,
        runs_dir,
        seeds,
        settings(args, {}),
        replies,
        Selection(args.algorithms, args.aggregations, args.attacks),
    )


def _planned_exchanges(
    args: argparse.Namespace, runs_dir: Path, seeds: list[int]
) -> tuple[list[dict[str, Any]], dict[str, dict[str, str]]]:
    """The attacks over a run as the flags ask (none with --skip-exchanges), and the
    aggregations each row refuses."""
    if args.skip_exchanges:
        return [], {}
    return exchange_attacks.plan(
        quick=args.quick,
        scale=args.scale,
        runs_dir=runs_dir,
        seeds=seeds,
        values=settings(args, {}),
        rounds=args.exchange_rounds,
        rows=sorted(args.exchange_rows) if args.exchange_rows is not None else None,
    )


def _run_all(args: argparse.Namespace, runs: list[dict[str, Any]]) -> list[Path | None]:
    """Every run on one local SuperLink, ``--parallel`` at a time; None where a run did
    not finish (said on stdout), so that one failed run leaves the others' results."""
    if not runs:
        return []
    kwargs = resources(args)
    with LocalSimulation() as simulation:

        def attempt(overrides: dict[str, Any]) -> Path | None:
            try:
                return simulation.run(overrides, **kwargs)
            except FlowerRunError as error:
                print(f"run '{overrides['run-name']}' did not finish: {error}", flush=True)
                return None

        with ThreadPoolExecutor(max_workers=parallelism(args)) as pool:
            # every run submitted at once, so that no worker waits between the two parts
            return list(pool.map(attempt, runs))


def _parser() -> argparse.ArgumentParser:
    parser = output_parser(__doc__.split("\n\n")[0], resume=False)
    parser.add_argument(
        "--scale",
        type=float,
        default=SIGN_FLIP_SCALE,
        help=f"sign-flip attack: the update sent as -scale times itself "
        f"(default {SIGN_FLIP_SCALE:g})",
    )
    _add_part_flags(parser)
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the attack table in process, without Flower's SuperLink and Ray: the "
        "ServerApp on an in-process grid of the real ClientApps, the same numbers as "
        "through flwr run, in about 40%% of the time (--parallel processes at a time)",
    )
    parser.add_argument(
        "--sweep-replies",
        type=_count,
        default=None,
        help=f"generated replies per family and phase in the reply sweep; 0 leaves it "
        f"out (default {SWEEP_REPLIES}, {QUICK_SWEEP_REPLIES} with --quick)",
    )
    parser.add_argument(
        "--replies-per-round",
        type=_counts,
        default=None,
        help="the attack table's replies per round, comma-separated (default "
        + ",".join(map(str, REPLIES_PER_ROUND))
        + "; with --quick "
        + ",".join(map(str, QUICK_REPLIES_PER_ROUND))
        + ")",
    )
    for flag, known in (
        ("--algorithms", ALGORITHMS),
        ("--aggregations", tuple(a.value for a in Aggregation)),
        ("--attacks", ATTACK_NAMES),
    ):
        parser.add_argument(
            flag,
            type=_names(flag, known),
            default=frozenset(known),
            help=f"the attack table's {flag[2:]}, comma-separated (default: all of "
            f"{','.join(known)})",
        )
    return parser


def _add_part_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that leave a part out, and the attacks over a run's length."""
    parser.add_argument(
        "--skip-attacks", action="store_true", help="no attack table (the other parts run)"
    )
    parser.add_argument(
        "--skip-exchanges",
        action="store_true",
        help="no attacks over a run (one client of 10 attacking every round of each row "
        "with its own exchange: fedpers.simulations.exchange_attacks)",
    )
    parser.add_argument(
        "--exchange-rounds",
        type=_count,
        default=None,
        help=f"rounds of each attack over a run (default {exchange_attacks.ROUNDS}, "
        f"{exchange_attacks.QUICK_ROUNDS} with --quick)",
    )
    parser.add_argument(
        "--exchange-rows",
        type=_names("--exchange-rows", tuple(exchange_attacks.ROWS)),
        default=None,
        help="the rows of the attacks over a run, comma-separated (default: all of "
        f"{','.join(exchange_attacks.ROWS)}; with --quick "
        f"{','.join(exchange_attacks.QUICK_ROWS)})",
    )
    parser.add_argument(
        "--skip-fuzz", action="store_true", help="no fuzz cases (the sweep and the attacks)"
    )


def _names(flag: str, known: Sequence[str]) -> Callable[[str], frozenset[str]]:
    def parse(text: str) -> frozenset[str]:
        names = frozenset(part.strip() for part in text.split(",") if part.strip())
        unknown = sorted(names - set(known))
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"{flag} {text!r}: unknown {', '.join(unknown) or 'empty list'}; "
                f"choose from {','.join(known)}"
            )
        return names

    return parse


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (0, 1, 2, ...)")
    return value


def _counts(text: str) -> tuple[int, ...]:
    values = tuple(_count(part) for part in text.split(","))
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give replies per round as 4,10,40")
    return values


def _reply_sweep(examples: int, seed: int) -> dict[str, Any]:
    """The reply sweep's counts, in all and by family and phase (empty when left out)."""
    if examples == 0:
        return {}
    from fedpers.simulations import reply_fuzz  # needs hypothesis: imported on use

    counts = reply_fuzz.sweep(list(reply_fuzz.FAMILIES), examples, seed=seed)
    return {
        "replies": sum(c.replies for c in counts),
        "exceptions": sum(c.exceptions for c in counts),
        "kept": sum(c.kept for c in counts),
        "violations": {k: sum(c.violations[k] for c in counts) for k in reply_fuzz.KINDS},
        "seconds": sum(c.seconds for c in counts),
        "seed": seed,
        "by_case": [asdict(c) for c in counts],
    }


def _fuzz_summary(every: list[Case], fuzz_dirs: dict[str, Path | None]) -> dict[str, Any]:
    """What the fuzz sweep found: crashes, rejections, and the cases judged wrongly."""
    return {
        "cases": len(every),
        "runs_crashed": sum(d is None for d in fuzz_dirs.values()),
        "replies_rejected": sum(c.rejected for c in every),
        "corrupt_states_adopted": sum(not c.state_well_formed for c in every),
        "malformed_not_rejected": [
            f"{c.family} {c.kind} @{c.round}"
            for c in every
            if c.expect == "rejected" and not c.rejected
        ],
        "unexpectedly_rejected": [
            f"{c.family} {c.kind} @{c.round}"
            for c in every
            if c.rejected
            and c.expect != "rejected"
            and not (c.expect == "bounded" and c.reason.startswith("update norm"))
        ],
        "families": sorted({c.family for c in every}),
    }


def _attack_table(
    runs: list[dict[str, Any]], directories: list[Path | None]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Final accuracy of every attack run by replies per round, algorithm, attack and
    aggregation: the mean over seeds (each seed's in ``per_seed``, the std in ``std``,
    the 95% interval in ``ci95``). A run that an attack drove to a stop (every reply
    rejected, fewer than min-replies) counts with the mean of its last evaluated
    rounds, and is listed under ``stopped`` (by seed); a run with rounds that went back
    to an earlier state (every reply of the round refused) lists their count under
    ``went_back`` (by seed)."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for overrides, directory in zip(runs, directories, strict=True):
        algorithm, aggregation = overrides["algorithm"], overrides["aggregation"]
        replies = round(overrides["fraction-train"] * overrides["num-clients"])
        prefix = f"{algorithm}-r{replies}-"
        suffix = f"-{aggregation}-seed{overrides['seed']}"
        attack = overrides["run-name"][len(prefix) : -len(suffix)]
        entry = table.setdefault(str(replies), {}).setdefault(algorithm, {})
        folder = Path(overrides["results-dir"]) / overrides["run-name"]
        records = read_rounds(folder) if (folder / "rounds.jsonl").exists() else []
        if back := exchange_attacks.went_back(records):
            went_back = entry.setdefault("went_back", {}).setdefault(attack, {})
            went_back.setdefault(aggregation, {})[str(overrides["seed"])] = back
        if directory is not None:
            accuracy = read_summary(directory)["final_accuracy"]
        else:
            accuracy = final_mean(records, "evaluate.accuracy", 10)
            last = records[-1].round if records else 0
            stopped_at = entry.setdefault("stopped", {}).setdefault(attack, {})
            stopped_at.setdefault(aggregation, {})[str(overrides["seed"])] = last
        entry.setdefault("per_seed", {}).setdefault(attack, {}).setdefault(aggregation, []).append(
            accuracy
        )
    for by_algorithm in table.values():
        for entry in by_algorithm.values():
            stats: dict[str, Any] = {}
            add_statistics(stats, "accuracy", entry["per_seed"])
            entry["std"] = stats["accuracy_std"]
            entry["ci95"] = stats["accuracy_ci95"]
            for attack, by_aggregation in stats["accuracy"].items():
                if attack == "clean":
                    entry["clean_by_aggregation"] = by_aggregation
                    if Aggregation.MEAN.value in by_aggregation:
                        entry["clean"] = by_aggregation[Aggregation.MEAN.value]
                else:
                    entry[attack] = by_aggregation
    return table


def _report(
    fuzz: dict[str, Any],
    sweep: dict[str, Any],
    attack: dict[str, dict[str, dict[str, Any]]],
    cases: list[Case],
) -> str:
    """table.md: the fault cases, then the reply sweep and the attack table if run."""
    lines = _fuzz_section(fuzz, cases) if cases else []
    if sweep:
        lines += _sweep_section(sweep)
    if attack:
        lines += _attack_section(attack)
    return "\n".join(lines)


def _fuzz_section(fuzz: dict[str, Any], cases: list[Case]) -> list[str]:
    return [
        "# Fuzz sweep",
        "",
        markdown_table(
            ["cases", "runs crashed", "replies rejected", "corrupt states adopted"],
            [
                (
                    fuzz["cases"],
                    fuzz["runs_crashed"],
                    fuzz["replies_rejected"],
                    fuzz["corrupt_states_adopted"],
                )
            ],
        ),
        markdown_table(
            ["family", "kind", "partition", "round", "expected", "rejected", "reason"],
            [
                (c.family, c.kind, c.partition, c.round, c.expect, c.rejected, c.reason[:70])
                for c in cases
            ],
        ),
    ]


def _sweep_section(sweep: dict[str, Any]) -> list[str]:
    kinds = list(sweep["violations"])

    def row(name: str, phase: str, c: dict[str, Any]) -> tuple[Any, ...]:
        counts = (c["violations"][k] for k in kinds)
        return (name, phase, c["replies"], c["kept"], c["exceptions"], *counts)

    rows = [row(c["family"], c["phase"], c) for c in sweep["by_case"]]
    rows.append(row("all", "", sweep))
    return [
        "# Reply sweep (generated replies)",
        "",
        markdown_table(["family", "phase", "replies", "kept", "exceptions", *kinds], rows),
    ]


def _attack_section(attack: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    aggregations = [a.value for a in Aggregation]
    rows = []
    for replies, by_algorithm in attack.items():
        for algorithm, entry in by_algorithm.items():
            clean = 100 * entry.get("clean", float("nan"))
            for name in ("sign-flip", "inflate-examples"):
                if name not in entry:
                    continue  # not run (--attacks)
                accuracies = [100 * entry[name].get(a, float("nan")) for a in aggregations]
                rows.append((replies, algorithm, name, clean, *accuracies))
            if "clean_by_aggregation" in entry:
                by = entry["clean_by_aggregation"]
                accuracies = [100 * by.get(a, float("nan")) for a in aggregations]
                rows.append((replies, algorithm, "none", clean, *accuracies))
    return [
        "# Attacks (final accuracy, %)",
        "",
        markdown_table(
            ["replies per round", "algorithm", "attack", "clean (mean)", *aggregations], rows
        ),
    ]


if __name__ == "__main__":
    main(sys.argv[1:])
