"""Keep a node's ``context.state`` on the device's disk, across SuperNode restarts.

Flower holds ``context.state`` in the SuperNode's memory: a SuperNode that crashes or is
killed loses its personal parts (FedRep's head, FedGMM's weights, a Sheaf-FRL agent).
When the node config has ``state-dir`` (``--node-config "... state-dir='/var/lib/fedpers'"``),
the ClientApp writes the state to ``<state-dir>/run-<run id>-partition-<id>.npz`` after
each training round (atomically) and restores it when a fresh SuperNode of the same run
finds its state empty. A new run never sees another run's state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context

STATE_DIR = "state-dir"
META = "fedpers.meta"
ROUNDS_TRAINED = "rounds-trained"


def state_file(context: Context) -> Path | None:
    """Where this node keeps its state, or None without ``state-dir``."""
    directory = context.node_config.get(STATE_DIR)
    if not directory:
        return None
    partition = context.node_config.get("partition-id", "x")
    return Path(str(directory)) / f"run-{context.run_id}-partition-{partition}.npz"


def restore(context: Context) -> bool:
    """Fill an empty ``context.state`` from the device; True if something was restored."""
    path = state_file(context)
    if path is None or not path.exists() or len(context.state) > 0:
        return False
    with np.load(path, allow_pickle=False) as stored:
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


def persist(context: Context) -> None:
    """Write ``context.state`` to the device (no-op without ``state-dir``)."""
    path = state_file(context)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    payload: dict[str, np.ndarray] = {}
    for record, values in context.state.array_records.items():
        for name, array in values.items():
            payload[f"a|{record}|{name}"] = array.numpy()
    configs = {name: dict(values) for name, values in context.state.config_records.items()}
    payload["__configs__"] = np.array(json.dumps(configs))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as handle:
        np.savez(handle, **payload)  # type: ignore[arg-type]  # numpy stubs: **kwargs
    os.replace(tmp, path)


def count_round(context: Context) -> int:
    """Count one more training round in the node's state; return the count."""
    meta = context.state.get(META)
    count = int(meta[ROUNDS_TRAINED]) + 1 if isinstance(meta, ConfigRecord) else 1  # type: ignore[arg-type]
    context.state[META] = ConfigRecord({ROUNDS_TRAINED: count})
    return count
