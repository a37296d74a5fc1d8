"""The flags every reproduction script takes, and the run-config keys they set.

Every script takes the same ways to set a run-config key, applied in this order (a
later one wins): the script's settings for its paper experiment, its ``--quick``
settings, ``--run-config`` (Flower's ``"key=value ..."`` syntax or a TOML file, as often
as wanted), and the script's own flags, each named after its key (``--num-rounds``).
Also here: ``--seeds``/``--seed``, ``--out``, ``--overwrite``, ``--parallel``,
``--quick`` and the Ray resources per client.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: a count (``3``: seeds 0, 1, 2) or a comma-separated list
    (``0,1,2``; one seed: ``5,``).

    Raises
    ------
    argparse.ArgumentTypeError
        On anything else, and on a count below 1.
    """
    text = text.strip()
    try:
        if "," in text:
            seeds = [int(part) for part in text.split(",") if part.strip()]
        else:
            count = int(text)
            if count < 1:
                raise argparse.ArgumentTypeError(
                    f"--seeds {text} runs no seed: give a count of at least 1 (3: seeds 0, 1, "
                    "2) or a list (0,1,2; a single seed K as K,)"
                )
            seeds = list(range(count))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds '{text}' is neither a count (3) nor a comma-separated list of seeds (0,1,2)"
        ) from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise argparse.ArgumentTypeError(
            f"--seeds '{text}' must name distinct non-negative seeds (0,1,2)"
        )
    return seeds


def output_parser(
    description: str,
    *,
    seeds: str = "1",
    quick_seeds: str = "1",
    quick: bool = True,
    prog: str | None = None,
    resume: bool = True,
) -> argparse.ArgumentParser:
    """An argument parser with the flags every reproduction script takes; ``seeds`` is
    the script's default ``--seeds``, ``quick_seeds`` its default with ``--quick``;
    ``quick=False``: ``--quick`` is accepted (so that its refusal can say why) but not
    offered in the help; ``resume=False``: no ``--resume`` (a script whose runs do not
    go through ``runs.run_all``)."""
    parser = argparse.ArgumentParser(description=description, prog=prog)
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--seeds",
        type=parse_seeds,
        default=None,
        help="seeds to run every experiment with: a count (3 = seeds 0,1,2) or a list "
        f"(0,1,2); tables give the mean, std and 95%% interval over them (default: {seeds}"
        + (f"; with --quick: {quick_seeds})" if quick else ")"),
    )
    parser.set_defaults(default_seeds=parse_seeds(seeds), quick_seeds=parse_seeds(quick_seeds))
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="one seed (the same as --seeds K,); run-config key 'seed'",
    )
    parser.add_argument(
        "--run-config",
        action="append",
        default=[],
        metavar="'KEY=VALUE ...' or FILE.toml",
        help="set any run-config key, in Flower's syntax or from a TOML file of keys "
        "(conf/*.toml); may be given more than once; the script's own flags win",
    )
    parser.add_argument(
        "--cpus-per-client",
        type=int,
        default=1,
        help="Ray CPUs reserved per virtual client (whole CPUs; default: %(default)s)",
    )
    parser.add_argument(
        "--gpus-per-client",
        type=float,
        default=0.0,
        help="Ray GPUs per virtual client (fractions share a GPU, 0.25 = four clients a GPU; "
        "with 0, Ray hides the GPUs from the clients; default: %(default)s)",
    )
    add_engine_flag(parser)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small, fast version (for tests and CI)" if quick else argparse.SUPPRESS,
    )

    _add_output_flags(parser, quick, resume)
    return parser


def _add_output_flags(parser: argparse.ArgumentParser, quick: bool, resume: bool) -> None:
    """``--overwrite``, ``--resume``, ``--discard-interrupted`` and ``--parallel``."""
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results a previous run of this script left in --out"
        + (
            " (refused where it holds interrupted runs: see --resume and --discard-interrupted)"
            if resume
            else ""
        ),
    )
    if resume:
        parser.add_argument(
            "--resume",
            action="store_true",
            help="continue an interrupted run of this command in --out: finished runs are "
            "kept, interrupted ones go on from their last round, the others start",
        )
        parser.add_argument(
            "--discard-interrupted",
            action="store_true",
            help="with --overwrite: also delete interrupted runs that --resume could continue",
        )
    parser.add_argument(
        "--parallel",
        type=int,
        default=None,
        help=(
            "runs at a time (default 1, 3 with --quick, and with --engine batched one "
            if quick
            else "runs at a time (default 1, and with --engine batched one "
        )
        + "per core); wall times are only comparable between sequential runs",
    )


def add_engine_flag(parser: argparse.ArgumentParser) -> None:
    """``--engine``: the run-config key ``engine`` of every run (``runs.run_all`` sends
    batched runs to this script's processes, the others through `flwr run`)."""
    parser.add_argument(
        "--engine",
        dest="key_engine",
        choices=("flower", "batched"),
        default=None,
        help="run-config key 'engine': 'flower' runs every run through `flwr run` on "
        "Flower's Ray engine (the default); 'batched' runs the same ServerApp in this "
        "script's processes with a round's clients trained as cohorts",
    )


def add_key_flags(
    parser: argparse.ArgumentParser,
    keys: Sequence[str],
    script: Mapping[str, Any] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """A flag ``--KEY`` per run-config key, typed as the schema declares it, with the
    schema's help and the script's own setting (``script[key]``) as its shown default.
    ``aliases`` maps a key to an older flag name kept for compatibility. An unset flag
    is None: it changes nothing (``settings`` reads them)."""
    from fedpers.config import schema

    known = schema()
    for key in keys:
        setting = known[key]
        kind: Any = setting.kind
        if kind is bool:
            kind = _boolean
        elif kind not in (int, float):
            kind = str
        names = [f"--{key}"] + ([f"--{aliases[key]}"] if aliases and key in aliases else [])
        shown = (script or {}).get(key, setting.toml_default)
        parser.add_argument(
            *names,
            dest=_dest(key),
            type=kind,
            default=None,
            metavar=setting.type_name.upper(),
            help=f"{config_help(key)}; this script: {shown}",
        )


def _dest(key: str) -> str:
    return "key_" + key.replace("-", "_")


def _boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"'{text}' is not a boolean: write true or false")


def run_config_values(items: Sequence[str]) -> dict[str, Any]:
    """The keys given by ``--run-config`` items: each a TOML file (its top-level keys,
    or those of a ``[tool.flwr.app.config]`` table) or Flower's ``"key=value ..."``.

    Raises
    ------
    SystemExit
        On a file that cannot be read or parsed, a string Flower cannot parse, or an
        unknown key (naming it, with the closest known key).
    """
    from flwr.common.config import parse_config_args

    from fedpers.config import schema

    values: dict[str, Any] = {}
    for item in items:
        path = Path(item).expanduser()
        if _is_directory(path):
            raise SystemExit(
                f"error: --run-config {item} is a directory; give a run-config file "
                "(FILE.toml) or keys (\"num-rounds=20 dataset='digits'\")"
            )
        if item.endswith(".toml") or _is_file(path):
            given = _file_keys(path, item)
        else:
            given = _inline_keys(item, parse_config_args)
        for key in given:
            if key not in schema():
                close = difflib.get_close_matches(key, list(schema()), n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise SystemExit(
                    f"error: --run-config {item}: '{key}' is not a run-config key{hint} "
                    "(python -m fedpers.config markdown lists them)"
                )
        values.update(given)
    return values


def _file_keys(path: Path, item: str) -> dict[str, Any]:
    """The run-config keys of a TOML file (its top-level keys, or its
    ``[tool.flwr.app.config]`` table and then no other top-level key)."""
    from fedpers.config import ConfigError, run_config_table

    try:
        with path.open("rb") as handle:
            document = tomllib.load(handle)
    except UnicodeDecodeError:
        raise SystemExit(
            f"error: --run-config {item}: not a text file (TOML is UTF-8 text); give a "
            "run-config file such as conf/fedrep_table1.toml"
        ) from None
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise SystemExit(f"error: --run-config {item}: {error}") from None
    try:
        table = run_config_table(document, item)
    except ConfigError as error:
        raise SystemExit(f"error: --run-config {error}") from None
    # a pyproject.toml's other tables ([project], ...) are not run config; a key there is
    stray = sorted(k for k, v in document.items() if k != "tool" and not isinstance(v, dict))
    if table is not document and stray:
        raise SystemExit(
            f"error: --run-config {item}: top-level key(s) {stray} beside its "
            "[tool.flwr.app.config] table would be ignored; move them into the table"
        )
    return {k: v for k, v in table.items() if k != "description"}


FLOWER_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")  # flwr's parse_config_args


def _inline_keys(item: str, parse: Any) -> dict[str, Any]:
    """The keys of Flower's ``"key=value ..."`` string; words that are not a pair,
    which Flower drops without a word, are refused."""
    hint = "quote strings inside: \"dataset='digits' num-rounds=20\""
    if stray := FLOWER_PAIR.sub(" ", item).split():
        raise SystemExit(
            f"error: --run-config '{item}': {stray} not of the form key=value (Flower would "
            f"drop it without a word); {hint}"
        )
    try:
        return dict(parse([item]))
    except Exception as error:  # Flower raises ValueError or tomli's error
        raise SystemExit(
            f"error: --run-config '{item}' is not Flower's \"key=value ...\" syntax "
            f"({error}); {hint}"
        ) from None


def _is_directory(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def missing_files(configs: Sequence[str]) -> str | None:
    """The error for positional ``CONFIG.toml`` arguments that name no file (None if
    every one does): which, from which folder, and where the shipped ones are."""
    missing = [c for c in configs if not _is_file(Path(c).expanduser())]
    if not missing:
        return None
    names = ", ".join(repr(c) for c in missing)
    return (
        f"CONFIG.toml {names}: no such file (relative paths are read from {Path.cwd()}); "
        "give a run-config file, such as conf/fedrep_table1.toml of a checkout, or set "
        "keys with --run-config 'KEY=VALUE ...'"
    )


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False where the name cannot be a file's (a long inline
    ``"key=value ..."`` run config exceeds the system's name length: ENAMETOOLONG, which
    ``Path.is_file`` raises)."""
    try:
        return path.is_file()
    except OSError:
        return False


def settings(
    args: argparse.Namespace,
    script: Mapping[str, Any],
    quick: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The run-config keys of a script's runs: ``script`` (its paper experiment), then
    ``quick`` with ``--quick``, then ``--run-config``, then the key flags that were given
    (see the module docstring). ``seed`` is left out: the script sets it per run."""
    values = dict(script)
    if args.quick and quick:
        values.update(quick)
    values.update(run_config_values(args.run_config))
    for name, value in vars(args).items():
        if name.startswith("key_") and value is not None:
            values[name[4:].replace("_", "-")] = value
    values.pop("seed", None)
    return values


def seeds_of(args: argparse.Namespace) -> list[int]:
    """The seeds to run: ``--seed K`` alone, else ``--seeds`` (a seed given by
    ``--run-config`` counts as ``--seed``)."""
    given = run_config_values(args.run_config).get("seed")
    if args.seed is not None:
        return [int(args.seed)]
    if args.seeds is not None:
        return list(args.seeds)
    if given is not None:
        return [int(given)]
    return list(args.quick_seeds if args.quick else args.default_seeds)


def resources(args: argparse.Namespace) -> dict[str, Any]:
    """``LocalSimulation.run`` keyword arguments of ``--cpus-per-client`` and
    ``--gpus-per-client``.

    Raises
    ------
    SystemExit
        On a count below 1 CPU or below 0 GPUs.
    """
    if args.cpus_per_client < 1:
        raise SystemExit("error: --cpus-per-client must be at least 1")
    if args.gpus_per_client < 0:
        raise SystemExit("error: --gpus-per-client must be 0 or more")
    return {"cpus_per_client": args.cpus_per_client, "gpus_per_client": args.gpus_per_client}


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
    """Runs at a time: the --parallel flag, else 3 for --quick, one per core on the
    batched engine (each run is one process), and 1 otherwise."""
    if args.parallel is not None:
        return max(1, int(args.parallel))
    if args.quick:
        return 3
    if getattr(args, "key_engine", None) == "batched":
        return os.cpu_count() or 1
    return 1


def add_in_process_flag(parser: argparse.ArgumentParser) -> None:
    """``--in-process``: a script's runs without Flower's SuperLink and Ray
    (``runs.run_all``)."""
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every run in process, without Flower's SuperLink and Ray: the ServerApp "
        "on an in-process grid of the real ClientApps, the numbers flwr run gives (to "
        "1e-9) without its start-up (--parallel processes at a time)",
    )
