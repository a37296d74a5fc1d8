"""Atomic writes: the new file is complete and replaces the old one; a failed write leaves
the old one and no temporary file."""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fedpers import atomic
from fedpers.atomic import save_npz, write_text

FIXED = time.struct_time((2026, 12, 1, 12, 0, 0, 1, 335, 0))


def _freeze_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """np.savez stamps each zip member with the local time: fix it to compare bytes."""
    monkeypatch.setattr(time, "localtime", lambda *_: FIXED)


def test_save_npz_writes_the_bytes_of_np_savez_and_replaces_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _freeze_clock(monkeypatch)
    arrays = {"b": np.arange(6.0).reshape(2, 3), "a": np.array(7), "s": np.array('{"k": 1}')}
    expected = io.BytesIO()
    np.savez(expected, **arrays)  # type: ignore[arg-type]
    path = tmp_path / "state.npz"
    path.write_bytes(b"old")

    save_npz(path, arrays)

    assert path.read_bytes() == expected.getvalue()
    with np.load(path) as stored:
        assert stored.files == ["b", "a", "s"]  # in the order given
        np.testing.assert_array_equal(stored["b"], arrays["b"])
        assert int(stored["a"]) == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.npz"]


def test_save_npz_adds_no_suffix(tmp_path: Path) -> None:
    save_npz(tmp_path / "cache", {"x": np.zeros(2)})

    assert [p.name for p in tmp_path.iterdir()] == ["cache"]


def test_write_text_replaces_the_old_file_with_the_text_in_utf8(tmp_path: Path) -> None:
    path = tmp_path / "rounds.jsonl"
    path.write_text("old\n")

    write_text(path, '{"round": 1}\n{"σ": "±"}\n')

    assert path.read_bytes() == '{"round": 1}\n{"σ": "±"}\n'.encode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rounds.jsonl"]


def test_the_target_keeps_its_old_contents_until_the_complete_new_file_is_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "summary.json"
    path.write_text("old")
    seen: dict[str, object] = {}
    replace = os.replace

    def watching_replace(source: Path, target: Path) -> None:
        seen["source"], seen["target"] = Path(source), Path(target).read_text()
        seen["staged"] = Path(source).read_text()
        replace(source, target)

    monkeypatch.setattr(atomic.os, "replace", watching_replace)

    write_text(path, "new contents")

    assert seen["target"] == "old"
    assert seen["staged"] == "new contents"
    source = seen["source"]
    assert isinstance(source, Path)
    assert source.parent == tmp_path  # same directory: the rename cannot cross devices
    assert source.name == f".summary.json.{os.getpid()}.tmp"  # hidden, no .json suffix
    assert path.read_text() == "new contents"


def _unpicklable() -> np.ndarray:
    return np.array([lambda: 0], dtype=object)  # np.savez pickles it, and that fails


@pytest.mark.parametrize(
    ("write", "error", "half_written"),
    [
        # the first array (8 kB) is written when the second one, an object array, is
        # refused (save_npz never pickles: np.load here reads with allow_pickle=False)
        (lambda p: save_npz(p, {"a": np.arange(1000), "b": _unpicklable()}), ValueError, True),
        (lambda p: write_text(p, "begins well \ud800 cannot be encoded"), UnicodeError, False),
    ],
    ids=["save_npz", "write_text"],
)
def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    write: Callable[[Path], None],
    error: type[Exception],
    half_written: bool,
) -> None:
    path = tmp_path / "checkpoint.npz"
    path.write_bytes(b"the previous round")
    removed: list[int] = []
    unlink = Path.unlink

    def measuring_unlink(self: Path, missing_ok: bool = False) -> None:
        removed.append(self.stat().st_size)
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", measuring_unlink)

    with pytest.raises(error):
        write(path)

    assert path.read_bytes() == b"the previous round"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.npz"]
    assert len(removed) == 1  # the temporary file, removed
    assert (removed[0] > 1000) == half_written
