"""The results directory of a run, as the ServerApp writes it, and its progress lines
(``fedpers.reports`` reads the directory back and draws its plots).

Every run writes ``<results-dir>/<run-name>/``:
- ``config.json``: the resolved run configuration, written before round 1;
- ``rounds.jsonl``: one JSON object per round, appended and flushed as the round ends
  (round, wall seconds, aggregated train / evaluate / server metrics, reply counts,
  the training messages' bytes as ``server.bytes-sent`` / ``server.bytes-received`` and
  the evaluation messages' as ``server.evaluate-bytes``);
- ``clients.jsonl``: one JSON object per evaluated round, each evaluated client's own
  metrics by partition (``{"round": 5, "clients": {"0": {"accuracy": ...}, ...}}``);
- ``summary.json``: final metrics, written atomically when the run ends;
- PNG plots of the per-round metrics;
- ``tensorboard/``: the same per-round metrics as TensorBoard event files (only with
  run-config ``tensorboard = true``);
- ``run.json``: the run's token (a fresh run's identity, kept by a resumed run, which
  is refused without it: its checkpoint and its clients' snapshots carry the token);
- ``.lock``: held (``flock``) by the ServerApp writing the directory, so two runs of
  one name cannot interleave their rounds.

Every write into a run directory happens under its lock: a process that cannot take
it writes nothing there (``failure.json`` included), a finished run (``summary.json``)
is never given a ``failure.json``, and a write that fails (a full disk, a file system
gone read-only) leaves no temporary file and lets the lock go. A run name is one path
segment (``RUN_NAME``), so a run directory is a direct child of ``results-dir``.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import logging
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fedpers.atomic import append_text, write_text
from fedpers.checkpoint import NOT_COMPUTED, ResumeError, new_run_key
from fedpers.logs import strip_ansi

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
ROUNDS_FILE = "rounds.jsonl"
CLIENTS_FILE = "clients.jsonl"
SUMMARY_FILE = "summary.json"
FAILURE_FILE = "failure.json"
RUN_FILE = "run.json"
LOCK_FILE = ".lock"
RELEASES_FILE = "releases.json"  # a private run: noised models released (count_release)
MOST_RELEASES = 10**9  # a count beyond this is damage, not rounds
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
RUN_NAME_RULE = (
    "one path segment of 1 to 128 characters from A-Za-z0-9 . _ + -, "
    "beginning with a letter or a digit"
)


@dataclass
class RoundRecord:
    """What one round did, as written to ``rounds.jsonl``.

    ``sampled`` counts the training messages of the round, ``replies`` the replies
    that were aggregated and ``failures`` the others, each with its reason in
    ``rejections`` (client error, no reply in time, non-finite values, wrong shape or
    dtype); ``evaluated`` counts the nodes whose evaluation was aggregated;
    ``train_seconds`` and ``evaluate_seconds`` split the round's wall time;
    ``clients`` holds each evaluated client's metrics by partition (written to
    ``clients.jsonl``, not to ``rounds.jsonl``); ``trained`` lists the partitions whose
    training reply came back without error, so whose device snapshot of the round was
    written (the checkpoint keeps it, ``rounds.jsonl`` does not).
    """

    round: int
    seconds: float
    train: dict[str, float] = field(default_factory=dict)
    evaluate: dict[str, float] = field(default_factory=dict)
    server: dict[str, float] = field(default_factory=dict)
    sampled: int = 0
    replies: int = 0
    failures: int = 0
    evaluated: int = 0
    rejections: list[str] = field(default_factory=list)
    train_seconds: float = 0.0
    evaluate_seconds: float = 0.0
    clients: dict[str, dict[str, float]] = field(default_factory=dict)
    trained: list[int] = field(default_factory=list)

    def without_clients(self) -> dict[str, Any]:
        """The record as written to ``rounds.jsonl`` (without ``clients`` and
        ``trained``)."""
        row = asdict(self)
        del row["clients"], row["trained"]
        return row


class ResultsExistError(FileExistsError):
    """The run directory already holds results that a new run would overwrite."""


def run_name_defect(run_name: str) -> str | None:
    """Why ``run_name`` cannot name a run directory (``RUN_NAME``), or None if it can."""
    if RUN_NAME.fullmatch(run_name):
        return None
    return (
        f"run-config key 'run-name' = {run_name!r} must be {RUN_NAME_RULE} (so that the run "
        "directory is a direct child of results-dir); choose such a name, or leave it "
        "empty for <algorithm>-<dataset>-<time>"
    )


def run_directory(results_dir: str, run_name: str) -> Path:
    """The absolute directory of a run, a direct child of ``results_dir`` (relative: from
    the cwd).

    Raises
    ------
    ValueError
        If ``run_name`` is not one safe path segment (``RUN_NAME``); the configuration
        check refuses such a name first, this keeps any other caller inside too.
    """
    if (defect := run_name_defect(run_name)) is not None:
        raise ValueError(defect)
    return Path(results_dir).expanduser().resolve() / run_name


class RunStoppedError(RuntimeError):
    """The run was stopped from outside (``RunRecorder.stop``) before it finished."""


class RunRecorder:
    """Writes a run's results directory and logs one progress line per round.

    Parameters
    ----------
    directory : Path
        The run directory; must not hold results of another run.
    config : Mapping
        The resolved run configuration, written to ``config.json``.
    name : str
        Label of the progress lines (the algorithm).
    total_rounds : int
        Number of rounds, for the ETA.
    progress_metric : str
        Which metric the progress line shows (``evaluate.accuracy``, ...).
    resume_after, resume_rounds : int, str, optional
        A resumed run: its checkpoint's round and ``rounds_digest`` of the rounds up to
        it (``rounds.jsonl`` must hold those).
    tensorboard : bool
        Also write the metrics as TensorBoard scalars.
    started : float, optional
        ``time.monotonic()`` when the run began (default: now), for ``wall_seconds``.
    """

    def __init__(
        self,
        directory: Path,
        config: Mapping[str, Any],
        *,
        name: str,
        total_rounds: int,
        progress_metric: str,
        resume_after: int | None = None,
        resume_rounds: str | None = None,
        tensorboard: bool = False,
        started: float | None = None,
    ) -> None:
        self.directory = directory
        self._board: Any = None
        self.name = name
        self.total_rounds = total_rounds
        self.progress_metric = progress_metric
        self.records: list[RoundRecord] = []
        self._rounds = hashlib.sha256()  # of rounds.jsonl's lines so far (rounds_digest)
        # the run's clock (``time.monotonic``): from the ServerApp's start where given,
        # so that wall_seconds holds the start-up that summary.startup_seconds counts
        self.started = time.monotonic() if started is None else started
        self._lock = -1
        # Flower may stop the run from another thread (a simulation's main thread) or
        # from a signal handler in this one (a deployed ServerApp): ``stop`` and the
        # writes of a round hold this re-entrant lock, and nothing is written after it.
        self._writing = threading.RLock()
        self.stopped = False
        try:
            if resume_after is not None:
                self._lock = _claim(directory)
                try:
                    self._reopen(config, resume_after, resume_rounds)
                except ResumeError as error:
                    self.fail(f"{type(error).__name__}: {error}")
                    raise
            else:
                self._start(config)
            if tensorboard:  # after the directory is this run's
                self._board = open_tensorboard(directory / TENSORBOARD_DIR)
        except BaseException:
            self.release()  # a run that cannot start must not keep others out
            raise

    def _start(self, config: Mapping[str, Any]) -> None:
        directory = self.directory
        self._refuse_existing()
        self._lock = _claim(directory)
        self._refuse_existing()  # a run that started at the same time and wrote first
        (directory / FAILURE_FILE).unlink(missing_ok=True)  # of an earlier, failed start
        _write_json_atomic(directory / CONFIG_FILE, dict(config))
        self.token = uuid.uuid4().hex[:12]
        _write_json_atomic(directory / RUN_FILE, {"token": self.token})
        new_run_key(directory)  # the key of its checkpoints' digests (fedpers.checkpoint)

    def _refuse_existing(self) -> None:
        if (self.directory / SUMMARY_FILE).exists() or (self.directory / ROUNDS_FILE).exists():
            self.release()
            raise ResultsExistError(
                f"{self.directory} already holds the results of a run; choose another "
                "run-name or results-dir, remove that directory, or set resume = true"
            )

    def _stored_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The interrupted run's ``config.json``, if it is a configuration that
        ``config`` may resume (the same in every key that changes what is computed).

        Raises
        ------
        ResumeError
            If it is missing, does not read as a JSON object, or differs.
        """
        if not (self.directory / CONFIG_FILE).is_file():
            raise ResumeError(
                f"cannot resume {self.directory}: its {CONFIG_FILE} is missing; restore it, "
                "or start afresh (resume = false)"
            )
        try:
            stored = read_config(self.directory)
        except (ValueError, UnicodeDecodeError) as error:
            raise ResumeError(
                f"cannot resume {self.directory}: its {CONFIG_FILE} does not read as JSON "
                f"({error}); restore the run's own, or start afresh (resume = false)"
            ) from None
        if not isinstance(stored, dict):
            raise ResumeError(
                f"cannot resume {self.directory}: its {CONFIG_FILE} holds "
                f"{type(stored).__name__}, not the run's configuration (a JSON object); "
                "restore the run's own, or start afresh (resume = false)"
            )
        # Where things go and what is logged may change (client-state-dir, results-dir,
        # ...: NOT_COMPUTED); what is computed may not.
        differing = sorted(
            key
            for key in set(stored) | set(config)
            if key not in NOT_COMPUTED and stored.get(key) != config.get(key)
        )
        if differing:
            raise ResumeError(
                f"cannot resume {self.directory}: run-config key(s) {differing} differ from "
                f"the interrupted run's {CONFIG_FILE}; resume with its configuration"
            )
        return stored

    def _reopen(
        self, config: Mapping[str, Any], resume_after: int, expected_rounds: str | None
    ) -> None:
        """Continue a run: same configuration, its token, its rounds up to its checkpoint
        (and the one round after it that a crash or a failed round left, dropped).

        Raises
        ------
        ResumeError
            If ``config.json`` or ``run.json`` is missing, the configuration differs, or
            ``rounds.jsonl`` or ``clients.jsonl`` does not lead to the checkpoint; then
            nothing is rewritten.
        """
        stored = self._stored_config(config)
        self.token = read_token(self.directory)
        try:
            rounds = read_rounds(self.directory) if (self.directory / ROUNDS_FILE).exists() else []
            rows = read_clients(self.directory)
        except ValueError as error:  # a damaged line before the last: the error names it
            raise ResumeError(
                f"cannot resume {self.directory}: {error}; restore the file, or start "
                "afresh (resume = false)"
            ) from error
        if defect := rounds_defect([r.round for r in rounds], resume_after):
            raise ResumeError(
                f"cannot resume {self.directory}: {ROUNDS_FILE} must hold rounds "
                f"1..{resume_after} once each, in order (the checkpoint is of round "
                f"{resume_after}), but {defect}; restore the run's own {ROUNDS_FILE}, or "
                "start afresh (resume = false)"
            )
        if defect := clients_defect([row["round"] for row in rows], resume_after):
            raise ResumeError(
                f"cannot resume {self.directory}: {CLIENTS_FILE} {defect}; restore the "
                f"run's own {CLIENTS_FILE}, or start afresh (resume = false)"
            )
        kept = rounds[:resume_after]
        lines = [_json_line(r.without_clients()) for r in kept]
        if expected_rounds is not None and _hashed(lines).hexdigest() != expected_rounds:
            raise ResumeError(
                f"cannot resume {self.directory}: its {ROUNDS_FILE} rounds 1..{resume_after} "
                "are not those its checkpoint was written after (a line was changed); "
                f"restore the run's own {ROUNDS_FILE}, or start afresh (resume = false)"
            )
        self._rounds = _hashed(lines)
        write_text(self.directory / ROUNDS_FILE, "".join(lines))
        if (self.directory / CLIENTS_FILE).exists():
            rows = [row for row in rows if row["round"] <= resume_after]
            write_text(self.directory / CLIENTS_FILE, "".join(map(_json_line, rows)))
        self.records = kept
        # config.json keeps the run as started, with where things go now (a resume may
        # have moved client-state-dir, ...); its 'resume' stays the first start's.
        moved = {**config, "resume": stored.get("resume", False)}
        if moved != stored:
            _write_json_atomic(self.directory / CONFIG_FILE, moved)
        (self.directory / FAILURE_FILE).unlink(missing_ok=True)

    def fail(self, reason: str) -> None:
        """Record why the run stopped early (``failure.json``); rounds so far stay.

        Writes only while this recorder holds the lock and the run has no summary (a
        ``fail`` after ``finish`` or a second ``fail`` only logs); a ``failure.json``
        that cannot be written is logged. The lock is released in every case.
        """
        try:
            if self._lock < 0:  # the caller raises the error itself: no need to shout
                logger.debug(
                    "%s: not recording the failure (%s): this run no longer holds the directory",
                    self.directory,
                    reason,
                )
                return
            _record_failure(self.directory, reason, len(self.records))
        finally:
            self.release()

    def rounds_digest(self) -> str:
        """``rounds_digest`` of the rounds written so far (what a checkpoint binds)."""
        return self._rounds.hexdigest()

    @contextmanager
    def writing(self) -> Iterator[bool]:
        """Hold off ``stop`` while a write of the run's own (its checkpoint) goes on;
        yields False once the run was stopped: write nothing then."""
        with self._writing:
            yield not self.stopped

    def stop(self, reason: str) -> int | None:
        """The run was stopped from outside (``flwr stop``, a signal to the ServerApp's
        process): write ``failure.json`` (the reason, the rounds kept, ``interrupted``),
        release the directory and write nothing after it. The rounds kept; None where
        the run had already finished, failed or been stopped."""
        with self._writing:
            if self.stopped or self._lock < 0:
                return None
            self.stopped = True
            try:
                rounds = len(self.records)
                payload = {"reason": reason, "rounds_completed": rounds, "interrupted": True}
                _write_json_atomic(self.directory / FAILURE_FILE, payload)
                return rounds
            except OSError as error:
                logger.error("%s: cannot write %s (%s)", self.directory, FAILURE_FILE, error)
                return None
            finally:
                self.release()

    def release(self) -> None:
        """Let another run write this directory (after ``finish`` or ``fail``)."""
        board = getattr(self, "_board", None)
        if board is not None:
            board.close()
            self._board = None
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def count_release(self, total: int) -> None:
        """A private run is about to release its ``total``-th noised model: the count
        is on disk (``releases.json``, replaced atomically and synced) before the model
        leaves the server, so that a crash, a failed round or a stop that a resume
        continues from cannot lose a release from the epsilon. Written also after a
        stop: the model of the round in flight may still go out.

        Raises
        ------
        OSError
            If the count cannot be written; the model must then not be released.
        """
        with self._writing:
            _write_json_atomic(self.directory / RELEASES_FILE, {"releases": total})

    def record(self, record: RoundRecord) -> None:
        """Append a round to ``rounds.jsonl`` and log its progress line.

        Raises
        ------
        RuntimeError
            If this recorder no longer holds the directory (after ``finish`` or ``fail``).
        OSError
            If a line cannot be written; the files keep their earlier rounds, whole.
        """
        with self._writing:
            if self.stopped:
                logger.debug(
                    "%s: round %d not recorded: the run was stopped", self.name, record.round
                )
                return
            self._record(record)

    def _record(self, record: RoundRecord) -> None:
        self._check_held("record a round")
        if record.clients:
            line = _json_line({"round": record.round, "clients": record.clients})
            append_text(self.directory / CLIENTS_FILE, line)
        line = _json_line(record.without_clients())
        append_text(self.directory / ROUNDS_FILE, line)
        self._rounds.update(line.encode())
        self.records.append(record)
        if self._board is not None:
            for section in ("train", "evaluate", "server"):
                for key, value in getattr(record, section).items():
                    if math.isfinite(value):
                        self._board.add_scalar(f"{section}/{key}", value, record.round)
            self._board.add_scalar("round/seconds", record.seconds, record.round)
            self._board.flush()
        logger.info(self.progress_line(record))

    def startup(self, stage: str) -> None:
        """Log ``name | start-up | stage | elapsed``: what the run is doing before its
        first round (the scripts show these lines as they show the rounds')."""
        elapsed = time.monotonic() - self.started
        logger.info(f"{self.name} | start-up | {stage} | elapsed {_clock(elapsed)}")

    def progress_line(self, record: RoundRecord) -> str:
        """``name | round r/T | elapsed | ETA | metric`` for one round."""
        elapsed = time.monotonic() - self.started
        done = len(self.records)
        # Round 1 carries the start-up of the simulation: estimate from the others.
        steady = [r.seconds for r in self.records[1:]] or [r.seconds for r in self.records]
        eta = (self.total_rounds - record.round) * (sum(steady) / len(steady))
        shown = self.progress_metric.split(".", 1)[-1]
        # A round that was not evaluated (evaluate-every > 1) shows the last value.
        reported = [
            (r.round, v)
            for r in self.records
            if not math.isnan(v := metric_value(r, self.progress_metric))
        ]
        if not reported:
            value = f"{shown} not evaluated yet"
        elif reported[-1][0] == record.round:
            value = f"{shown} {reported[-1][1]:.4g}"
        else:
            value = f"{shown} {reported[-1][1]:.4g} (round {reported[-1][0]})"
        failures = f" | failures {record.failures}" if record.failures else ""
        return (
            f"{self.name} | round {record.round}/{self.total_rounds} | elapsed "
            f"{_clock(elapsed)} | ETA {_clock(eta if done else math.nan)} | "
            f"{value}{failures}"
        )

    def finish(
        self, summary: Mapping[str, Any], plots: Iterable[str] = (), plot: Plot | None = None
    ) -> dict[str, Any]:
        """Write ``summary.json`` and one PNG per metric in ``plots`` (drawn by ``plot``,
        ``fedpers.reports.plot_rounds``), then release the directory. If a write fails,
        the failure is recorded (``fail``) and raised.

        Raises
        ------
        RunStoppedError
            If the run was stopped (``stop``): nothing is written.
        """
        with self._writing:
            if self.stopped:
                raise RunStoppedError(f"{self.directory}: the run was stopped; no summary written")
            return self._finish(summary, plots, plot)

    def _finish(
        self, summary: Mapping[str, Any], plots: Iterable[str], plot: Plot | None
    ) -> dict[str, Any]:
        self._check_held("finish")
        final = {
            **summary,
            "rounds": len(self.records),
            "wall_seconds": time.monotonic() - self.started,
        }
        try:
            _write_json_atomic(self.directory / SUMMARY_FILE, final)
            for metric in plots:
                if plot is None:
                    raise ValueError("plots to draw need plot (fedpers.reports.plot_rounds)")
                plot(
                    [(self.name, self.records)],
                    metric,
                    self.directory / f"{metric.replace('.', '_')}.png",
                )
        except BaseException as error:
            self.fail(f"{type(error).__name__}: {error}")
            raise
        self.release()
        return final

    def _check_held(self, action: str) -> None:
        if self._lock < 0:
            raise RuntimeError(
                f"cannot {action} in {self.directory}: this recorder released the "
                "directory (after finish or fail); start a new RunRecorder"
            )


TENSORBOARD_DIR = "tensorboard"
Plot = Callable[[list[tuple[str, list["RoundRecord"]]], str, Path], None]
"""Draws ``metric`` of named runs' round records to a PNG (``fedpers.reports.plot_rounds``)."""


def open_tensorboard(logdir: Path) -> Any:
    """A TensorBoard ``SummaryWriter`` on ``logdir`` (run-config ``tensorboard = true``).

    Raises
    ------
    ImportError
        If the ``tensorboard`` package is missing, naming the extra to install.
    """
    try:
        import tensorboard  # noqa: F401  # torch's writer needs it
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError(
            "run-config key 'tensorboard' = true needs the tensorboard package: "
            "pip install -e '.[tensorboard]' (or set tensorboard = false)"
        ) from error
    return SummaryWriter(log_dir=str(logdir))


def write_failure(directory: Path, reason: str) -> bool:
    """Write ``failure.json`` for a run that stopped before it had a recorder, under the
    directory's lock.

    Nothing is written into a directory that another run holds, nor into a finished
    run (``summary.json``); a write that fails is logged. Never raises: the caller is
    already handling the error that stopped the run.

    Returns
    -------
    bool
        Whether ``failure.json`` was written.
    """
    try:
        lock = _claim(directory)
    except (ResultsExistError, OSError) as error:
        logger.warning("%s: not recording the failure (%s): %s", directory, reason, error)
        return False
    try:
        return _record_failure(directory, reason, 0)
    finally:
        os.close(lock)


def record_interruption(directory: Path, reason: str) -> int | None:
    """``failure.json`` for a run whose processes were stopped from outside (SIGINT,
    SIGTERM), written by the script that started it once they are gone: the reason and
    the rounds its ``rounds.jsonl`` holds (its checkpoint's, or one more). None where the
    run finished or is still writing (its lock is held)."""
    if (directory / SUMMARY_FILE).exists():
        return None
    try:
        lock = _claim(directory)
    except (ResultsExistError, OSError) as error:
        logger.warning("%s: not recording the interruption: %s", directory, error)
        return None
    try:
        rounds = len(read_rounds(directory)) if (directory / ROUNDS_FILE).exists() else 0
        payload = {"reason": reason, "rounds_completed": rounds, "interrupted": True}
        _write_json_atomic(directory / FAILURE_FILE, payload)
        return rounds
    except (OSError, ValueError) as error:
        logger.warning("%s: could not record the interruption: %s", directory, error)
        return None
    finally:
        os.close(lock)


def _record_failure(directory: Path, reason: str, rounds_completed: int) -> bool:
    """``failure.json``, by the holder of the lock; not over a finished run."""
    if (directory / SUMMARY_FILE).exists():
        logger.warning("%s holds a finished run: not recording the failure (%s)", directory, reason)
        return False
    try:
        _write_json_atomic(
            directory / FAILURE_FILE,
            {"reason": strip_ansi(reason), "rounds_completed": rounds_completed},
        )
    except OSError as error:
        logger.error("%s: cannot write %s (%s): %s", directory, FAILURE_FILE, error, reason)
        return False
    return True


def read_releases(directory: Path, at_least: int) -> int:
    """The noised models a private run released (``RunRecorder.count_release``), for a
    resume that continues its epsilon: at least ``at_least`` (its checkpoint's round).

    Raises
    ------
    ResumeError
        If ``releases.json`` is missing, damaged or counts fewer than ``at_least``: the
        epsilon would then count too few releases.
    """
    path = directory / RELEASES_FILE
    try:
        count = json.loads(path.read_text(encoding="utf-8"))["releases"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        count = f"unreadable ({type(error).__name__})"
    if (
        isinstance(count, bool)
        or not isinstance(count, int)
        or not at_least <= count <= MOST_RELEASES
    ):
        raise ResumeError(
            f"cannot resume {directory}: its {RELEASES_FILE}, the count of noised models "
            f"the private run released, is {count!r}, not a count of at least "
            f"{at_least} (its checkpoint's round), so its epsilon would count too few; "
            f"restore the run's own {RELEASES_FILE}, or start afresh (resume = false)"
        )
    return count


def read_token(directory: Path) -> str:
    """The token of the run in ``directory`` (its ``run.json``), which its checkpoint
    and its clients' snapshots must carry.

    Raises
    ------
    ResumeError
        If ``run.json`` is missing, not a regular file, or holds no token.
    """
    path = directory / RUN_FILE
    if path.is_symlink() or not path.is_file():
        raise ResumeError(
            f"cannot resume {directory}: {path} is missing (or not a regular file), and "
            "with it the run's token, so neither its checkpoint nor its clients' snapshots "
            "can be told from another run's; restore run.json, or start afresh "
            "(resume = false)"
        )
    try:
        token = json.loads(path.read_text())["token"]
    except (ValueError, KeyError, TypeError):
        token = None
    if not isinstance(token, str) or not token:
        raise ResumeError(
            f"cannot resume {directory}: {path} holds no run token; restore run.json, or "
            "start afresh (resume = false)"
        )
    return token


def rounds_defect(rounds: list[int], checkpoint_round: int) -> str | None:
    """Why ``rounds`` (``rounds.jsonl``'s, in file order) cannot precede a resume after
    ``checkpoint_round``; None if they are rounds ``1..checkpoint_round``, once each and
    in order, followed by at most round ``checkpoint_round + 1``.

    That one more round is what a crash leaves (a round's line is written before its
    checkpoint) and what a round below ``min-replies`` leaves (recorded, never
    checkpointed); the resume runs it again and drops the old line. Any further line
    means the checkpoint is older than the rounds (restored from a copy, its round
    edited): resuming would compute again, differently, rounds the file holds.
    """
    allowed = checkpoint_round + 1
    for line, number in enumerate(rounds, start=1):
        if line > allowed:
            return (
                f"rounds {rounds[allowed:]} follow round {allowed}, and only the one round "
                "after the checkpoint, which it interrupted, may"
            )
        if number == line:
            continue
        if number in rounds[: line - 1]:
            return f"round {number} appears twice"
        if line in rounds[line:]:
            return f"round {number} comes before round {line}"
        return f"round {line} is missing"
    if len(rounds) < checkpoint_round:
        return f"it ends after round {len(rounds)}" if rounds else "it holds no round"
    return None


def clients_defect(rounds: list[int], checkpoint_round: int) -> str | None:
    """Why ``rounds`` (``clients.jsonl``'s, one per evaluated round) cannot precede a
    resume after ``checkpoint_round``: they must increase, up to at most the round after
    it (the one a crash interrupted)."""
    if any(later <= earlier for earlier, later in itertools.pairwise(rounds)):
        return f"holds rounds {rounds}, not increasing"
    if rounds and rounds[-1] > checkpoint_round + 1:
        return f"holds round {rounds[-1]}, after round {checkpoint_round + 1}"
    return None


def metric_value(record: RoundRecord, metric: str) -> float:
    """``record``'s value of ``section.key`` (``evaluate.accuracy``), NaN if absent."""
    section, key = metric.split(".", 1)
    value = getattr(record, section).get(key)
    return math.nan if value is None else float(value)


def final_mean(records: list[RoundRecord], metric: str, last: int) -> float:
    """Mean of ``metric`` over the last ``last`` rounds that report it."""
    values = [v for r in records if not math.isnan(v := metric_value(r, metric))]
    if not values:
        return math.nan
    tail = values[-last:]
    return sum(tail) / len(tail)


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write JSON atomically (a crash leaves the old file or the new one, never half)."""
    _write_json_atomic(path, dict(payload))


def _claim(directory: Path) -> int:
    """Hold the directory's lock for this process's lifetime (the descriptor stays
    open); a second run writing the same directory is refused at once."""
    directory.mkdir(parents=True, exist_ok=True)
    handle = os.open(directory / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(handle)
        raise ResultsExistError(
            f"another run is writing {directory} right now; choose another run-name"
        ) from None
    return handle


@contextmanager
def holding_every_run(root: Path) -> Iterator[None]:
    """Hold the lock of every run directory under ``root`` for the block (to delete the
    tree while no run can write in it).

    Raises
    ------
    ResultsExistError
        If a run is writing one of them now, naming its directory; no lock is kept.
    """
    held: list[int] = []
    try:
        for lock in sorted(root.rglob(LOCK_FILE)):
            handle = os.open(lock, os.O_RDWR)
            held.append(handle)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ResultsExistError(
                    f"a run is writing {lock.parent} right now (it holds {lock})"
                ) from None
        yield
    finally:
        for handle in held:
            os.close(handle)


def _write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_finite_or_null(payload), indent=2, sort_keys=True, allow_nan=False)
    write_text(path, text + "\n")


def rounds_digest(records: Iterable[RoundRecord]) -> str:
    """SHA-256 of ``records``' lines as ``rounds.jsonl`` holds them (clients apart): what
    a checkpoint binds, so that a resumed run reads the rounds it was written after."""
    return _hashed(_json_line(record.without_clients()) for record in records).hexdigest()


def _hashed(lines: Iterable[str]) -> Any:
    """A running SHA-256 of ``lines`` (``RunRecorder`` goes on updating it)."""
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode())
    return h


def _json_line(payload: Mapping[str, Any]) -> str:
    return json.dumps(_finite_or_null(dict(payload)), allow_nan=False) + "\n"


def _finite_or_null(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_null(v) for v in value]
    return value


def _clock(seconds: float) -> str:
    if math.isnan(seconds):
        return "--:--"
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return (
        f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
        if hours
        else f"{rest // 60:02d}:{rest % 60:02d}"
    )


# ------------------------------------------------------------------ reading back
def read_rounds(directory: Path) -> list[RoundRecord]:
    """The round records of a run directory. A last line cut short (the run was killed
    while writing it) is dropped with a warning; any other bad line is an error."""
    lines = [line for line in (directory / ROUNDS_FILE).read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(RoundRecord(**json.loads(line)))
        except (json.JSONDecodeError, TypeError) as error:
            if number < len(lines):
                raise ValueError(
                    f"{directory / ROUNDS_FILE}, line {number}, is not a round record "
                    f"({error}); the file is damaged beyond its last line"
                ) from error
            logger.warning("%s: dropped a half-written last line", directory / ROUNDS_FILE)
    return records


def read_clients(directory: Path) -> list[dict[str, Any]]:
    """The per-client rows of a run (``clients.jsonl``; empty if it has none): one
    ``{"round": r, "clients": {partition: {metric: value}}}`` per evaluated round. A last
    line cut short is dropped, as in ``read_rounds``."""
    path = directory / CLIENTS_FILE
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
            rows.append({"round": int(row["round"]), "clients": dict(row["clients"])})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            if number < len(lines):
                raise ValueError(
                    f"{path}, line {number}, is not a per-client row ({error})"
                ) from error
            logger.warning("%s: dropped a half-written last line", path)
    return rows


def read_config(directory: Path) -> dict[str, Any]:
    """The resolved run configuration (``config.json``) of a run directory."""
    return json.loads((directory / CONFIG_FILE).read_text())


def read_summary(directory: Path) -> dict[str, Any]:
    """The ``summary.json`` of a run directory."""
    return json.loads((directory / SUMMARY_FILE).read_text())
