"""Does a client's result depend on the cohort it trains in? Every row, both ways.

    python -m simulations.equality [--rows fedrep,ditto,fedrep-linear] [--out DIR]

For every row of the algorithm table, and every deep row's linear variant on the linear
data set (``<row>-linear``, e.g. ``fedrep-linear``), a small run (one round; two where
state carries over between rounds or the strategy is the row's own) on the batched
engine twice: every client alone
(``cohort_size = 1``, the per-client path, what a device runs) and the whole round as
one cohort, both computed in float64. It compares everything the run leaves: the
global state (``checkpoint.npz``), every client's personal state (each node's
``context.state``), every metric of ``rounds.jsonl`` and ``clients.jsonl``. The largest
relative difference must stay below ``TOLERANCE``; the same comparison in float32 is
reported beside it. Two controls per row: the cohort run again with two clients' seeds
swapped, and with two clients' data swapped, must each differ by more than
``TOLERANCE`` (so the comparison can fail). tests/simulations/test_equality.py runs it
for every row; this script prints the table (and writes DIR/summary.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from fedpers import algorithms
from fedpers.simulations.fedrep_images import NEEDS_BATCH_NORM
from fedpers.simulations.inprocess import InProcessSimulation

TOLERANCE = 1e-5  # relative, float64

PERSONALIZED = {
    "dataset": "mnist1d",
    "num-clients": 8,
    "fraction-train": 0.5,
    "samples-per-client": 40,
    "partitioner": "dirichlet",  # uneven sizes: short last batches, clients done early
    "dirichlet-alpha": 0.5,
    "epochs": 1,
    "head-epochs": 2,
    "finetune-epochs": 1,
    "final-rounds": 1,
}
MIXTURE = {
    "dataset": "mixture",
    "num-clients": 8,
    "samples-per-client": 60,
    "fraction-train": 0.5,
    "lr": 1.0,
    "momentum": 0.0,
    "weight-decay": 0.0,
    "batch-size": 16,
    "epochs": 1,
    "final-rounds": 1,
    "pfedme-lambda": 1.0,
    "pfedme-beta": 1.0,
}
SHEAF = {
    "dataset": "digits",
    "num-clients": 6,
    "fraction-train": 1.0,
    "epochs": 1,
    "batch-size": 32,
    "momentum": 0.9,
    "final-rounds": 1,
    "sheaf-pilot-batch": 16,  # FedMuscle's loss grows as the batch to the power of agents
}
LINEAR = {"dataset": "linear", "num-clients": 12, "fraction-train": 0.5}
VARIANT = "-linear"  # "<row>-linear": a deep row's linear variant, on the linear data


def rows() -> list[str]:
    """Every row of the table, then ``<row>-linear`` for each deep row with a linear
    variant."""
    variants = [s.name + VARIANT for s in algorithms.all_specs() if s.deep and s.linear]
    return [*algorithms.names(), *variants]


def case(row: str) -> dict[str, Any]:
    """The run of ``row`` (a row of the table, or ``<row>-linear``): its family's small
    setting, two rounds where client state carries over or the strategy is the row's
    own, one otherwise."""
    name = row if row in algorithms.names() else row.removesuffix(VARIANT)
    spec = algorithms.get(name)
    linear = not spec.deep or name != row
    strategy = spec.linear.strategy if linear and spec.linear else spec.strategy
    if linear:
        base = dict(LINEAR)
    elif spec.family == "mixture":
        base = dict(MIXTURE)
    elif spec.family == "sheaf":
        base = dict(SHEAF)
        if row in ("fedproto", "fedmuscle"):  # equal latent dimensions
            base["sheaf-latent-dims"] = ",".join(["16"] * 6)
    else:
        base = dict(PERSONALIZED)
        if name in NEEDS_BATCH_NORM:  # it needs BatchNorm layers to keep
            base["model"] = "mnist1d-mlp-bn"
    rounds = 2 if spec.keeps_state or strategy != algorithms.AlgorithmSpec.strategy else 1
    return {**base, "algorithm": name, "num-rounds": rounds}


@contextlib.contextmanager
def swapped(what: str) -> Iterator[None]:
    """Within it, every cohort of two or more trains its first two members with each
    other's seeds (``what = "seed"``) or data (``"data"``): the controls. Both the torch
    updates' ``fedpers.update.Local`` and the linear family's ``LinearLocal`` hand them
    out."""
    from fedpers import update
    from fedpers.families import linear

    with contextlib.ExitStack() as stack:
        for cls in (update.Local, linear.LinearLocal):
            stack.enter_context(_swapped(cls, what))
        yield


@contextlib.contextmanager
def _swapped(cls: type, what: str) -> Iterator[None]:
    """``cls``'s ``generators(...)`` (``what = "seed"``) or its cached ``data``, with
    the first two members' swapped."""
    name = "generators" if what == "seed" else "data"
    original = cls.__dict__[name]
    replacement: Any
    if what == "seed":

        def replacement(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _first_two_swapped(original(self, *args, **kwargs))

    else:
        replacement = property(lambda self: _first_two_swapped(original.func(self)))
    setattr(cls, name, replacement)
    try:
        yield
    finally:
        setattr(cls, name, original)


def _first_two_swapped(items: Any) -> list[Any]:
    mine = list(items)
    if len(mine) > 1:
        mine[0], mine[1] = mine[1], mine[0]
    return mine


def outcome(overrides: Mapping[str, Any], results: Path, **batched: Any) -> dict[str, Any]:
    """One run on the batched engine: its metrics, global state and nodes' states."""
    simulation = InProcessSimulation(batched=batched)
    directory = simulation.run({**overrides, "results-dir": str(results)})
    rounds = [json.loads(line) for line in (directory / "rounds.jsonl").read_text().splitlines()]
    clients_file = directory / "clients.jsonl"
    clients = (
        [json.loads(line) for line in clients_file.read_text().splitlines()]
        if clients_file.exists()
        else []
    )
    with np.load(directory / "checkpoint.npz") as stored:
        state = {k: stored[k] for k in stored.files if not k.startswith("__")}
    assert simulation.grid is not None
    nodes = {}
    for node, context in simulation.grid.contexts.items():
        for key, record in context.state.items():
            if isinstance(record, ArrayRecord):
                for name, array in record.items():
                    nodes[f"{node}/{key}/{name}"] = array.numpy()
    return {"rounds": rounds, "clients": clients, "state": state, "nodes": nodes}


def difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest relative difference between two outcomes: each metric against its
    own size, each array's entries against its largest entry; inf where they do not
    hold the same things."""
    worst = 0.0
    metrics_a, metrics_b = _metrics(a), _metrics(b)
    if metrics_a.keys() != metrics_b.keys():
        return math.inf
    for key, value in metrics_a.items():
        other = metrics_b[key]
        if math.isnan(value) or math.isnan(other):
            if not (math.isnan(value) and math.isnan(other)):
                return math.inf
            continue
        worst = max(worst, abs(value - other) / max(abs(value), 1e-12))
    for group in ("state", "nodes"):
        if a[group].keys() != b[group].keys():
            return math.inf
        for key, value in a[group].items():
            x, y = np.asarray(value, dtype=float), np.asarray(b[group][key], dtype=float)
            if x.shape != y.shape:
                return math.inf
            if x.size:
                worst = max(worst, float(np.max(np.abs(x - y)) / max(np.max(np.abs(x)), 1e-12)))
    return worst


def _metrics(outcome: dict[str, Any]) -> dict[str, float]:
    flat: dict[str, float] = {}
    for record in outcome["rounds"]:
        for section in ("train", "evaluate", "server"):
            for key, value in (record.get(section) or {}).items():
                if "bytes" not in key and isinstance(value, int | float):
                    flat[f"{record['round']}/{section}/{key}"] = float(value)
    for record in outcome["clients"]:
        for partition, metrics in record.get("clients", {}).items():
            for key, value in metrics.items():
                if isinstance(value, int | float):
                    flat[f"{record['round']}/client/{partition}/{key}"] = float(value)
    return flat


def compare(row: str, work: Path) -> dict[str, float]:
    """``row``'s figures: the float64 difference, the float32 one, and the two
    controls' (float64)."""
    overrides = {**case(row), "run-name": row}
    alone = outcome(overrides, work / "alone", cohort_size=1, dtype="float64")
    together = outcome(overrides, work / "together", dtype="float64")
    figures = {"float64": difference(alone, together)}
    figures["float32"] = difference(
        outcome(overrides, work / "alone32", cohort_size=1),
        outcome(overrides, work / "together32"),
    )
    for what in ("seed", "data"):
        with swapped(what):
            control = outcome(overrides, work / f"swapped-{what}", dtype="float64")
        figures[f"{what} swapped"] = difference(alone, control)
    return figures


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows", default="", help="comma-separated rows, <row>-linear too (default: all)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write DIR/summary.json")
    args = parser.parse_args(argv)
    table: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as work:
        for row in [r for r in args.rows.split(",") if r] or rows():
            table[row] = compare(row, Path(work) / row)
            figures = "  ".join(f"{k} {v:.2e}" for k, v in table[row].items())
            print(f"{row:16s} {figures}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(table, indent=1))
    return table


if __name__ == "__main__":
    main(sys.argv[1:])
