"""Atomic file writes: whoever opens the file, a concurrent reader or a run resumed after
a crash, finds the old contents or the new ones, never a part of them.

The contents go to a temporary file beside the target (``.NAME.PID.tmp``: same
directory, so the rename stays on one file system; hidden and without the target's
suffix, so a ``*.npz`` or ``*.json`` glob never sees it), are flushed and fsynced, and
``os.replace`` puts them in place. A write that fails (a full disk, a file system gone
read-only) removes its temporary file and leaves the target as it was.

``append_text`` adds to the end of a file (``rounds.jsonl``) all or nothing: an append
that fails part-way is cut off again, so a reader never meets half a line.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


def save_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Replace ``path`` with ``np.savez`` of ``arrays`` (in their order; the bytes are
    those ``np.savez`` writes, no ``.npz`` suffix is added)."""
    import zipfile

    import numpy as np  # here: fedpers.results writes text through this module, numpy-free

    # np.savez's own loop (a stored zip of NAME.npy members), without its keyword
    # arguments: an array named 'file' made np.savez raise TypeError and one named
    # 'allow_pickle' was taken for the option and silently left out.
    with (
        _replacing(path, "wb") as handle,
        zipfile.ZipFile(handle, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf,
    ):
        for name, value in arrays.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(value), allow_pickle=False)


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8)."""
    with _replacing(path, "w") as handle:
        handle.write(text)


def append_text(path: Path, text: str) -> None:
    """Append ``text`` (UTF-8) to ``path``, creating it if needed; a write that fails
    part-way truncates the file back to its old length before the error is raised."""
    data = memoryview(text.encode("utf-8"))
    with path.open("ab", buffering=0) as handle:  # unbuffered: close writes nothing more
        start = handle.seek(0, os.SEEK_END)
        try:
            while data:
                data = data[handle.write(data) :]
        except BaseException:
            with contextlib.suppress(OSError):  # a file system gone read-only keeps it
                handle.truncate(start)
            raise


@contextmanager
def _replacing(path: Path, mode: str) -> Iterator[IO[Any]]:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open(mode, encoding=None if "b" in mode else "utf-8") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to raise
            tmp.unlink(missing_ok=True)
        raise
