"""Resume is exact or refuses; checkpoints, snapshots and results directories survive
damage and concurrent runs. The ServerApp's ``main`` runs in process against an
in-process grid of real ClientApps (no Ray)."""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, MessageType, RecordDict

from fedpers import protocol
from fedpers.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    CheckpointError,
    ResumeError,
    configuration_digest,
    load_checkpoint,
    new_run_key,
    save_checkpoint,
)
from fedpers.clients import device_state
from fedpers.clients.client_app import app as client_app
from fedpers.config import ConfigError, RunConfig, load_run_config
from fedpers.reports import read_config, read_rounds, read_summary
from fedpers.results import (
    CONFIG_FILE,
    FAILURE_FILE,
    ROUNDS_FILE,
    RUN_FILE,
    SUMMARY_FILE,
    ResultsExistError,
    RunRecorder,
    read_token,
    rounds_digest,
)
from fedpers.strategies import server_app
from fedpers.strategies.rounds import RoundFailedError
from tests.helpers import InProcessGrid, run_config

SETTINGS = {"dataset": "digits", "num_clients": 4, "fraction_train": 0.5, "epochs": 1}


def _serve(tmp_path: Path, grid: InProcessGrid | None = None, **overrides: Any) -> Path:
    values = run_config(
        **{**SETTINGS, "results_dir": str(tmp_path), "run_name": "run", **overrides}
    )
    grid = grid or InProcessGrid(client_app, values, values["num-clients"])
    for context in grid.contexts.values():
        context.run_config = dict(values)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=values)
    server_app.main(grid, context)  # type: ignore[arg-type]
    return tmp_path / values["run-name"]


def _killed_from_round_3(node: int, message: Any) -> str | None:
    """Every node fails its training from round 3 on, as if the run were killed there."""
    config = message.content.config_records.get(protocol.CONFIG)
    training = message.metadata.message_type == MessageType.TRAIN
    late = config is not None and int(config.get(protocol.ROUND, 0)) >= 3
    return "killed" if training and late else None


def test_resume_without_client_state_refuses_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'client-state-dir' is empty"):
        load_run_config({"algorithm": "fedrep", "resume": True}).check_client_state()
    # the simulated ServerApp refuses it before it writes anything
    with pytest.raises(ConfigError, match="'client-state-dir' is empty"):
        _serve(tmp_path, algorithm="fedrep", resume=True, run_name="r")
    assert not (tmp_path / "r").exists()
    for algorithm in (
        "fedgmm",
        "sheaf-frl",
        "ditto",
        "fedbabu",
        "scaffold",
        "feddyn",
        "moon",
        "fedrod",
        "fedala",
        "apfl",
        "l2gd",
        "fed-mtl",
        "fedamp",
        "pfedme",
    ):
        config = load_run_config({"algorithm": algorithm, "resume": True, "dataset": "digits"})
        with pytest.raises(ConfigError, match="keeps state on its clients"):
            config.check_client_state()
    # FedAvg keeps nothing on its clients: its checkpoint alone resumes it exactly
    load_run_config({"algorithm": "fedavg", "resume": True}).check_client_state()


# SCAFFOLD: its server variate c is in the checkpoint, each client's c_i in its snapshot.
# FedDyn: the server's h in the checkpoint, each client's g_k in its snapshot.
# MOON: each client's previous body in its snapshot. FedRoD: its personal head there.
# FedALA: each client's model and its weights W there.
# APFL: v and alpha in the snapshots. L2GD: the mean of all x_i in the checkpoint, the
# x_i in the snapshots (and the round's coin drawn again from the seed). Fed-MTL and
# FedAMP: every client's model in the checkpoint and on its device. pFedMe: theta in the
# snapshots. pFedHN: the hypernetwork and the embeddings in the checkpoint alone.
# Clustered FL: the clusters' models and who is in which, in the checkpoint alone.
# FedProto: the global prototypes in the checkpoint, the agents in their snapshots.
# Sheaf-FMTL: each agent's model and restriction maps in its snapshot, nothing on the server.
# FedMuscle: the agents in their snapshots; the round's pilot batch and draws from the seed.
# CoMFed: each agent's model and projection in its snapshot.
@pytest.mark.parametrize(
    "algorithm",
    [
        "fedrep",
        "sheaf-frl",
        "scaffold",
        "feddyn",
        "moon",
        "fedrod",
        "fedala",
        "apfl",
        "l2gd",
        "fed-mtl",
        "fedamp",
        "pfedhn",
        "pfedme",
        "clustered-fl",
        "fedproto",
        "sheaf-fmtl",
        "fedmuscle",
        "comfed",
    ],
)
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path: Path, algorithm: str) -> None:
    # Prepare: the same run straight, and interrupted in round 3 (every node fails, so
    # round 2's checkpoint is the last), then resumed on fresh nodes (empty state).
    # Sheaf-FRL's agents answer relay queries before they train: they must hold their
    # restored state by then.
    state = {
        "algorithm": algorithm,
        "num_rounds": 4,
        "num_clients": 10,
        "client_state_dir": str(tmp_path / "s"),
    }
    if algorithm in {"fedproto", "fedmuscle"}:  # they need one latent dimension
        state["sheaf_latent_dims"] = ",".join(["8"] * 10)
    if algorithm == "fedmuscle":  # 16^4 tuples a step, not 64^4: the same code, faster
        state["sheaf_pilot_batch"] = 16
    if algorithm == "sheaf-fmtl":  # smaller maps, the same code
        state["sheaf_fmtl_gamma"] = 0.002
    straight = _serve(tmp_path / "a", **state)
    values = run_config(**{**SETTINGS, **state, "results_dir": str(tmp_path), "run_name": "run"})
    with pytest.raises(RoundFailedError):
        _serve(tmp_path, InProcessGrid(client_app, values, 10, fail=_killed_from_round_3), **state)
    # Execute
    resumed = _serve(tmp_path, resume=True, **state)
    # Assert: every round's record and the summary as in the uninterrupted run, clocks aside
    for a, b in zip(read_rounds(straight), read_rounds(resumed), strict=True):
        assert _untimed(asdict(a)) == _untimed(asdict(b))
    assert _untimed(read_summary(straight)) == _untimed(read_summary(resumed))


def _forge(directory: Path, server_round: int, arrays: dict[str, np.ndarray]) -> None:
    """A checkpoint of ``arrays`` after ``server_round``, bound to the run in
    ``directory`` as the run itself would have written it."""
    token, configuration = read_token(directory), configuration_digest(read_config(directory))
    rounds = rounds_digest(read_rounds(directory)[:server_round])
    save_checkpoint(
        directory, Checkpoint(server_round, arrays, token, configuration, rounds=rounds)
    )


def _untimed(value: dict[str, Any]) -> dict[str, Any]:
    """A round record or a summary without the entries that hold clock readings."""
    return {k: v for k, v in value.items() if not k.endswith(("seconds", "_unix"))}


def test_a_damaged_checkpoint_is_named_with_its_fix_and_recorded(tmp_path: Path) -> None:
    state = str(tmp_path / "s")
    _serve(tmp_path, num_rounds=3, client_state_dir=state)
    (tmp_path / "run" / "summary.json").unlink()  # interrupted: a finished run gets no failure
    path = tmp_path / "run" / CHECKPOINT_FILE
    path.write_bytes(path.read_bytes()[:100])  # cut short, as a crash would leave it
    with pytest.raises(CheckpointError, match=r"checkpoint\.npz cannot be read"):
        _serve(tmp_path, num_rounds=3, resume=True, client_state_dir=state)
    failure = json.loads((tmp_path / "run" / FAILURE_FILE).read_text())
    assert "cannot be read" in failure["reason"]
    assert "start afresh" in failure["reason"]


@pytest.mark.parametrize("stored_round", [-3, 1_000_000, 3])
def test_a_checkpoint_round_outside_the_run_is_refused(tmp_path: Path, stored_round: int) -> None:
    new_run_key(tmp_path)
    save_checkpoint(tmp_path, Checkpoint(stored_round, {"body.w": np.zeros(2)}, "t", "c"))
    with pytest.raises(CheckpointError, match=f"at round {stored_round}, not in 1..2"):
        load_checkpoint(tmp_path, num_rounds=3, token="t", configuration="c")


def test_a_checkpoint_of_another_model_is_refused_before_any_round(tmp_path: Path) -> None:
    _serve(tmp_path, num_rounds=3, algorithm="fedavg")
    (tmp_path / "run" / "summary.json").unlink()
    _forge(tmp_path / "run", 2, {"renamed.weight": np.zeros((3, 3), np.float32)})
    with pytest.raises(CheckpointError, match="does not fit this run"):
        _serve(tmp_path, num_rounds=3, resume=True, algorithm="fedavg")
    assert "does not fit" in json.loads((tmp_path / "run" / FAILURE_FILE).read_text())["reason"]


def test_a_half_written_last_round_is_dropped_and_resume_rewrites_the_file(
    tmp_path: Path,
) -> None:
    _serve(tmp_path, num_rounds=3, algorithm="fedavg")
    rounds_file = tmp_path / "run" / ROUNDS_FILE
    whole = rounds_file.read_text().splitlines()
    (tmp_path / "run" / "summary.json").unlink()
    _forge(tmp_path / "run", 2, dict(np.load(tmp_path / "run" / "final_arrays.npz")))
    rounds_file.write_text("\n".join(whole[:2]) + "\n" + whole[2][:25])  # round 3 cut short
    assert [r.round for r in read_rounds(tmp_path / "run")] == [1, 2]
    _serve(tmp_path, num_rounds=3, resume=True, algorithm="fedavg")
    assert [r.round for r in read_rounds(tmp_path / "run")] == [1, 2, 3]
    assert read_summary(tmp_path / "run")["rounds"] == 3


def test_a_damaged_line_before_the_last_is_an_error(tmp_path: Path) -> None:
    (tmp_path / ROUNDS_FILE).write_text('{"round": 1, "seconds": 1.0}\nnot json\n{}\n')
    with pytest.raises(ValueError, match="line 2, is not a round record"):
        read_rounds(tmp_path)


def test_two_runs_of_one_name_cannot_write_the_same_directory(tmp_path: Path) -> None:
    config = {"algorithm": "fedrep"}
    first = RunRecorder(
        tmp_path / "run", config, name="a", total_rounds=2, progress_metric="train.loss"
    )
    with pytest.raises(ResultsExistError, match="another run is writing"):
        RunRecorder(tmp_path / "run", config, name="b", total_rounds=2, progress_metric="x.y")
    first.release()


def test_runs_started_together_do_not_interleave(tmp_path: Path) -> None:
    outcomes: list[str] = []

    def start() -> None:
        try:
            RunRecorder(
                tmp_path / "run", {}, name="r", total_rounds=1, progress_metric="train.loss"
            )
            outcomes.append("claimed")
        except ResultsExistError:
            outcomes.append("refused")

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["claimed", "refused", "refused", "refused"]


def test_a_stale_failure_is_removed_when_a_run_starts(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / FAILURE_FILE).write_text('{"reason": "old"}')
    _serve(tmp_path, num_rounds=1, algorithm="fedavg")
    assert not (tmp_path / "run" / FAILURE_FILE).exists()
    assert (tmp_path / "run" / "summary.json").exists()


# ------------------------------------------------------------------ device snapshots
def _node(tmp_path: Path, run_name: str = "run") -> tuple[RunConfig, Context]:
    values = run_config(run_name=run_name, client_state_dir=str(tmp_path))
    context = Context(
        run_id=1,
        node_id=5,
        node_config={"partition-id": 2},
        state=RecordDict(),
        run_config=values,
    )
    return RunConfig.from_mapping(values), context


def _store(run: RunConfig, context: Context, value: float, server_round: int, token: str) -> None:
    from flwr.app import Array, ArrayRecord

    context.state["fedpers.personal"] = ArrayRecord({"head.weight": Array(np.full(3, value))})
    device_state.persist(run, context, server_round=server_round, token=token)


def _head(context: Context) -> np.ndarray:
    return context.state["fedpers.personal"]["head.weight"].numpy()


def test_a_damaged_newest_snapshot_falls_back_to_the_one_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a run in this process routed fedpers' loggers to Flower's (route_to_flower): let
    # them reach caplog again
    monkeypatch.setattr(logging.getLogger("fedpers"), "propagate", True)
    run, node = _node(tmp_path)
    _store(run, node, 1.0, 1, "t")
    _store(run, node, 2.0, 2, "t")
    newest = device_state.snapshots(run, node, "t")[2]
    newest.write_bytes(newest.read_bytes()[:50])
    fresh_run, fresh = _node(tmp_path)
    assert device_state.restore(fresh_run, fresh, before_round=3, token="t")
    np.testing.assert_array_equal(_head(fresh), np.full(3, 1.0))
    assert "is damaged" in caplog.text


def test_a_new_run_of_the_same_name_never_sees_the_old_runs_state(tmp_path: Path) -> None:
    run, old = _node(tmp_path)
    for server_round in range(1, 6):  # the old run was longer
        _store(run, old, 9.0, server_round, "old-run")
    _, new = _node(tmp_path)
    assert not device_state.restore(run, new, before_round=3, token="new-run")
    _store(run, new, 1.0, 1, "new-run")
    _store(run, new, 2.0, 2, "new-run")
    _store(run, new, 3.0, 3, "new-run")
    # the clean-up keeps the new run's last two, and never touches the old run's
    assert sorted(device_state.snapshots(run, new, "new-run")) == [2, 3]
    assert sorted(device_state.snapshots(run, old, "old-run")) == [4, 5]


# ------------------------------------------------------- a resume exact, or refused
# An interrupted run: 4 rounds, every node fails from round 3 on. Its rounds.jsonl holds
# rounds 1..3 (round 3 failed, so it has no checkpoint), its checkpoint is of round 2,
# and every partition trained in rounds 1 and 2 (fraction-train 1): each has a device
# snapshot of both rounds.
INTERRUPTED = {"num_rounds": 4, "fraction_train": 1.0}


def _interrupted(tmp_path: Path, run_name: str = "run", **overrides: Any) -> Path:
    settings = {
        **INTERRUPTED,
        "client_state_dir": str(tmp_path / "s"),
        "run_name": run_name,
        **overrides,
    }
    values = run_config(**{**SETTINGS, **settings, "results_dir": str(tmp_path)})
    grid = InProcessGrid(client_app, values, values["num-clients"], fail=_killed_from_round_3)
    with pytest.raises(RoundFailedError):
        _serve(tmp_path, grid, **settings)
    return tmp_path / run_name


def _assert_refused(tmp_path: Path, reason: str, **overrides: Any) -> None:
    """Resuming ``tmp_path/run`` fails before any round with ``reason`` (a regular
    expression), which its failure.json records."""
    settings = {**INTERRUPTED, "client_state_dir": str(tmp_path / "s"), **overrides}
    with pytest.raises(ValueError, match=reason):
        _serve(tmp_path, resume=True, **settings)
    directory = tmp_path / "run"
    assert re.search(reason, json.loads((directory / FAILURE_FILE).read_text())["reason"])
    assert not (directory / SUMMARY_FILE).exists()
    assert max(r.round for r in read_rounds(directory)) <= 3  # no round ran


def _snapshot(tmp_path: Path, partition: int, server_round: int, run_name: str = "run") -> Path:
    """The device snapshot of ``partition`` after ``server_round`` of a run."""
    (path,) = (tmp_path / "s").glob(f"{run_name}-*-partition-{partition}-round-{server_round}.npz")
    return path


def test_a_checkpoint_of_another_run_is_refused(tmp_path: Path) -> None:
    directory = _interrupted(tmp_path)
    other = _interrupted(tmp_path, "other", seed=1)
    shutil.copyfile(other / CHECKPOINT_FILE, directory / CHECKPOINT_FILE)
    _assert_refused(tmp_path, r"checkpoint\.npz was written by another run")


def test_a_symlinked_checkpoint_is_refused(tmp_path: Path) -> None:
    # even a link to the run's own checkpoint: a run resumes from a file in its directory
    directory = _interrupted(tmp_path)
    moved = tmp_path / "elsewhere.npz"
    (directory / CHECKPOINT_FILE).rename(moved)
    (directory / CHECKPOINT_FILE).symlink_to(moved)
    _assert_refused(tmp_path, r"checkpoint\.npz is a symbolic link")


@pytest.mark.parametrize("edited_round", [1, 3])
def test_a_checkpoint_with_an_edited_round_is_refused(tmp_path: Path, edited_round: int) -> None:
    directory = _interrupted(tmp_path)
    with np.load(directory / CHECKPOINT_FILE) as stored:
        values = {name: stored[name] for name in stored.files}
    values["__round__"] = np.array(edited_round)
    np.savez(directory / CHECKPOINT_FILE, **values)
    _assert_refused(tmp_path, r"checkpoint\.npz was changed after it was written")


def test_a_checkpoint_of_another_configuration_is_refused(tmp_path: Path) -> None:
    # config.json edited to the new configuration: the checkpoint still knows its own
    directory = _interrupted(tmp_path)
    stored = json.loads((directory / CONFIG_FILE).read_text())
    (directory / CONFIG_FILE).write_text(json.dumps({**stored, "lr": 0.1}))
    _assert_refused(tmp_path, r"checkpoint\.npz was written under another configuration", lr=0.1)


def test_a_deleted_run_json_is_refused(tmp_path: Path) -> None:
    directory = _interrupted(tmp_path)
    (directory / RUN_FILE).unlink()
    _assert_refused(tmp_path, r"run\.json is missing")


@pytest.mark.parametrize(
    "lines",
    [[1, 1, 2, 3], [1, 3], [2, 1, 3], [1, 2, 3, 3]],
    ids=["duplicated", "gapped", "out-of-order", "two-after-the-checkpoint"],
)
def test_rounds_that_do_not_lead_to_the_checkpoint_are_refused(
    tmp_path: Path, lines: list[int]
) -> None:
    directory = _interrupted(tmp_path)
    by_round = {json.loads(line)["round"]: line for line in _lines(directory / ROUNDS_FILE)}
    (directory / ROUNDS_FILE).write_text("".join(by_round[r] for r in lines))
    before = (directory / ROUNDS_FILE).read_text()
    _assert_refused(tmp_path, r"rounds\.jsonl must hold rounds 1\.\.2 once each, in order")
    assert (directory / ROUNDS_FILE).read_text() == before  # refused, so left as it was


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


@pytest.mark.parametrize("tamper", ["swapped", "another-run", "renamed-round"])
def test_client_snapshots_that_are_not_the_nodes_own_refuse_the_resume(
    tmp_path: Path, tamper: str
) -> None:
    _interrupted(tmp_path)
    own, neighbour = _snapshot(tmp_path, 0, 2), _snapshot(tmp_path, 1, 2)
    if tamper == "swapped":  # partition 0 gets partition 1's head, and the other way round
        own.rename(tmp_path / "swap.npz")
        neighbour.rename(own)
        (tmp_path / "swap.npz").rename(neighbour)
    elif tamper == "another-run":
        _interrupted(tmp_path, "other", seed=1)
        shutil.copyfile(_snapshot(tmp_path, 0, 2, "other"), own)
    else:  # round 1's state where round 2's belongs
        own.unlink()
        _snapshot(tmp_path, 0, 1).rename(own)
    _assert_refused(tmp_path, r"partition 0: .*round-2\.npz is not this node's snapshot")


@pytest.mark.parametrize("algorithm", ["fedrep", "ditto"])
def test_deleted_client_snapshots_refuse_the_resume(tmp_path: Path, algorithm: str) -> None:
    # FedRep's head and Ditto's personal model exist only on the device: without them
    # the resumed run would restart partition 0 from scratch
    _interrupted(tmp_path, algorithm=algorithm)
    for server_round in (1, 2):
        _snapshot(tmp_path, 0, server_round).unlink()
    _assert_refused(tmp_path, r"partition 0: no snapshot of round 2 or later", algorithm=algorithm)


def test_a_resume_may_move_where_things_go_but_not_what_is_computed(tmp_path: Path) -> None:
    """The snapshots moved to another client-state-dir: the resume takes the new folder
    (and config.json says so); a key that changes what is computed is refused."""
    first, moved = tmp_path / "s", tmp_path / "moved"
    values = run_config(
        **{
            **SETTINGS,
            "num_rounds": 4,
            "client_state_dir": str(first),
            "results_dir": str(tmp_path),
            "run_name": "run",
        }
    )
    with pytest.raises(RoundFailedError):
        _serve(
            tmp_path,
            InProcessGrid(client_app, values, values["num-clients"], fail=_killed_from_round_3),
            client_state_dir=str(first),
            num_rounds=4,
        )
    with pytest.raises(ResumeError, match="under another configuration"):
        _serve(tmp_path, resume=True, client_state_dir=str(first), num_rounds=4, seed=7)
    shutil.move(first, moved)
    directory = _serve(tmp_path, resume=True, client_state_dir=str(moved), num_rounds=4)
    assert read_summary(directory)["rounds"] == 4
    config = read_config(directory)
    assert config["client-state-dir"] == str(moved)
    assert config["resume"] is False  # the run as first started, with where things go now


# Issue 46, "values that steer a resumed run": the checkpoint's digest is keyed by the
# run's own secret (.key), and it binds rounds.jsonl's rounds up to it.
def test_a_checkpoint_changed_and_its_digest_recomputed_without_the_key_is_refused(
    tmp_path: Path,
) -> None:
    directory = _interrupted(tmp_path)
    path = directory / CHECKPOINT_FILE
    with np.load(path) as stored:
        values = {name: stored[name] for name in stored.files}
    checkpoint = Checkpoint(
        int(values["__round__"]),
        {k: v * 1.01 for k, v in values.items() if not k.startswith("__")},
        str(values["__token__"]),
        str(values["__configuration__"]),
        {int(p): int(r) for p, r in values["__trained__"]},
        str(values["__rounds__"]),
    )
    for guess in (b"", bytes(32), b"fedpers"):  # what a reader without .key can try
        values["__digest__"] = np.array(checkpoint.digest(guess))
        values.update(checkpoint.arrays)
        np.savez(path, **values)
        _assert_refused(tmp_path, r"checkpoint\.npz was changed after it was written")
    assert (directory / ".key").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("clip", [-1.0, 1e-12, 1e9, "0.5"])
def test_an_edited_next_clip_in_rounds_jsonl_refuses_the_resume(
    tmp_path: Path, clip: object
) -> None:
    """Was: -1 hung the resumed run for ever, the others were used as given."""
    adaptive = {
        "dp": "central",
        "dp_clip": 1.0,
        "dp_noise_multiplier": 0.0,
        "dp_clip_quantile": 0.5,
    }
    directory = _interrupted(tmp_path, **adaptive)
    lines = (directory / ROUNDS_FILE).read_text().splitlines()
    record = json.loads(lines[1])
    assert "dp.next-clip" in record["server"]
    record["server"]["dp.next-clip"] = clip
    lines[1] = json.dumps(record)
    (directory / ROUNDS_FILE).write_text("\n".join(lines) + "\n")
    _assert_refused(tmp_path, r"rounds 1\.\.2 are not those its checkpoint", **adaptive)


def test_a_cluster_assignment_beyond_the_clusters_is_refused_by_name(tmp_path: Path) -> None:
    """Even with the run's key (a checkpoint rewritten by its owner): an unknown cluster
    id was a raw KeyError at the first round."""
    clustered = {"algorithm": "clustered-fl", "clustered_fl_max_clusters": 4}
    directory = _interrupted(tmp_path, **clustered)
    with np.load(directory / CHECKPOINT_FILE) as stored:
        arrays = {k: stored[k] for k in stored.files if not k.startswith("__")}
    (name,) = [k for k in arrays if k.endswith("assignment")]
    arrays[name] = np.full_like(arrays[name], 5.0)
    _forge(directory, 2, arrays)
    _assert_refused(tmp_path, r"cluster assignment names clusters \[5\.0\]", **clustered)
