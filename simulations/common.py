"""Shared pieces of the reproduction scripts: flags, settings, seeds and their
statistics, output directory, tables, summaries.

Every script takes the same ways to set a run-config key, applied in this order (a
later one wins): the script's settings for its paper experiment, its ``--quick``
settings, ``--run-config`` (Flower's ``"key=value ..."`` syntax or a TOML file, as often
as wanted), and the script's own flags, each named after its key (``--num-rounds``).
"""

from __future__ import annotations

import argparse
import difflib
import math
import shutil
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedpers.results import write_json

SUMMARY = "summary.json"


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
    description: str, *, seeds: str = "1", quick_seeds: str = "1"
) -> argparse.ArgumentParser:
    """An argument parser with the flags every reproduction script takes; ``seeds`` is
    the script's default ``--seeds``, ``quick_seeds`` its default with ``--quick``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--seeds",
        type=parse_seeds,
        default=None,
        help="seeds to run every experiment with: a count (3 = seeds 0,1,2) or a list "
        f"(0,1,2); tables give the mean, std and 95%% interval over them (default: {seeds}; "
        f"with --quick: {quick_seeds})",
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
        if item.endswith(".toml") or path.is_file():
            try:
                with path.open("rb") as handle:
                    table = tomllib.load(handle)
            except (OSError, tomllib.TOMLDecodeError) as error:
                raise SystemExit(f"error: --run-config {item}: {error}") from None
            table = table.get("tool", {}).get("flwr", {}).get("app", {}).get("config", table)
            given = {k: v for k, v in table.items() if k != "description"}
        else:
            try:
                given = parse_config_args([item])
            except Exception as error:  # Flower raises ValueError or tomli's error
                raise SystemExit(
                    f"error: --run-config '{item}' is not Flower's \"key=value ...\" syntax "
                    f"({error}); quote strings inside: \"dataset='digits' num-rounds=20\""
                ) from None
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


# ------------------------------------------------------------------- statistics
def seed_statistics(values: Sequence[float]) -> tuple[float, float, list[float]]:
    """Mean, sample standard deviation and the 95% interval of the mean (Student's t,
    ``n - 1`` degrees of freedom) of per-seed values. With one value the std and the
    interval are NaN (written as null): one seed says nothing about the spread.
    Missing values (None, NaN) are left out."""
    kept = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not kept:
        return math.nan, math.nan, [math.nan, math.nan]
    mean = math.fsum(kept) / len(kept)
    if len(kept) < 2:
        return mean, math.nan, [math.nan, math.nan]
    from scipy import stats

    std = math.sqrt(math.fsum((v - mean) ** 2 for v in kept) / (len(kept) - 1))
    half = float(stats.t.ppf(0.975, len(kept) - 1)) * std / math.sqrt(len(kept))
    return mean, std, [mean - half, mean + half]


def add_statistics(
    summary: dict[str, Any], name: str, per_seed: Any, *, per_seed_key: str | None = None
) -> None:
    """Set ``summary[name]`` to the means of ``per_seed`` (a list of per-seed values,
    or nested dicts of such lists) and add its companions ``NAME_std``, ``NAME_ci95``
    (``[low, high]``) and the per-seed lists (``per_seed_key``, default
    ``NAME_per_seed``), with the same nesting."""

    def walk(tree: Any, index: int) -> Any:
        if isinstance(tree, Mapping):
            return {k: walk(v, index) for k, v in tree.items()}
        return seed_statistics(tree)[index]

    summary[name] = walk(per_seed, 0)
    summary[f"{name}_std"] = walk(per_seed, 1)
    summary[f"{name}_ci95"] = walk(per_seed, 2)
    summary[per_seed_key or f"{name}_per_seed"] = per_seed


def with_spread(mean: float, std: float, scale: float = 100.0, digits: int = 2) -> str:
    """``84.72 ± 0.31`` (``scale`` times the values; the mean alone for one seed)."""
    if mean is None or math.isnan(mean):
        return "n/a"
    if std is None or math.isnan(std):
        return f"{scale * mean:.{digits}f}"
    return f"{scale * mean:.{digits}f} ± {scale * std:.{digits}f}"


def interval(bounds: Sequence[float] | None, scale: float = 100.0, digits: int = 2) -> str:
    """``[84.1, 85.3]``, or ``n/a`` without one (a single seed)."""
    if not bounds or bounds[0] is None or math.isnan(bounds[0]):
        return "n/a"
    return f"[{scale * bounds[0]:.{digits}f}, {scale * bounds[1]:.{digits}f}]"


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (numpy's linear interpolation); NaN without values."""
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else math.nan


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
    """Validate every run config, and that its data can be read, before anything
    starts (clear error, no Flower or Ray start-up)."""
    from fedpers.simulations.launch import resolved_config

    from fedpers.config import ConfigError
    from fedpers.data.sources import DatasetNotFound, check_data_source

    checked: set[tuple[str, str]] = set()
    for overrides in runs:
        try:
            config = resolved_config(overrides)
        except ConfigError as error:
            raise SystemExit(f"error: {error}") from error
        if config.tensorboard:
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                raise SystemExit(
                    "error: run-config key 'tensorboard' = true needs the tensorboard "
                    "package: pip install -e '.[tensorboard]'"
                ) from None
        source = (config.dataset, config.data_root)
        if source not in checked:
            checked.add(source)
            try:
                check_data_source(*source)
            except DatasetNotFound as error:
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


# ------------------------------------------------------------- methods x seeds
def run_methods(
    args: argparse.Namespace,
    values: Mapping[str, Any],
    methods: Sequence[str],
    seeds: Sequence[int],
    *,
    algorithm: Mapping[str, str] | None = None,
    shared: Mapping[str, str] | None = None,
) -> dict[tuple[str, int], Path]:
    """Run every method with every seed (``runs/METHOD-seedK``) and return the run
    directories by (method, seed). ``algorithm`` maps a method to the algorithm it runs
    (default: itself); a method in ``shared`` takes the run of another method (FedAvg's
    numbers come from the FedAvg+FT run). Validates every run, and that ``--out`` may be
    written, before the SuperLink starts."""
    from fedpers.simulations.launch import LocalSimulation

    root = args.out.expanduser().resolve() / "runs"
    algorithm = algorithm or {}
    shared = {m: s for m, s in (shared or {}).items() if s in methods}
    keys = [(m, seed) for seed in seeds for m in methods if m not in shared]
    runs = [
        {
            **values,
            "algorithm": algorithm.get(m, m),
            "seed": seed,
            "results-dir": str(root),
            "run-name": f"{m}-seed{seed}",
        }
        for m, seed in keys
    ]
    validate_runs(runs)
    kwargs = resources(args)
    prepare_output(args.out, overwrite=args.overwrite)
    with LocalSimulation() as simulation:
        done = simulation.run_all(runs, parallel=parallelism(args), **kwargs)
    directories = dict(zip(keys, done, strict=True))
    for method, source in shared.items():
        for seed in seeds:
            directories[(method, seed)] = directories[(source, seed)]
    return directories


def method_summary(
    methods: Sequence[str],
    seeds: Sequence[int],
    figures: Mapping[str, Mapping[tuple[str, int], float]],
    clients: Mapping[str, Mapping[str, float]],
    directories: Mapping[tuple[str, int], Path],
) -> dict[str, Any]:
    """The summary of a methods x seeds table.

    ``figures[NAME][(method, seed)]`` are the per-seed figures (the first is the
    table's main one: ``final_accuracy``); each becomes ``NAME`` (mean over seeds) with
    ``NAME_std``, ``NAME_ci95`` and ``NAME_per_seed`` (``final_accuracy``'s per-seed
    lists are ``per_seed``). ``clients[method]`` are the first seed's final per-client
    accuracies: ``per_client``, ``client_p10`` and ``client_std`` (over clients).
    Communication (``megabytes_total``: training messages sent and received, all rounds;
    evaluation messages are not counted) and
    ``wall_seconds`` are seed means from the runs' summaries.
    """
    from fedpers.results import read_summary

    summary: dict[str, Any] = {"seeds": list(seeds), "methods": list(methods)}
    for name, values in figures.items():
        add_statistics(
            summary,
            name,
            {m: [values.get((m, s)) for s in seeds] for m in methods},
            per_seed_key="per_seed" if name == "final_accuracy" else None,
        )
    summary["per_client"] = {m: clients.get(m, {}) for m in methods}
    summary["client_p10"] = {m: percentile(list(clients.get(m, {}).values()), 10) for m in methods}
    summary["client_std"] = {m: _population_std(list(clients.get(m, {}).values())) for m in methods}
    runs = {key: read_summary(directory) for key, directory in directories.items()}
    summary["megabytes_total"] = {
        m: _mean([runs[(m, s)].get("megabytes_total") for s in seeds]) for m in methods
    }
    summary["wall_seconds"] = {
        m: _mean([runs[(m, s)].get("wall_seconds") for s in seeds]) for m in methods
    }
    return summary


def method_table(summary: Mapping[str, Any], figures: Sequence[tuple[str, str]]) -> str:
    """A markdown table of ``method_summary``: per method, each figure (``(name,
    label)``, in %) as mean ± std with its 95% interval, then the clients' 10th
    percentile and spread (first seed), megabytes sent and received, wall seconds."""
    header = ["method"]
    for _, label in figures:
        header += [f"{label} (%)", "95% interval"]
    header += ["clients p10 (%)", "clients std (%)", "MB trained", "wall s"]
    rows = []
    for m in summary["methods"]:
        row: list[Any] = [m]
        for name, _ in figures:
            row += [
                with_spread(summary[name][m], summary[f"{name}_std"][m]),
                interval(summary[f"{name}_ci95"][m]),
            ]
        row += [
            _percent(summary["client_p10"][m]),
            _percent(summary["client_std"][m]),
            summary["megabytes_total"][m],
            summary["wall_seconds"][m],
        ]
        rows.append(row)
    return markdown_table(header, rows)


def seeds_note(seeds: Sequence[int]) -> str:
    """What a table's spread is over."""
    if len(seeds) == 1:
        return f"One seed ({seeds[0]}): no spread over seeds; pass --seeds 3 for one."
    return (
        f"Mean ± sample std over seeds {', '.join(map(str, seeds))}; 95% interval of the mean "
        f"by Student's t ({len(seeds) - 1} degrees of freedom). Clients' 10th percentile and "
        f"std: final per-client accuracies of seed {seeds[0]}."
    )


def plot_seeded(
    curves: Mapping[str, Sequence[Sequence[Any]]],
    metric: str,
    path: Path,
    *,
    title: str = "",
    scale: float = 100.0,
    ylabel: str = "",
) -> None:
    """One line per method: the mean over seeds of ``metric`` per round, shaded
    ± one std where there are several seeds (``curves[method]`` = each seed's round
    records); values times ``scale`` (100: in %, as the tables)."""
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np
    from matplotlib import pyplot as plt

    from fedpers.results import metric_value

    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    for label, runs in curves.items():
        by_round: dict[int, list[float]] = {}
        for records in runs:
            for record in records:
                value = metric_value(record, metric)
                if not math.isnan(value):
                    by_round.setdefault(record.round, []).append(scale * value)
        if not by_round:
            continue
        rounds = sorted(by_round)
        means = np.array([np.mean(by_round[r]) for r in rounds])
        (line,) = axes.plot(rounds, means, label=label)
        if len(runs) > 1:
            spread = np.array(
                [np.std(by_round[r], ddof=1) if len(by_round[r]) > 1 else 0.0 for r in rounds]
            )
            axes.fill_between(
                rounds, means - spread, means + spread, color=line.get_color(), alpha=0.2
            )
    axes.set_xlabel("round")
    axes.set_ylabel(ylabel or metric.split(".", 1)[-1] + (" (%)" if scale == 100 else ""))
    if title:
        axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_client_cdf(
    per_client: Mapping[str, Mapping[str, float]], path: Path, *, title: str = ""
) -> None:
    """The distribution of final per-client accuracy per method: empirical CDFs (in %),
    the 10th percentile marked."""
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    for method, clients in per_client.items():
        values = np.sort(100 * np.asarray(list(clients.values()), dtype=float))
        if values.size == 0:
            continue
        fractions = np.arange(1, values.size + 1) / values.size
        axes.step(values, fractions, where="post", label=method)
    axes.axhline(0.1, color="grey", lw=0.8, ls="--")
    axes.set_xlabel("final accuracy of a client (%)")
    axes.set_ylabel("fraction of clients at or below")
    if title:
        axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _mean(values: Sequence[Any]) -> float:
    kept = [float(v) for v in values if v is not None]
    return math.fsum(kept) / len(kept) if kept else math.nan


def _population_std(values: Sequence[float]) -> float:
    if not values:
        return math.nan
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


def _percent(value: float) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{100 * value:.2f}"
