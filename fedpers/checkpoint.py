"""Server checkpoints: the global arrays after a round, written atomically.

A crash while writing leaves the previous checkpoint intact (write to a temporary
file, fsync, rename). ``resume = true`` continues a run from its last checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

CHECKPOINT_FILE = "checkpoint.npz"
ROUND_KEY = "__round__"


class NoCheckpointError(FileNotFoundError):
    """A run asked to resume has no checkpoint to resume from."""


def save_checkpoint(directory: Path, server_round: int, arrays: dict[str, np.ndarray]) -> Path:
    """Atomically replace ``directory/checkpoint.npz`` with this round's arrays."""
    if ROUND_KEY in arrays:
        raise ValueError(f"array name '{ROUND_KEY}' is reserved")
    path = directory / CHECKPOINT_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as handle:
        np.savez(handle, **{ROUND_KEY: np.array(server_round)}, **arrays)  # type: ignore[arg-type]
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(directory: Path) -> tuple[int, dict[str, np.ndarray]]:
    """The round and arrays of ``directory``'s checkpoint."""
    path = directory / CHECKPOINT_FILE
    if not path.exists():
        raise NoCheckpointError(
            f"{directory} has no {CHECKPOINT_FILE} to resume from; run without resume = true"
        )
    with np.load(path, allow_pickle=False) as stored:
        return int(stored[ROUND_KEY]), {k: stored[k] for k in stored.files if k != ROUND_KEY}
