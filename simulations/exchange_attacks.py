"""The attack over a run (issue 46): for each comparison row with an exchange of its
own, one client of ten sends the same in-bound attack every round, and the table says
what it cost the honest clients and whether the run went on to its last round.

Per-round bounds cap what one reply can do in one round; state that the server carries
from round to round (SCAFFOLD's control variates, Fed-MTL's stored models, FedProto's
prototypes, Clustered FL's cluster models, pFedMe's and L2GD's global models, the mean
of every client's model that FedEM's pFedMe keeps, FedGMM's components and learners,
FedAMP's stored models, pFedHN's hypernetwork and client embeddings) is what a
patient attacker aims at. Here client 0 of ``CLIENTS`` (every client trains
every round) sends its update sign-flipped and scaled,
``-scale (w - w_t)`` (``fault-injection = "sign-flip=S:0"``), in every round: a reply
inside the update cap (``update-cap`` times the round's median update norm, 100 by
default, against a scale of 10), so that no per-round check refuses it. Each row runs
clean and attacked under each aggregation it accepts (what the aggregation costs
without an attacker, and what it saves with one); an aggregation a row refuses before
start is listed with the reason, not run.

``simulations.robustness`` runs these with its other runs (``--skip-exchanges`` leaves
them out) and writes them under ``exchanges`` in its summary and table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np

from fedpers.aggregation import Aggregation
from fedpers.reports import read_rounds, read_summary
from fedpers.results import RoundRecord, final_mean
from fedpers.strategies.rounds import ROLLED_BACK_TO

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
    "pfedme-fedem": {"dataset": "digits"},
    "fedgmm": {"dataset": "mixture"},
    "fedamp": {"dataset": "digits"},
    "pfedhn": {"dataset": "digits"},
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
    rows: Sequence[str] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, str]]]:
    """The runs (run-config overrides) and, by row and aggregation, the refusals: a
    robust aggregation that the row's configuration check refuses is not run. ``rows``
    (of ``ROWS``, in its order) replaces the default rows.

    Raises
    ------
    SystemExit
        If a row's run under the mean is refused (``values`` or ``rounds`` at fault):
        every run of it would be.
    """
    from fedpers.config import ConfigError
    from fedpers.simulations.launch import resolved_config

    rounds = rounds if rounds is not None else (QUICK_ROUNDS if quick else ROUNDS)
    if rows is None:
        rows = QUICK_ROWS if quick else tuple(ROWS)
    rows = [row for row in ROWS if row in rows]
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
        for attack, aggregation in product(("clean", "sign-flip"), aggregations):
            fault = f"sign-flip={scale:g}:{ATTACKER}" if attack == "sign-flip" else ""
            run = {**base, "aggregation": aggregation.value, "fault-injection": fault}
            try:
                resolved_config({**run, "run-name": "check"})
            except ConfigError as error:
                if aggregation == Aggregation.MEAN:
                    raise SystemExit(f"error: the attack over a run of {row}: {error}") from None
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
    """By row and attack (``clean``, ``sign-flip``): the final accuracy by aggregation,
    the mean over seeds (``accuracy``), the rounds each run completed (``rounds``, the
    fewest over seeds) against those asked (``num_rounds``) and the rounds that went
    back to an earlier state (``went_back``, the most over seeds); ``stopped``, the runs
    that did not finish; ``state_changed``, by aggregation, whether the attack moved the
    final arrays off the clean run's (an attack that reached nothing would leave them
    equal; a run it stopped counts as moved); and ``refused``."""
    table: dict[str, dict[str, Any]] = {}
    folders: dict[tuple[str, str, str, int], Path | None] = {}
    for run, directory in zip(runs, directories, strict=True):
        row, aggregation, seed = run["algorithm"], run["aggregation"], int(run["seed"])
        attack = "sign-flip" if run["fault-injection"] else "clean"
        entry = table.setdefault(row, {"num_rounds": int(run["num-rounds"]), "stopped": []})
        folder = Path(run["results-dir"]) / run["run-name"]
        records = read_rounds(folder) if (folder / "rounds.jsonl").exists() else []
        if directory is not None:
            accuracy = _final_accuracy(read_summary(directory))
        else:
            accuracy = final_mean(records, "evaluate.accuracy", 10)
            entry["stopped"].append(run["run-name"])
        completed = records[-1].round if records else 0
        part = entry.setdefault(attack, {"per_seed": {}, "rounds": {}, "went_back": {}})
        part["per_seed"].setdefault(aggregation, []).append(accuracy)
        rounds = part["rounds"]
        rounds[aggregation] = min(rounds.get(aggregation, completed), completed)
        back = went_back(records)
        part["went_back"][aggregation] = max(part["went_back"].get(aggregation, 0), back)
        folders[(row, attack, aggregation, seed)] = directory
    for row, entry in table.items():
        for attack in ("clean", "sign-flip"):
            part = entry.setdefault(attack, {"per_seed": {}, "rounds": {}, "went_back": {}})
            part["accuracy"] = {a: _mean(v) for a, v in part["per_seed"].items()}
        seeds = {s for (r, _, _, s) in folders if r == row}
        entry["state_changed"] = {
            a: any(
                _moved(folders[(row, "clean", a, s)], folders.get((row, "sign-flip", a, s)))
                for s in seeds
                if (row, "clean", a, s) in folders
            )
            for a in entry["sign-flip"]["accuracy"]
        }
        entry["refused"] = dict(refused.get(row, {}))
    return table


def section(table: Mapping[str, Mapping[str, Any]], scale: float) -> list[str]:
    """table.md's lines for the attack over a run (accuracy in %); none for no runs."""
    from fedpers.simulations.tables import markdown_table

    if not table:
        return []

    aggregations = [a.value for a in Aggregation]
    rows = []
    for row, entry in table.items():
        for attack in ("clean", "sign-flip"):
            part, cells = entry[attack], []
            for aggregation in aggregations:
                if aggregation in part["accuracy"]:
                    accuracy = 100 * part["accuracy"][aggregation]
                    done = part["rounds"][aggregation]
                    stop = "" if done == entry["num_rounds"] else f" (stopped at {done})"
                    back = part["went_back"].get(aggregation, 0)
                    stop += f" (went back in {back} rounds)" if back else ""
                    moved = attack == "clean" or entry["state_changed"].get(aggregation)
                    cells.append(f"{accuracy:.2f}{stop}{'' if moved else ' (state as clean)'}")
                else:
                    cells.append("refused" if aggregation in entry["refused"] else "")
            name = "none" if attack == "clean" else f"sign-flip x{scale:g}"
            rows.append((row, name, *cells))
    return [
        f"# Attacks over a run (client {ATTACKER} of {CLIENTS}, every round; final accuracy, %)",
        "",
        markdown_table(["row", "attack", *aggregations], rows),
    ]


def went_back(records: Sequence[RoundRecord]) -> int:
    """The rounds of a run that went back to an earlier state (every answer refused:
    ``server.rolled-back-to`` in ``rounds.jsonl``)."""
    return sum(ROLLED_BACK_TO in r.server for r in records)


def _moved(clean: Path | None, attacked: Path | None) -> bool:
    """Whether an attacked run ended elsewhere than its clean twin: it stopped, or its
    final arrays differ (False where the clean run itself did not finish)."""
    if clean is None:
        return False
    return attacked is None or _arrays_differ(clean, attacked)


def _final_accuracy(summary: Mapping[str, Any]) -> float:
    """A finished run's final accuracy: the sheaf family's is its agents' accuracy on
    their own test data (``private_accuracy``)."""
    key = "final_accuracy" if "final_accuracy" in summary else "private_accuracy"
    return float(summary[key])


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
