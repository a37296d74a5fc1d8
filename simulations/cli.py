"""The ``fedpers`` command: run one configured experiment, or check a configuration.

    fedpers run conf/fedrep_table1.toml --out results/table1 [--seeds 3]
    fedpers run conf/fedgmm_table2.toml --run-config "algorithm='fedem'" --out DIR
    fedpers check conf/fedgmm_table2.toml [--run-config "num-rounds=20"]

``run`` does what the reproduction scripts do for one method: it checks every run's
configuration and data before anything starts, starts a local simulation SuperLink,
runs the configuration's algorithm once per seed (``DIR/runs/<algorithm>-seed<K>/``,
each a results directory: config.json, rounds.jsonl, clients.jsonl, summary.json,
plots), stops the SuperLink by its PID, and writes ``DIR/summary.json`` and
``DIR/table.md`` (the mean, std and 95% interval over the seeds). It works from a
checkout and from an installed wheel alike: Flower's and Ray's state goes to the work
folder (``$FEDPERS_WORK_DIR``, else the checkout, else ``~/.cache/fedpers``), never to
the install folder. ``check`` validates without starting anything (``simulations.check``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedpers.simulations import check
from fedpers.simulations.flags import missing_files, output_parser, seeds_of, settings

FIGURES = ("final_accuracy", "private_accuracy", "final_principal_angle_distance")


def _run_parser() -> argparse.ArgumentParser:
    parser = output_parser(
        "Run one configured experiment, once per seed.", quick=False, prog="fedpers run"
    )
    parser.add_argument(
        "config",
        nargs="+",
        metavar="CONFIG.toml",
        help="run-config files (conf/*.toml); later ones win, then --run-config",
    )
    return parser


def run(argv: Sequence[str]) -> int:
    """``fedpers run``: every seed of the configured algorithm; the summary over seeds."""
    from fedpers.simulations.runs import run_methods
    from fedpers.simulations.tables import method_table, write_summary

    parser = _run_parser()
    args = parser.parse_args(argv)
    missing = missing_files(args.config)
    if missing:
        parser.error(missing)
    if args.quick:
        parser.error(
            "--quick is the scripts' small version of a paper experiment; fedpers run runs "
            "the configuration as given: set num-rounds (and num-clients) to shrink it"
        )
    args.run_config = [*args.config, *args.run_config]
    values: dict[str, Any] = settings(args, {})

    algorithm = str(values.get("algorithm", "fedrep"))
    seeds = seeds_of(args)
    directories = run_methods(args, values, [algorithm], seeds)
    summary, figures = seed_summary(algorithm, seeds, directories)
    out = args.out.expanduser().resolve()
    write_summary(out, summary)
    table = method_table(summary, [(n, n.replace("_", " ")) for n in figures if n in PERCENT])
    (out / "table.md").write_text(table)
    print(table)
    print(f"results in {out}: summary.json, table.md and each seed's run in runs/")
    return 0


PERCENT = ("final_accuracy", "private_accuracy")  # the figures the table shows, in %


def seed_summary(
    algorithm: str, seeds: Sequence[int], directories: Mapping[tuple[str, int], Path]
) -> tuple[dict[str, Any], list[str]]:
    """The scripts' summary of one method over the seeds (``method_summary``), for the
    figures of ``FIGURES`` its runs report; and those figures' names."""
    from fedpers.reports import read_summary
    from fedpers.simulations.tables import method_summary

    runs = {seed: read_summary(directories[(algorithm, seed)]) for seed in seeds}
    names = [n for n in FIGURES if isinstance(runs[seeds[0]].get(n), int | float)]
    figures = {n: {(algorithm, s): float(runs[s][n]) for s in seeds} for n in names}
    clients = {algorithm: dict(runs[seeds[0]].get("client_accuracy", {}))}
    return method_summary([algorithm], seeds, figures, clients, directories), names


USAGE = """usage: fedpers {run,check} ...

  fedpers run CONFIG.toml ... --out DIR    run one configured experiment, once per seed
  fedpers check CONFIG.toml ...            check a configuration; nothing starts

fedpers run --help and fedpers check --help list their flags."""


def main(argv: Sequence[str] | None = None) -> int:
    """``fedpers {run,check} ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"run": run, "check": _check}
    if argv[:1] in (["-h"], ["--help"]):
        print("fedpers: run one configured experiment, or check a configuration.\n\n" + USAGE)
        return 0
    if not argv or argv[0] not in commands:
        said = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"{USAGE}\n\nfedpers: error: {said}; use run or check", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


def _check(argv: Sequence[str]) -> int:
    """``fedpers check CONFIG.toml [...]``: ``simulations.check``."""
    return check.main(list(argv), prog="fedpers check")


if __name__ == "__main__":
    raise SystemExit(main())
