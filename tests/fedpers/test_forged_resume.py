"""Forged resume state, generated (issue 46): whatever is changed in a run's
``checkpoint.npz`` or ``rounds.jsonl`` after it was written, the resume either refuses
with a ``ResumeError`` of one line that names the file, or continues from exactly what
the run wrote. The examples of the issue (an array scaled by 1.01 with its SHA-256
recomputed, ``dp.next-clip`` edited, a cluster moved) are regression tests in
``tests/strategies/test_resume.py``; these generate the class."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedpers.checkpoint import (
    CHECKPOINT_FILE,
    DIGEST_KEY,
    ROUND_KEY,
    TRAINED_KEY,
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    new_run_key,
    run_key,
    save_checkpoint,
)
from fedpers.results import ROUNDS_FILE, ResumeError, RoundRecord, RunRecorder, read_rounds

NUM_ROUNDS = 10
ROUND = 4
TOKEN = "0123456789ab"
CONFIGURATION = "c" * 64
ARRAYS = {
    "body.0.weight": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
    "head.bias": np.array([0.5, -0.25], dtype=np.float32),
    "cluster.assignment": np.array([0.0, 1.0, 1.0]),
}
NAMES = sorted(ARRAYS)
FINITE = st.floats(allow_nan=False, allow_infinity=False, width=64)
TEXT = st.text(max_size=20)

# One forgery: what is changed, and its arguments.
FORGERY = st.one_of(
    st.tuples(st.just("scale"), st.sampled_from(NAMES), FINITE),
    st.tuples(st.just("set"), st.sampled_from(NAMES), st.integers(0, 5), FINITE),
    st.tuples(st.just("rename"), st.sampled_from(NAMES), TEXT.filter(lambda t: t != "")),
    st.tuples(st.just("drop"), st.sampled_from(NAMES)),
    st.tuples(st.just("add"), TEXT.filter(lambda t: t != ""), FINITE),
    st.tuples(st.just("dtype"), st.sampled_from(NAMES), st.sampled_from(["f2", "f8", "i4"])),
    st.tuples(st.just("round"), st.integers(-(2**63), 2**63 - 1)),
    st.tuples(st.just("trained"), st.integers(0, 3), st.integers(-(2**31), 2**31)),
    st.tuples(st.sampled_from(["__token__", "__configuration__", "__rounds__"]), TEXT),
)


def _written(directory: Path) -> dict[str, np.ndarray]:
    new_run_key(directory)
    checkpoint = Checkpoint(
        ROUND, dict(ARRAYS), TOKEN, CONFIGURATION, {0: 4, 1: 3, 2: 4}, rounds="r" * 64
    )
    save_checkpoint(directory, checkpoint)
    with np.load(directory / CHECKPOINT_FILE) as stored:
        return {name: stored[name] for name in stored.files}


def _forged(values: dict[str, np.ndarray], forgery: tuple[Any, ...]) -> dict[str, np.ndarray]:
    kind, *args = forgery
    forged = dict(values)
    with np.errstate(over="ignore", invalid="ignore"):  # a value beyond float32: inf
        _change(forged, values, kind, args)
    return forged


def _change(
    forged: dict[str, np.ndarray], values: dict[str, np.ndarray], kind: str, args: list[Any]
) -> None:
    if kind == "scale":
        forged[args[0]] = (values[args[0]] * args[1]).astype(values[args[0]].dtype)
    elif kind == "set":
        changed = values[args[0]].copy().reshape(-1)
        changed[args[1] % changed.size] = args[2]
        forged[args[0]] = changed.reshape(values[args[0]].shape)
    elif kind == "rename":
        forged[args[1]] = forged.pop(args[0])
    elif kind == "drop":
        del forged[args[0]]
    elif kind == "add":
        forged[args[0]] = np.array([args[1]])
    elif kind == "dtype":
        forged[args[0]] = values[args[0]].astype(args[1])
    elif kind == "round":
        forged[ROUND_KEY] = np.array(args[0], dtype=np.int64)
    elif kind == "trained":
        table = values[TRAINED_KEY].copy()
        table[args[0] % len(table), 1] = args[1]
        forged[TRAINED_KEY] = table
    else:
        forged[kind] = np.array(args[0])


def _same(first: dict[str, np.ndarray], second: dict[str, np.ndarray]) -> bool:
    return sorted(first) == sorted(second) and all(
        first[n].dtype == second[n].dtype
        and first[n].shape == second[n].shape
        and first[n].tobytes() == second[n].tobytes()
        for n in first
    )


@settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forgery=FORGERY, guess=st.one_of(st.none(), st.binary(max_size=40)))
def test_a_forged_checkpoint_is_refused_in_one_line_or_is_the_one_written(
    forgery: tuple[Any, ...], guess: bytes | None
) -> None:
    # ``guess``: the digest recomputed under a key the forger guessed (None: kept), as
    # anyone without the run's .key can
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        written = _written(directory)
        forged = _forged(written, forgery)
        if guess is not None:
            binding = {k: v for k, v in forged.items() if not k.startswith("__")}
            trained = forged.get(TRAINED_KEY, np.zeros((0, 2), np.int64))
            checkpoint = Checkpoint(
                int(forged[ROUND_KEY]) if forged[ROUND_KEY].ndim == 0 else 0,
                binding,
                str(forged["__token__"]),
                str(forged["__configuration__"]),
                {int(p): int(r) for p, r in trained},
                str(forged["__rounds__"]),
            )
            forged[DIGEST_KEY] = np.array(checkpoint.digest(guess))
            assert guess != run_key(directory)
        unchanged = _same(forged, written)
        np.savez(directory / CHECKPOINT_FILE, **forged)
        load = {"num_rounds": NUM_ROUNDS, "token": TOKEN, "configuration": CONFIGURATION}
        if unchanged:
            loaded = load_checkpoint(directory, **load)
            assert _same(loaded.arrays, ARRAYS)
            return
        with pytest.raises(CheckpointError) as refused:
            load_checkpoint(directory, **load)
        message = str(refused.value)
        assert "\n" not in message
        assert str(directory / CHECKPOINT_FILE) in message


# ---------------------------------------------------------------- rounds.jsonl
JSON = st.recursive(
    st.none() | st.booleans() | FINITE | st.integers() | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)
FIELDS = [
    "round", "seconds", "train", "evaluate", "server", "sampled", "replies", "failures",
    "evaluated", "rejections", "trained", "train_seconds", "new-key",
]  # fmt: skip


def _round(number: int) -> RoundRecord:
    return RoundRecord(
        round=number,
        seconds=0.5 * number,
        train={"loss": 1.0 / number},
        evaluate={"accuracy": 0.1 * number},
        server={"dp.next-clip": 0.5 + number},
        sampled=4,
        replies=4,
        rejections=[] if number % 2 else [f"partition 1: reason {number}"],
        trained=[0, 1, 2, 3],
    )


@settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    line=st.integers(0, ROUND),
    field=st.sampled_from(FIELDS),
    value=JSON,
    nested=st.booleans(),
)
def test_forged_rounds_are_refused_in_one_line_or_are_the_ones_written(
    line: int, field: str, value: Any, nested: bool
) -> None:
    # rounds 1..ROUND + 1 written (the last one after the checkpoint, as a crash leaves
    # it); one value of one line changed (``nested``: a value inside a field's table)
    config = {"seed": 1}
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        recorder = RunRecorder(
            directory, config, name="fedavg", total_rounds=NUM_ROUNDS, progress_metric="train.loss"
        )
        for number in range(1, ROUND + 2):
            recorder.record(_round(number))
            if number == ROUND:
                digest = recorder.rounds_digest()
        recorder.release()
        path = directory / ROUNDS_FILE
        lines = path.read_text().splitlines()
        written = lines[:ROUND]
        record = json.loads(lines[line])
        if nested and isinstance(record.get(field), dict):
            record[field]["loss" if field == "train" else "x"] = value
        else:
            record[field] = value
        lines[line] = json.dumps(record)
        path.write_text("\n".join(lines) + "\n")
        refused: ResumeError | None = None
        try:
            resumed = RunRecorder(
                directory,
                config,
                name="fedavg",
                total_rounds=NUM_ROUNDS,
                progress_metric="train.loss",
                resume_after=ROUND,
                resume_rounds=digest,
            )
        except ResumeError as error:
            refused = error
        if refused is not None:
            assert "\n" not in str(refused)
            assert str(directory) in str(refused)
            return
        resumed.release()
        kept = path.read_text().splitlines()
        assert [json.loads(x) for x in kept] == [json.loads(x) for x in written]
        assert [r.round for r in read_rounds(directory)] == list(range(1, ROUND + 1))
