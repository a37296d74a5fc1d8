"""Server checkpoints: the global arrays after a round, written atomically.

A crash while writing leaves the previous checkpoint intact (write to a temporary
file, fsync, rename). ``resume = true`` continues a run from its last checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedpers.atomic import save_npz

CHECKPOINT_FILE = "checkpoint.npz"
ROUND_KEY = "__round__"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file and the fix."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """A run asked to resume has no checkpoint to resume from."""


def save_checkpoint(directory: Path, server_round: int, arrays: dict[str, np.ndarray]) -> Path:
    """Atomically replace ``directory/checkpoint.npz`` with this round's arrays."""
    if ROUND_KEY in arrays:
        raise ValueError(f"array name '{ROUND_KEY}' is reserved")
    path = directory / CHECKPOINT_FILE
    save_npz(path, {ROUND_KEY: np.array(server_round), **arrays})
    return path


def load_checkpoint(
    directory: Path, *, num_rounds: int | None = None
) -> tuple[int, dict[str, np.ndarray]]:
    """The round and arrays of ``directory``'s checkpoint, checked.

    Raises
    ------
    CheckpointError
        If there is none, it does not read (truncated, not an npz), its round is not a
        whole number in ``1 .. num_rounds - 1``, or an array is not finite; the message
        names the file and what to do.
    """
    path = directory / CHECKPOINT_FILE
    if not path.exists():
        raise NoCheckpointError(
            f"{directory} has no {CHECKPOINT_FILE} to resume from; run without resume = true"
        )
    fix = "remove it and start afresh (resume = false), or restore a good copy"
    try:
        with np.load(path, allow_pickle=False) as stored:
            stored_round = stored[ROUND_KEY]
            arrays = {k: stored[k] for k in stored.files if k != ROUND_KEY}
    except Exception as error:
        raise CheckpointError(f"{path} cannot be read ({type(error).__name__}); {fix}") from None
    if stored_round.shape != () or stored_round.dtype.kind not in "iu":
        raise CheckpointError(f"{path} holds no round number; {fix}")
    server_round = int(stored_round)
    last = num_rounds - 1 if num_rounds is not None else server_round
    if not 1 <= server_round <= last:
        raise CheckpointError(
            f"{path} is at round {server_round}, not in 1..{last} (num-rounds = {num_rounds}); "
            "nothing to resume there, or it is damaged: " + fix
        )
    for name, values in arrays.items():
        if values.dtype.kind == "f" and not np.all(np.isfinite(values)):
            raise CheckpointError(f"{path}: array '{name}' is not finite; {fix}")
    return server_round, arrays
