"""What a run's results may be published as (run-config key ``publish-dir``).

A run's results directory is its operator's: ``rounds.jsonl`` records each round's
sampled, replying and failing counts and names the partitions it left out,
``clients.jsonl`` every client's own figures, ``checkpoint.npz`` the round each
partition last trained in, the Flower log the partitions by id. In a private run
(``dp``) the sample is secret: those say who took part, which the guarantee does not
cover (publishing the per-round counts of a 20-client central run beside its model
gives an epsilon of at least 1.366 where 0.999 is reported: issue 43).

With ``publish-dir`` set, a finished run also writes ``<publish-dir>/<run-name>/``
with the set that may be published alone, from an allow-list:

- ``final_arrays.npz``: the shared parts of the final model (the last release);
- ``curves.jsonl``: per round, the evaluation's ``accuracy`` and ``loss`` (over every
  seen client, whoever trained) and, in a private run, the epsilon spent and the
  releases it counts (and the clip of an adaptive clip: a noised release);
- ``summary.json``: ``algorithm``, ``rounds``, ``final_accuracy`` and ``privacy`` (the
  mechanism as recorded and its epsilon: everything another accountant needs).

Nothing else: no counts of who was sampled or replied, no rejections, no per-client
rows, no timings or byte counts (both grow with the cohort), no training metrics
(means over the sampled clients).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedpers import privacy
from fedpers.atomic import save_npz, write_text
from fedpers.results import RoundRecord, write_json

SUMMARY_KEYS = ("algorithm", "rounds", "final_accuracy", "privacy")
CURVE_METRICS = ("accuracy", "loss")  # evaluation figures of the model, not of who answered
CURVE_SERVER = {
    privacy.EPSILON: "epsilon",
    privacy.RELEASES: "releases",
    privacy.CLIP: "clip",
}
CURVES_FILE = "curves.jsonl"
FILES = ("final_arrays.npz", CURVES_FILE, "summary.json")


def curve(record: RoundRecord) -> dict[str, Any]:
    """The publishable line of one round."""
    line: dict[str, Any] = {"round": record.round}
    evaluate = {k: record.evaluate[k] for k in CURVE_METRICS if k in record.evaluate}
    if evaluate:
        line["evaluate"] = evaluate
    for key, name in CURVE_SERVER.items():
        if key in record.server:
            line[name] = record.server[key]
    return _finite(line)


def _finite(value: Any) -> Any:
    """``value`` with every non-finite number as None (JSON has none; an epsilon without
    noise is infinite)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_published(
    target: Path,
    records: Iterable[RoundRecord],
    summary: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
) -> None:
    """Write the publishable set of a finished run to ``target`` (each file replaced
    atomically)."""
    target.mkdir(parents=True, exist_ok=True)
    save_npz(target / "final_arrays.npz", dict(arrays))
    lines = (json.dumps(curve(r), sort_keys=True, allow_nan=False) + "\n" for r in records)
    write_text(target / CURVES_FILE, "".join(lines))
    write_json(target / "summary.json", {k: summary[k] for k in SUMMARY_KEYS if k in summary})
