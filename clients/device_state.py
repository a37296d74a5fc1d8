"""Keep a node's ``context.state`` on the device's disk, across restarts and resumes.

Flower holds ``context.state`` in the SuperNode's memory (in simulation: the simulation
engine's): a SuperNode that crashes or is killed loses its personal parts (FedRep's head,
FedGMM's weights, a Sheaf-FRL agent), and so does every node of a simulation that is
stopped and resumed. With a state directory (node config ``state-dir`` on a device, or
run config ``client-state-dir`` in simulation) the ClientApp writes the state after each
training round to ``<dir>/<run>-partition-<id>-round-<r>.npz`` (atomically; the last two
rounds are kept) and a node whose state is empty restores the newest snapshot older than
the round it is asked to work on, so a resumed run continues from exactly the state its
checkpoint saw. ``<run>`` is the run name (or ``run-<id>`` without one): a new run never
sees another run's state.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context

from fedpers import protocol
from fedpers.config import RunConfig

META = protocol.STATE_META
ROUNDS_TRAINED = protocol.STATE_ROUNDS_TRAINED
KEEP = 2


def _directory(run: RunConfig, context: Context) -> Path | None:
    directory = context.node_config.get(protocol.NODE_STATE_DIR) or run.client_state_dir
    return Path(str(directory)) if directory else None


def _stem(run: RunConfig, context: Context) -> str:
    name = run.run_name or f"run-{context.run_id}"
    partition = context.node_config.get(protocol.NODE_PARTITION_ID, "x")
    return f"{name}-partition-{partition}"


def snapshots(run: RunConfig, context: Context) -> dict[int, Path]:
    """This node's saved snapshots by round."""
    directory = _directory(run, context)
    if directory is None or not directory.exists():
        return {}
    pattern = re.compile(re.escape(_stem(run, context)) + r"-round-(\d+)\.npz$")
    found = {}
    for path in directory.iterdir():
        if match := pattern.match(path.name):
            found[int(match.group(1))] = path
    return found


def restore(run: RunConfig, context: Context, *, before_round: int) -> bool:
    """Fill an empty ``context.state`` from the newest snapshot of a round before
    ``before_round``; True if something was restored."""
    if len(context.state) > 0:
        return False
    found = snapshots(run, context)
    older = [r for r in found if r < before_round]
    if not older:
        return False
    with np.load(found[max(older)], allow_pickle=False) as stored:
        configs = json.loads(str(stored["__configs__"])) if "__configs__" in stored.files else {}
        arrays: dict[str, dict[str, Array]] = {}
        for key in stored.files:
            if key.startswith("a|"):
                _, record, name = key.split("|", 2)
                arrays.setdefault(record, {})[name] = Array(np.ascontiguousarray(stored[key]))
    for record, values in arrays.items():
        context.state[record] = ArrayRecord(values)
    for record, values in configs.items():
        context.state[record] = ConfigRecord(values)
    return True


def persist(run: RunConfig, context: Context, *, server_round: int) -> None:
    """Snapshot ``context.state`` after ``server_round`` (no-op without a directory)."""
    directory = _directory(run, context)
    if directory is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    payload: dict[str, np.ndarray] = {}
    for record, values in context.state.array_records.items():
        for name, array in values.items():
            payload[f"a|{record}|{name}"] = array.numpy()
    configs = {name: dict(values) for name, values in context.state.config_records.items()}
    payload["__configs__"] = np.array(json.dumps(configs))
    path = directory / f"{_stem(run, context)}-round-{server_round}.npz"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as handle:
        np.savez(handle, **payload)  # type: ignore[arg-type]  # numpy stubs: **kwargs
    os.replace(tmp, path)
    kept = snapshots(run, context)
    for old in sorted(kept)[:-KEEP]:
        kept[old].unlink(missing_ok=True)


def count_round(context: Context) -> int:
    """Count one more training round in the node's state; return the count."""
    meta = context.state.get(META)
    count = int(meta[ROUNDS_TRAINED]) + 1 if isinstance(meta, ConfigRecord) else 1  # type: ignore[arg-type]
    context.state[META] = ConfigRecord({ROUNDS_TRAINED: count})
    return count
