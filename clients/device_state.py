"""Keep a node's ``context.state`` on the device's disk, across restarts and resumes.

Flower holds ``context.state`` in the SuperNode's memory (in simulation: the simulation
engine's): a SuperNode that crashes or is killed loses its personal parts (FedRep's head,
FedGMM's weights, a Sheaf-FRL agent), and so does every node of a simulation that is
stopped and resumed. With a state directory (node config ``state-dir`` on a device, or
run config ``client-state-dir`` in simulation) the ClientApp writes the state after each
training round to ``<dir>/<run>-<token>-partition-<id>-round-<r>.npz`` (fsynced, then
renamed into place; the last two rounds are kept) and a node whose state is empty
restores the newest readable snapshot older than the round it is asked to work on, so a
resumed run continues from exactly the state its checkpoint saw. ``<run>`` is the run
name (or ``run-<id>`` without one) and ``<token>`` the run's identity, sent by the
server (a fresh run gets a new one, a resumed run keeps it): a new run never sees
another run's state, even under the same name.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context

from fedpers import protocol, records
from fedpers.atomic import save_npz
from fedpers.config import RunConfig

logger = logging.getLogger(__name__)
META = protocol.STATE_META
ROUNDS_TRAINED = protocol.STATE_ROUNDS_TRAINED
KEEP = 2


def _directory(run: RunConfig, context: Context) -> Path | None:
    directory = context.node_config.get(protocol.NODE_STATE_DIR) or run.client_state_dir
    return Path(str(directory)) if directory else None


def _stem(run: RunConfig, context: Context, token: str) -> str:
    """The file-name stem of this run's snapshots of this node: the run name, the run's
    token (a fresh run's identity, kept when it is resumed), the partition."""
    name = run.run_name or f"run-{context.run_id}"
    partition = context.node_config.get(protocol.NODE_PARTITION_ID, "x")
    return f"{name}-{token or 'untagged'}-partition-{partition}"


def snapshots(run: RunConfig, context: Context, token: str = "") -> dict[int, Path]:
    """This node's saved snapshots of this run, by round; other runs' are not seen."""
    directory = _directory(run, context)
    if directory is None or not directory.exists():
        return {}
    pattern = re.compile(re.escape(_stem(run, context, token)) + r"-round-(\d+)\.npz$")
    found = {}
    for path in directory.iterdir():
        if match := pattern.match(path.name):
            found[int(match.group(1))] = path
    return found


def restore(run: RunConfig, context: Context, *, before_round: int, token: str = "") -> bool:
    """Fill an empty ``context.state`` from the newest readable snapshot of a round
    before ``before_round``; True if something was restored. A damaged snapshot (cut
    short by a crash) is skipped with a warning, and the one before it is used."""
    if len(context.state) > 0:
        return False
    found = snapshots(run, context, token)
    for server_round in sorted((r for r in found if r < before_round), reverse=True):
        try:
            arrays, configs = _read(found[server_round])
        except Exception as error:
            logger.warning(
                "snapshot %s is damaged (%s); trying the one before it",
                found[server_round],
                type(error).__name__,
            )
            continue
        for record, values in arrays.items():
            context.state[record] = ArrayRecord(values)
        for record, items in configs.items():
            context.state[record] = ConfigRecord(items)
        return True
    return False


def _read(path: Path) -> tuple[dict[str, dict[str, Array]], dict[str, dict[str, Any]]]:
    with np.load(path, allow_pickle=False) as stored:
        configs = json.loads(str(stored["__configs__"])) if "__configs__" in stored.files else {}
        arrays: dict[str, dict[str, Array]] = {}
        for key in stored.files:
            if key.startswith("a|"):
                _, record, name = key.split("|", 2)
                arrays.setdefault(record, {})[name] = Array(np.ascontiguousarray(stored[key]))
    return arrays, configs


def persist(run: RunConfig, context: Context, *, server_round: int, token: str = "") -> None:
    """Snapshot ``context.state`` after ``server_round`` (no-op without a directory),
    fsynced before it replaces anything; the last ``KEEP`` of this run are kept."""
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
    path = directory / f"{_stem(run, context, token)}-round-{server_round}.npz"
    save_npz(path, payload)
    kept = snapshots(run, context, token)
    for old in sorted(kept)[:-KEEP]:
        kept[old].unlink(missing_ok=True)


def count_round(context: Context) -> int:
    """Count one more training round in the node's state; return the count."""
    meta = context.state.get(META)
    count = records.integer(meta[ROUNDS_TRAINED]) + 1 if isinstance(meta, ConfigRecord) else 1
    context.state[META] = ConfigRecord({ROUNDS_TRAINED: count})
    return count
