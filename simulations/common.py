"""Shared pieces of the reproduction scripts: output directory, tables, summaries."""

from __future__ import annotations

import argparse
import math
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedpers.results import write_json

SUMMARY = "summary.json"


def output_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every reproduction script takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--quick", action="store_true", help="a small, fast version (for tests and CI)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results a previous run of this script left in --out",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=None,
        help="Flower runs at a time (default 1, or 3 with --quick); wall times are only "
        "comparable between sequential runs",
    )
    return parser


def config_help(key: str, script: bool = False) -> str:
    """The ``--help`` text of a flag that sets run-config key ``key``: the schema's
    description, allowed values and default, so that a script says what the README says;
    with ``script``, also the script's own default (argparse's ``%(default)s``).

    Raises
    ------
    KeyError
        If ``key`` is not a run-config key.
    """
    from fedpers.config import schema

    try:
        setting = schema()[key]
    except KeyError:
        raise KeyError(f"'{key}' is not a run-config key (fedpers/config.py)") from None
    allowed = f", one of {', '.join(setting.choices)}" if setting.choices else ""
    text = (
        f"{setting.description} (run-config key '{key}'{allowed}; default {setting.toml_default})"
    ).replace("%", "%%")  # argparse %-formats help strings
    return f"{text}; this script: %(default)s" if script else text


def parallelism(args: argparse.Namespace) -> int:
    """Runs at a time: the --parallel flag, else 3 for --quick and 1 otherwise."""
    if args.parallel is not None:
        return max(1, int(args.parallel))
    return 3 if args.quick else 1


def validate_runs(runs: Sequence[Mapping[str, Any]]) -> None:
    """Validate every run config before anything starts (clear error, no cost)."""
    from fedpers.config import ConfigError
    from simulations.launch import resolved_config

    for overrides in runs:
        try:
            resolved_config(overrides)
        except ConfigError as error:
            raise SystemExit(f"error: {error}") from error


MARKER = ".fedpers-results"  # in every output directory a script made


def prepare_output(out: Path, *, overwrite: bool) -> Path:
    """Create ``out``; refuse to clobber earlier results unless ``overwrite``, and then
    delete only a directory that a fedpers script made (it holds ``MARKER``).

    Called before any run starts, so a wrong directory costs nothing.
    """
    out = out.expanduser().resolve()
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise SystemExit(
                f"error: {out} is not empty; pass --overwrite to replace its contents "
                "or choose another --out"
            )
        if not (out / MARKER).is_file():
            raise SystemExit(
                f"error: --overwrite deletes only an output directory of a fedpers script, "
                f"and {out} is not one (it has no {MARKER}); remove it yourself or choose "
                "another --out"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("made by a fedpers script; --overwrite may delete this folder\n")
    return out


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table; floats with 4 significant digits."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "n/a" if math.isnan(value) else f"{value:.4g}"
        return "n/a" if value is None else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_summary(out: Path, summary: Mapping[str, Any]) -> Path:
    """Write ``out/summary.json`` atomically."""
    path = out / SUMMARY
    write_json(path, summary)
    return path
