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

A snapshot also holds its binding, the token, partition and round it was written for,
and a node restores only a snapshot whose binding matches its file name: a snapshot
renamed, swapped in from another partition, copied from another run or moved to another
round is refused with ``SnapshotError``, never restored. A resumed run's server asks
every node to restore before its first round (``query.snapshot``,
strategies/resume.py), so such a snapshot, or a missing one, refuses the resume.
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
BINDING = "__binding__"  # the token, partition and round a snapshot was written for


class SnapshotError(ValueError):
    """A snapshot that is not this node's of its run and round; the message names the
    file and the fix."""


def _directory(run: RunConfig, context: Context) -> Path | None:
    directory = context.node_config.get(protocol.NODE_STATE_DIR) or run.client_state_dir
    return Path(str(directory)) if directory else None


def _partition(context: Context) -> str:
    return str(context.node_config.get(protocol.NODE_PARTITION_ID, "x"))


def _stem(run: RunConfig, context: Context, token: str) -> str:
    """The file-name stem of this run's snapshots of this node: the run name, the run's
    token (a fresh run's identity, kept when it is resumed), the partition."""
    name = run.run_name or f"run-{context.run_id}"
    return f"{name}-{token or 'untagged'}-partition-{_partition(context)}"


def _binding(context: Context, token: str, server_round: int) -> dict[str, Any]:
    return {"token": token, "partition": _partition(context), "round": server_round}


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


def restore(run: RunConfig, context: Context, *, before_round: int, token: str = "") -> int:
    """Fill an empty ``context.state`` from the newest readable snapshot of a round
    before ``before_round``; the round restored, 0 if none (or the state was not
    empty). A damaged snapshot (cut short) is skipped with a warning, and the one before
    it is used.

    Raises
    ------
    SnapshotError
        If that snapshot was not written for this node's partition, run and round.
    """
    if len(context.state) > 0:
        return 0
    found = snapshots(run, context, token)
    for server_round in sorted((r for r in found if r < before_round), reverse=True):
        path = found[server_round]
        try:
            arrays, configs, binding = _read(path)
        except Exception as error:
            logger.warning(
                "snapshot %s is damaged (%s); trying the one before it",
                path,
                type(error).__name__,
            )
            continue
        _check_binding(path, binding, _binding(context, token, server_round))
        for record, values in arrays.items():
            context.state[record] = ArrayRecord(values)
        for record, items in configs.items():
            context.state[record] = ConfigRecord(items)
        return server_round
    return 0


WRITTEN = {"partition": "for partition {}", "token": "by another run (token '{}')"}


def _check_binding(path: Path, binding: object, expected: dict[str, Any]) -> None:
    """Refuse the snapshot ``path`` unless its binding is ``expected``."""
    if binding == expected:
        return
    if isinstance(binding, dict):
        written = " and ".join(
            WRITTEN.get(key, "after round {}").format(binding.get(key))
            for key in expected
            if binding.get(key) != expected[key]
        )
    else:
        written = "without a binding (by an older fedpers)"
    raise SnapshotError(
        f"{path} is not this node's snapshot of round {expected['round']}: it was written "
        f"{written}, and this node holds partition {expected['partition']} of the run with "
        f"token '{expected['token']}'. Remove it and put back the node's own, or start "
        "afresh (resume = false)"
    )


def _read(path: Path) -> tuple[dict[str, dict[str, Array]], dict[str, dict[str, Any]], object]:
    """The arrays, configs and binding (None if it has none) of the snapshot ``path``."""
    with np.load(path, allow_pickle=False) as stored:
        configs = json.loads(str(stored["__configs__"])) if "__configs__" in stored.files else {}
        binding = json.loads(str(stored[BINDING])) if BINDING in stored.files else None
        arrays: dict[str, dict[str, Array]] = {}
        for key in stored.files:
            if key.startswith("a|"):
                _, record, name = key.split("|", 2)
                arrays.setdefault(record, {})[name] = Array(records.contiguous(stored[key]))
    return arrays, configs, binding


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
    payload[BINDING] = np.array(json.dumps(_binding(context, token, server_round)))
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
