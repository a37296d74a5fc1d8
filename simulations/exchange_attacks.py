"""The attack over a run (issue 46): for each comparison row with an exchange of its
own, one client of ten sends the same in-bound attack every round, and the table says
what it cost the honest clients and whether the run went on to its last round.

Per-round bounds cap what one reply can do in one round; state that the server carries
from round to round (SCAFFOLD's control variates, Fed-MTL's stored models, FedProto's
prototypes, Clustered FL's cluster models, pFedMe's and L2GD's global models, FedGMM's
components and learners) is what a patient attacker aims at. Here client 0 of
``CLIENTS`` (every client trains every round) sends its update sign-flipped and scaled,
``-scale (w - w_t)`` (``fault-injection = "sign-flip=S:0"``), in every round: a reply
inside the update cap (``update-cap`` times the round's median update norm, 100 by
default, against a scale of 10), so that no per-round check refuses it. Each row runs
clean (the mean) and attacked under each aggregation it accepts; an aggregation a row
refuses before start is listed with the reason, not run.

``simulations.robustness`` runs these with its other runs (``--skip-exchanges`` leaves
them out) and writes them under ``exchanges`` in its summary and table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedpers.aggregation import Aggregation
from fedpers.reports import read_rounds, read_summary
from fedpers.results import final_mean

CLIENTS = 10
ATTACKER = 0
ROUNDS = 50
QUICK_ROUNDS = 2
# Each row on the data its family trains on here: digits for the personalized and
# sheaf rows (FedProto's agents with one latent width, which its prototypes need), the
# synthetic Gaussian mixtures for FedGMM.
ROWS: dict[str, dict[str, Any]] = {
    "scaffold": {"dataset": "digits"},
    "fed-mtl": {"dataset": "digits"},
    "fedproto": {"dataset": "digits", "sheaf-latent-dims": ",".join(["8"] * CLIENTS)},
    "clustered-fl": {"dataset": "digits"},
    "pfedme": {"dataset": "digits"},
    "l2gd": {"dataset": "digits"},
    "fedgmm": {"dataset": "mixture"},
}
QUICK_ROWS = ("scaffold",)
QUICK_AGGREGATIONS = (Aggregation.MEAN, Aggregation.MEDIAN)


def plan(
    *,
    quick: bool,
    scale: float,
    runs_dir: Path,
    seeds: Sequence[int],
    values: Mapping[str, Any] | None = None,
    rounds: int | None = None,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, str]]]:
    """The runs (run-config overrides) and, by row and aggregation, the refusals: an
    aggregation that the row's configuration check refuses is not run."""
    from fedpers.config import ConfigError
    from fedpers.simulations.launch import resolved_config

    rounds = rounds or (QUICK_ROUNDS if quick else ROUNDS)
    rows = QUICK_ROWS if quick else tuple(ROWS)
    aggregations = QUICK_AGGREGATIONS if quick else tuple(Aggregation)
    runs: list[dict[str, Any]] = []
    refused: dict[str, dict[str, str]] = {}
    for row in rows:
        base = {
            "algorithm": row,
            **ROWS[row],
            "num-clients": CLIENTS,
            "fraction-train": 1.0,
            "num-rounds": rounds,
            "final-rounds": min(rounds, 10),
            "results-dir": str(runs_dir),
            **(values or {}),
        }
        cases = [("clean", Aggregation.MEAN)] + [("sign-flip", a) for a in aggregations]
        for attack, aggregation in cases:
            fault = f"sign-flip={scale:g}:{ATTACKER}" if attack == "sign-flip" else ""
            run = {**base, "aggregation": aggregation.value, "fault-injection": fault}
            try:
                resolved_config({**run, "run-name": "check"})
            except ConfigError as error:
                refused.setdefault(row, {})[aggregation.value] = str(error)
                continue
            for seed in seeds:
                name = f"exchange-{row}-{attack}-{aggregation.value}-seed{seed}"
                runs.append({**run, "seed": seed, "run-name": name})
    return runs, refused


def summarize(
    runs: Sequence[Mapping[str, Any]],
    directories: Sequence[Path | None],
    refused: Mapping[str, Mapping[str, str]],
) -> dict[str, dict[str, Any]]:
    """By row: the clean run's final accuracy (``clean``), the attacked runs' by
    aggregation (``sign-flip``), each the mean over seeds; the rounds each attacked run
    completed (``rounds``, the fewest over seeds) against those asked (``num_rounds``);
    ``stopped``, the runs that did not finish; ``state_changed``, whether the attack
    moved the attacked mean run's final arrays off the clean run's (an attack that
    reached nothing would leave them equal); and ``refused``."""
    table: dict[str, dict[str, Any]] = {}
    finals: dict[tuple[str, str, int], Path | None] = {}
    for run, directory in zip(runs, directories, strict=True):
        row, aggregation, seed = run["algorithm"], run["aggregation"], int(run["seed"])
        attack = "sign-flip" if run["fault-injection"] else "clean"
        entry = table.setdefault(row, {"num_rounds": int(run["num-rounds"]), "stopped": []})
        folder = Path(run["results-dir"]) / run["run-name"]
        records = read_rounds(folder) if (folder / "rounds.jsonl").exists() else []
        if directory is not None:
            accuracy = float(read_summary(directory)["final_accuracy"])
        else:
            accuracy = final_mean(records, "evaluate.accuracy", 10)
            entry["stopped"].append(run["run-name"])
        completed = records[-1].round if records else 0
        if attack == "clean":
            entry.setdefault("clean_per_seed", []).append(accuracy)
        else:
            entry.setdefault("per_seed", {}).setdefault(aggregation, []).append(accuracy)
            rounds = entry.setdefault("rounds", {})
            rounds[aggregation] = min(rounds.get(aggregation, completed), completed)
        if aggregation == Aggregation.MEAN.value:
            finals[(row, attack, seed)] = directory
    for row, entry in table.items():
        entry["clean"] = _mean(entry.get("clean_per_seed", []))
        entry["sign-flip"] = {a: _mean(v) for a, v in entry.get("per_seed", {}).items()}
        pairs = [
            (finals.get((row, "clean", s)), finals.get((row, "sign-flip", s)))
            for (r, attack, s) in finals
            if r == row and attack == "clean"
        ]
        entry["state_changed"] = any(
            clean is not None and flipped is not None and _arrays_differ(clean, flipped)
            for clean, flipped in pairs
        )
        entry["refused"] = dict(refused.get(row, {}))
    return table


def section(table: Mapping[str, Mapping[str, Any]], scale: float) -> list[str]:
    """table.md's lines for the attack over a run (accuracy in %)."""
    from fedpers.simulations.tables import markdown_table

    aggregations = [a.value for a in Aggregation]
    rows = []
    for row, entry in table.items():
        flipped = entry["sign-flip"]
        cells = []
        for aggregation in aggregations:
            if aggregation in flipped:
                done = entry["rounds"][aggregation]
                cells.append(f"{100 * flipped[aggregation]:.2f} ({done}/{entry['num_rounds']})")
            else:
                cells.append("refused" if aggregation in entry["refused"] else "not run")
        rows.append((row, f"{100 * entry['clean']:.2f}", *cells, entry["state_changed"]))
    return [
        f"# Attacks over a run (client {ATTACKER} of {CLIENTS} sends sign-flip x{scale:g} "
        "every round; final accuracy %, rounds completed)",
        "",
        markdown_table(["row", "clean (mean)", *aggregations, "attack moved the state"], rows),
    ]


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def _arrays_differ(first: Path, second: Path) -> bool:
    """Whether two runs' final checkpoints hold different arrays."""
    with np.load(first / "checkpoint.npz") as a, np.load(second / "checkpoint.npz") as b:
        names = sorted(n for n in a.files if not n.startswith("__"))
        if names != sorted(n for n in b.files if not n.startswith("__")):
            return True
        return any(
            a[n].shape != b[n].shape or not np.array_equal(a[n], b[n], equal_nan=True)
            for n in names
        )
