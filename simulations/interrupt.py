"""Interrupting and resuming a script's runs (the scripts and ``fedpers run``).

SIGINT (Ctrl-C) or SIGTERM while a script's runs go: the runs' processes are stopped
(the SuperLink and what it started, or the in-process pool's workers), every run that
did not finish gets ``failure.json`` (``interrupted``, its rounds kept) and, through
Flower, its ``flower.log``; the script prints one line of what was kept and one with
the command that continues, and exits with 130 (SIGINT) or 143 (SIGTERM), without a
traceback.

``--resume`` added to the same command continues: a finished run (``summary.json``) is
kept as it is, an interrupted one with a checkpoint goes on from it (``resume =
true``; the run's own checks refuse a checkpoint of another configuration), and one
that had not finished a round starts again. A run of an algorithm that keeps state on
its clients needs their per-round snapshots to resume: the scripts set
``client-state-dir`` to ``OUT/client-state`` unless it is given.
"""

from __future__ import annotations

import shlex
import shutil
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedpers.checkpoint import CHECKPOINT_FILE
from fedpers.results import (
    LOCK_FILE,
    ROUNDS_FILE,
    SUMMARY_FILE,
    ResultsExistError,
    holding_every_run,
    record_interruption,
)

CLIENT_STATE = "client-state"  # the scripts' default client-state-dir, under --out


class Interrupted(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as SIGINT raises ``KeyboardInterrupt``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within it, SIGTERM raises ``Interrupted`` in the main thread (elsewhere: as is)."""
    try:
        previous = signal.signal(signal.SIGTERM, _raise)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def signal_of(error: BaseException) -> int:
    """The signal an interruption came from: SIGTERM for ``Interrupted`` and for the
    SystemExit(143) that a simulation's own SIGTERM handler raises, else SIGINT."""
    if isinstance(error, Interrupted):
        return error.signum
    if isinstance(error, SystemExit) and error.code == 128 + signal.SIGTERM:
        return signal.SIGTERM
    return signal.SIGINT


def is_interruption(error: BaseException) -> bool:
    return isinstance(error, KeyboardInterrupt) or (
        isinstance(error, SystemExit) and error.code == 128 + signal.SIGTERM
    )


def with_client_state(runs: Sequence[Mapping[str, Any]], out: Path) -> list[dict[str, Any]]:
    """The runs, each with ``client-state-dir`` set to ``OUT/client-state`` where it is
    not given (the clients' snapshots a resumed run restores; named by run, token and
    partition, so the runs share the folder)."""
    folder = str(out.expanduser().resolve() / CLIENT_STATE)
    return [{**run, "client-state-dir": run.get("client-state-dir") or folder} for run in runs]


def resumable(directory: Path) -> bool:
    """Whether a run directory holds an unfinished run with a checkpoint."""
    return (directory / CHECKPOINT_FILE).is_file() and not (directory / SUMMARY_FILE).exists()


def directory_of(run: Mapping[str, Any]) -> Path:
    """The directory a run writes (its resolved ``results-dir`` and ``run-name``)."""
    from fedpers.results import run_directory
    from fedpers.simulations.launch import resolved_config

    config = resolved_config(run)
    return run_directory(config.results_dir, config.run_name)


def plan(runs: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    """``--resume``: the runs to start (an interrupted one with ``resume = true``; one
    without a checkpoint afresh, its directory emptied) and the indices of the finished
    ones, kept as they are."""
    pending: list[dict[str, Any]] = []
    finished: list[int] = []
    for index, run in enumerate(runs):
        directory = directory_of(run)
        if (directory / SUMMARY_FILE).exists():
            finished.append(index)
        elif resumable(directory):
            pending.append({**run, "resume": True})
        else:
            if directory.exists():
                _empty(directory)
            pending.append(dict(run))
    return pending, finished


def _empty(directory: Path) -> None:
    """Delete a run directory that holds no round to resume from (under its lock)."""
    try:
        with holding_every_run(directory):
            shutil.rmtree(directory)
    except ResultsExistError as error:
        raise SystemExit(f"error: --resume cannot start {directory} again: {error}") from None


def refuse_overwriting_resumable(out: Path) -> None:
    """``--overwrite`` of an output directory with interrupted runs: refused, naming
    them, unless ``--discard-interrupted`` is given too."""
    kept = [d for d in sorted(out.glob("runs/*")) if resumable(d)]
    if kept:
        names = ", ".join(f"{d.name} ({_rounds(d)} rounds)" for d in kept[:5])
        more = f" and {len(kept) - 5} more" if len(kept) > 5 else ""
        raise SystemExit(
            f"error: {out} holds interrupted runs that --resume can continue: {names}{more}; "
            "add --resume to continue them (instead of --overwrite), or add "
            "--discard-interrupted to delete them with the rest"
        )


def _rounds(directory: Path) -> int:
    path = directory / ROUNDS_FILE
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip().endswith("}"))


def report(out: Path, runs: Sequence[Mapping[str, Any]], signum: int) -> str:
    """After the runs' processes stopped: ``failure.json`` in every run directory that
    did not finish, and the lines telling the user what was kept and how to go on."""
    from fedpers.results import run_directory
    from fedpers.simulations.launch import resolved_config

    name = signal.Signals(signum).name
    finished, kept = 0, []
    for run in runs:
        config = resolved_config(run)
        directory = run_directory(config.results_dir, config.run_name)
        if (directory / SUMMARY_FILE).exists():
            finished += 1
            continue
        if not directory.exists():
            continue
        rounds = record_interruption(directory, f"interrupted by {name}")
        if rounds is not None:  # its lock was free: no process of the run is left
            (directory / LOCK_FILE).unlink(missing_ok=True)
            kept.append(f"{directory.name} {rounds}/{config.num_rounds} rounds")
    what = ", ".join(kept) if kept else "no round of an unfinished run"
    return (
        f"interrupted by {name}: {finished} of {len(runs)} runs finished; kept {what}; "
        f"results in {out}\nresume with: {resume_command()}"
    )


def resume_command(argv: Sequence[str] | None = None) -> str:
    """The command line that started this process, ``--overwrite`` and
    ``--discard-interrupted`` left out and ``--resume`` added."""
    words = list(sys.orig_argv if argv is None else argv)
    if len(words) > 1 and Path(words[1]).name == "fedpers":  # the console script
        words = words[1:]
        words[0] = "fedpers"
    elif words and Path(words[0]).name.startswith("python"):
        words[0] = "python"
    kept = [w for w in words if w not in ("--overwrite", "--discard-interrupted", "--resume")]
    return shlex.join([*kept, "--resume"])
