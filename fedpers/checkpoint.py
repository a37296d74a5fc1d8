"""Server checkpoints: the global arrays after a round, bound to the run that wrote them.

A crash while writing leaves the previous checkpoint intact (write to a temporary
file, fsync, rename). ``resume = true`` continues a run from its last checkpoint, and
only from a checkpoint that is the run's own: besides the round and the arrays it holds

- the run's token (``run.json``, ``fedpers.results``): a checkpoint copied from another
  run, even one of the same name, is refused;
- the digest of the configuration that computed it (``configuration_digest``: every
  run-config key but ``NOT_COMPUTED``): a resume under another configuration is refused,
  even where ``config.json`` was edited to match it;
- the last round in which each partition's training reply came back (``trained``): the
  rounds after which its device snapshot must exist (``strategies/resume.py``);
- the digest of ``rounds.jsonl``'s rounds up to it (``rounds_digest``): the state a
  resumed run reads from there (an adaptive clip's ``dp.next-clip``) is the one written;
- a keyed digest (HMAC-SHA256) of all of the above and of every array, under the run's
  own secret key (``.key`` in the run directory, 0600, written at the run's start; not a
  results file): a checkpoint changed after it was written (its round edited, an array
  scaled, a cluster moved) is refused even where its digest was recomputed, since that
  needs the key.

The checkpoint must be a regular file in the run directory: a symbolic link is refused,
since the file it points to is another run's, or can become one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedpers.atomic import save_npz

CHECKPOINT_FILE = "checkpoint.npz"
ROUND_KEY = "__round__"
TOKEN_KEY = "__token__"
CONFIGURATION_KEY = "__configuration__"
TRAINED_KEY = "__trained__"  # (partition, round) rows
DIGEST_KEY = "__digest__"
ROUNDS_KEY = "__rounds__"  # the digest of rounds.jsonl's rounds up to the checkpoint's
RESERVED = (ROUND_KEY, TOKEN_KEY, CONFIGURATION_KEY, TRAINED_KEY, DIGEST_KEY, ROUNDS_KEY)
# The server's own state beyond the global arrays (a private run's audit canaries), stored
# under this prefix: never sent to a node, never part of the model.
SERVER_PREFIX = "__server."
KEY_FILE = ".key"  # the run's secret key of its checkpoints' digests
KEY_BYTES = 32

# Run-config keys that do not change what a run computes, so a resume may differ in them
# (config.json is compared on its own, on every key but `resume`): whether it resumes,
# where it writes (`results-dir`, `run-name`, `tensorboard`, `publish-dir`), where the clients keep
# their snapshots (`client-state-dir`: what is there is checked node by node), and how
# long the start waits for the nodes (`node-wait-timeout`: a resume takes its state from
# the checkpoint, not from the start-up answers a longer wait could let in).
# `round-timeout` counts: it decides which replies a round uses. So do `device` and
# `client-threads`: the floats can differ between them.
NOT_COMPUTED = frozenset(
    {
        "resume", "results-dir", "run-name", "tensorboard", "publish-dir", "client-state-dir",
        "node-wait-timeout",
    }
)  # fmt: skip


class ResumeError(ValueError):
    """A resume refused before any round: the message names the file and the fix."""


class CheckpointError(ResumeError):
    """A checkpoint that cannot be resumed from; the message names the file and the fix."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """A run asked to resume has no checkpoint to resume from."""


@dataclass(frozen=True)
class Checkpoint:
    """A run's global state after a round, and what binds it to the run.

    Attributes
    ----------
    round : int
        The last round whose global state it holds.
    arrays : dict of str to ndarray
        The global arrays after that round.
    token : str
        The run's token (``run.json``).
    configuration : str
        ``configuration_digest`` of the run's configuration.
    trained : dict of int to int
        For each partition whose training reply ever came back without error, the last
        such round (at most ``round``): its device snapshot of that round was written.
    rounds : str
        ``fedpers.results.rounds_digest`` of ``rounds.jsonl``'s rounds 1..``round``.
    server : dict of str to ndarray
        The server's state that is not the global arrays (``SERVER_PREFIX`` in the
        file): a private run's audit canaries (``FedpersStrategy.server_state``).
    """

    round: int
    arrays: dict[str, np.ndarray]
    token: str
    configuration: str
    trained: dict[int, int] = field(default_factory=dict)
    rounds: str = ""
    server: dict[str, np.ndarray] = field(default_factory=dict)

    def stored_arrays(self) -> dict[str, np.ndarray]:
        """The global arrays and the server's state (under ``SERVER_PREFIX``), as the
        file holds them beside its binding."""
        return {**self.arrays, **{SERVER_PREFIX + k: v for k, v in self.server.items()}}

    def digest(self, key: bytes) -> str:
        """HMAC-SHA256 under ``key`` of the round, the binding and every array (names,
        dtypes, shapes, bytes): what ``load_checkpoint`` recomputes to see the file
        unchanged, and what no one without the run's key can recompute."""
        h = hmac.new(key, digestmod=hashlib.sha256)
        binding = [
            self.round,
            self.token,
            self.configuration,
            sorted(self.trained.items()),
            self.rounds,
        ]
        h.update(json.dumps(binding).encode())
        stored = self.stored_arrays()
        for name in sorted(stored):
            values = np.ascontiguousarray(stored[name])
            h.update(json.dumps([name, values.dtype.str, list(values.shape)]).encode())
            h.update(values.tobytes())
        return h.hexdigest()


def configuration_digest(config: Mapping[str, Any]) -> str:
    """SHA-256 of the run-config keys that change what a run computes (all but
    ``NOT_COMPUTED``), from the resolved configuration (``RunConfig.to_mapping()`` or a
    run's ``config.json``)."""
    computed = {key: value for key, value in config.items() if key not in NOT_COMPUTED}
    return hashlib.sha256(json.dumps(computed, sort_keys=True).encode()).hexdigest()


def new_run_key(directory: Path) -> None:
    """Write a fresh run's secret key (``KEY_FILE``, 0600 from its first byte)."""
    path = directory / KEY_FILE
    path.unlink(missing_ok=True)
    handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(handle, os.urandom(KEY_BYTES))
        os.fsync(handle)
    finally:
        os.close(handle)


def run_key(directory: Path) -> bytes:
    """The run's secret key.

    Raises
    ------
    CheckpointError
        If ``KEY_FILE`` is missing, not a regular file, or not ``KEY_BYTES`` long.
    """
    path = directory / KEY_FILE
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        raise CheckpointError(
            f"{path}, the run's key to its checkpoint, is missing or not a file (it is "
            f"written at the run's start); without it no checkpoint can be checked: {FIX}"
        ) from None
    with os.fdopen(handle, "rb") as stream:
        key = stream.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise CheckpointError(f"{path} is not a run key ({len(key)} bytes); {FIX}")
    return key


def save_checkpoint(directory: Path, checkpoint: Checkpoint) -> Path:
    """Atomically replace ``directory/checkpoint.npz`` with ``checkpoint``, its digest
    under the run's key (``run_key``)."""
    reserved = sorted(
        name for name in checkpoint.arrays if name in RESERVED or name.startswith(SERVER_PREFIX)
    )
    if reserved:
        raise ValueError(f"array name(s) {reserved} are reserved for the checkpoint's binding")
    path = directory / CHECKPOINT_FILE
    trained = np.array(sorted(checkpoint.trained.items()), dtype=np.int64).reshape(-1, 2)
    save_npz(
        path,
        {
            ROUND_KEY: np.array(checkpoint.round),
            TOKEN_KEY: np.array(checkpoint.token),
            CONFIGURATION_KEY: np.array(checkpoint.configuration),
            TRAINED_KEY: trained,
            ROUNDS_KEY: np.array(checkpoint.rounds),
            DIGEST_KEY: np.array(checkpoint.digest(run_key(directory))),
            **checkpoint.stored_arrays(),
        },
    )
    return path


@dataclass
class CheckpointWriter:
    """Writes a run's checkpoint after each round, bound to the run, with the last round
    each partition trained in (``Checkpoint.trained``; a resumed run continues the one
    its checkpoint holds).

    Parameters
    ----------
    directory : Path
        The run directory.
    token : str
        The run's token (``run.json``).
    configuration : str
        ``configuration_digest`` of the run's configuration.
    trained : dict of int to int, optional
        The rounds each partition last trained in, so far.
    """

    directory: Path
    token: str
    configuration: str
    trained: dict[int, int] = field(default_factory=dict)

    def trained_in(self, server_round: int, partitions: Iterable[int]) -> None:
        """``partitions`` replied to ``server_round``'s training without error."""
        self.trained.update(dict.fromkeys(partitions, server_round))

    def save(
        self,
        server_round: int,
        arrays: dict[str, np.ndarray],
        rounds: str,
        server: dict[str, np.ndarray] | None = None,
    ) -> Path:
        """The checkpoint after ``server_round``, with the global ``arrays``, the
        digest of ``rounds.jsonl`` up to it (``rounds``) and the server's own state."""
        checkpoint = Checkpoint(
            server_round, arrays, self.token, self.configuration, dict(self.trained), rounds,
            dict(server or {}),
        )  # fmt: skip
        return save_checkpoint(self.directory, checkpoint)


FIX = "restore the run's own checkpoint, or start afresh (resume = false)"


def load_checkpoint(
    directory: Path, *, num_rounds: int, token: str, configuration: str
) -> Checkpoint:
    """``directory``'s checkpoint, if it is the one the run with ``token`` and the
    configuration of digest ``configuration`` wrote after a round in
    ``1 .. num_rounds - 1``.

    Raises
    ------
    CheckpointError
        If there is none, it is not a regular file (a symbolic link), it does not read
        (truncated, not an npz), it holds no binding, it was changed after it was
        written, it is another run's or another configuration's, its round is outside
        the run, or an array is not finite; the message names the file and what to do.
    """
    path = directory / CHECKPOINT_FILE
    stored = _read(path)
    checkpoint = _unpack(path, stored)
    last = num_rounds - 1
    if not 1 <= checkpoint.round <= last:
        raise CheckpointError(
            f"{path} is at round {checkpoint.round}, not in 1..{last} (num-rounds = "
            f"{num_rounds}); nothing to resume there, or it is damaged: {FIX}"
        )
    if checkpoint.token != token:
        raise CheckpointError(
            f"{path} was written by another run (token '{checkpoint.token}'; this run's "
            f"run.json says '{token}'): {FIX}"
        )
    if not hmac.compare_digest(str(stored[DIGEST_KEY]), checkpoint.digest(run_key(directory))):
        raise CheckpointError(
            f"{path} was changed after it was written (its round or arrays do not match "
            f"its digest): {FIX}"
        )
    if checkpoint.configuration != configuration:
        raise CheckpointError(
            f"{path} was written under another configuration than this run's (they differ "
            f"in a key that changes what is computed: any but {sorted(NOT_COMPUTED)}): "
            "resume with the configuration that wrote it, or start afresh (resume = false)"
        )
    for name, values in checkpoint.arrays.items():
        if values.dtype.kind == "f" and not np.all(np.isfinite(values)):
            raise CheckpointError(f"{path}: array '{name}' is not finite; {FIX}")
    return checkpoint


def _read(path: Path) -> dict[str, np.ndarray]:
    """Every array of the regular file ``path``, which is opened without following a
    link (a link swapped in after the check is refused as well)."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        raise NoCheckpointError(
            f"{path.parent} has no {CHECKPOINT_FILE} to resume from; run without resume = true"
        ) from None
    if stat.S_ISLNK(mode):
        raise CheckpointError(
            f"{path} is a symbolic link: a run resumes only from the checkpoint it wrote in "
            f"its own directory; replace the link with that file, or start afresh "
            "(resume = false)"
        )
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path} is not a regular file; {FIX}")
    try:
        with (
            os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as handle,
            np.load(handle, allow_pickle=False) as stored,
        ):
            return {name: stored[name] for name in stored.files}
    except Exception as error:
        raise CheckpointError(f"{path} cannot be read ({type(error).__name__}); {FIX}") from None


def _unpack(path: Path, stored: dict[str, np.ndarray]) -> Checkpoint:
    """The checkpoint ``stored`` holds; an error if its round or binding is missing."""
    if any(key not in stored for key in RESERVED):
        raise CheckpointError(
            f"{path} holds no round number or no binding to its run (written by an older "
            f"fedpers, or not a checkpoint); {FIX}"
        )
    stored_round, trained = stored[ROUND_KEY], stored[TRAINED_KEY]
    if stored_round.shape != () or stored_round.dtype.kind not in "iu":
        raise CheckpointError(f"{path} holds no round number; {FIX}")
    if trained.ndim != 2 or trained.shape[1] != 2 or trained.dtype.kind not in "iu":
        raise CheckpointError(f"{path}: '{TRAINED_KEY}' is not a table of rounds; {FIX}")
    return Checkpoint(
        round=int(stored_round),
        arrays={
            k: v for k, v in stored.items() if k not in RESERVED and not k.startswith(SERVER_PREFIX)
        },
        token=str(stored[TOKEN_KEY]),
        configuration=str(stored[CONFIGURATION_KEY]),
        trained={int(p): int(r) for p, r in trained},
        rounds=str(stored[ROUNDS_KEY]),
        server={
            k[len(SERVER_PREFIX) :]: v for k, v in stored.items() if k.startswith(SERVER_PREFIX)
        },
    )
