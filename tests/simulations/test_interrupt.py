"""Interrupting a script or `fedpers run` keeps its rounds, and the same command with
--resume finishes the run as if nothing had happened.

Each interruption is a real signal to a real process, sent once the run's rounds.jsonl
holds a few rounds: the process must exit with 128 + the signal and one line of what it
kept and one with the command that resumes (no traceback), every unfinished run must
have failure.json (interrupted, its rounds) and no process of it may be left. Then the
printed command, run as printed, must finish the runs: bit-identical to an uninterrupted
run of the same command (rounds, summary but for its timings, the checkpoint's arrays),
or, through Flower, equal to the run's in-process twin to 1e-9.

Before: SIGINT ended a script with a 25-line KeyboardInterrupt traceback and no
failure.json; the same command was refused ("not empty; pass --overwrite"), resume=true
wanted client-state-dir, and --overwrite deleted the interrupted run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpers.simulations import interrupt
from fedpers.simulations.runs import MARKER, prepare_output

ROOT = Path(__file__).resolve().parents[2]
PYTHON = Path(sys.executable)


def _digest(directory: Path) -> str:
    """Rounds, clients and summary without timings, and the checkpoint's arrays."""

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            timing = ("seconds", "unix", "wall", "elapsed")
            return {k: clean(v) for k, v in value.items() if not any(t in k for t in timing)}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    rounds = [clean(json.loads(x)) for x in (directory / "rounds.jsonl").read_text().splitlines()]
    clients = (directory / "clients.jsonl").read_text()
    summary = clean(json.loads((directory / "summary.json").read_text()))
    digest = hashlib.sha256(json.dumps([rounds, clients, summary], sort_keys=True).encode())
    with np.load(directory / "checkpoint.npz") as stored:
        for name in sorted(stored.files):
            if not name.startswith("__"):
                digest.update(name.encode() + np.ascontiguousarray(stored[name]).tobytes())
    return digest.hexdigest()


def _interrupt(
    command: list[str],
    watched: Path,
    rounds: int,
    signum: int,
    environment: dict[str, str] | None = None,
    before_signal: Callable[[], None] | None = None,
) -> tuple[int, str]:
    """Run ``command`` (from the checkout, with ``environment`` added), send ``signum``
    once ``watched`` (a rounds.jsonl) holds ``rounds`` lines (calling ``before_signal``
    first); its exit status and output."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | (environment or {})
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # as from a terminal: SIGINT handled (an xdist worker ignores it, and a child
        # would inherit that)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if watched.is_file() and len(watched.read_text().splitlines()) >= rounds:
                if before_signal is not None:
                    before_signal()
                process.send_signal(signum)
                break
            time.sleep(0.1)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, output


def _resume(output: str) -> list[str]:
    """The command the interrupted process printed, to run from the checkout."""
    line = next(x for x in output.splitlines() if x.startswith("resume with: "))
    words = shlex.split(line.removeprefix("resume with: "))
    if words[0] == "python":
        words[0] = str(PYTHON)
    elif words[0] == "fedpers":
        words[0] = str(PYTHON.parent / "fedpers")
    return words


def _check_interrupted(code: int, output: str, signum: int, runs: list[Path]) -> None:
    assert code == 128 + signum, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    name = signal.Signals(signum).name
    assert f"interrupted by {name}: 0 of {len(runs)} runs finished; kept " in output
    for directory in runs:
        failure = json.loads((directory / "failure.json").read_text())
        assert failure["interrupted"] is True
        assert failure["reason"] == f"interrupted by {name}"
        assert failure["rounds_completed"] >= 1
        assert not (directory / "summary.json").exists()


@pytest.mark.script  # a script's --quick form, five times as a process: make test, not check
def test_a_script_and_fedpers_run_resume_to_the_uninterrupted_result(tmp_path: Path) -> None:
    # The batched engine: the runs go in the script's process pool. SIGINT to a script.
    script = [str(PYTHON), "-m", "simulations.fedrep_images", "--quick", "--num-rounds", "16"]
    script += ["--methods", "fedrep", "--engine", "batched"]
    out = tmp_path / "script"
    code, output = _interrupt(
        [*script, "--out", str(out)], out / "runs/fedrep-seed0/rounds.jsonl", 3, signal.SIGINT
    )
    _check_interrupted(code, output, signal.SIGINT, [out / "runs/fedrep-seed0"])
    # The same command again, without --resume, names it (what prepare_output says)
    with pytest.raises(SystemExit, match="add --resume to continue its interrupted runs"):
        prepare_output(out, overwrite=False)
    resumed = subprocess.run(_resume(output), cwd=ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "--resume: 0 of 1 runs finished before, 1 go on from their last round" in resumed.stdout
    assert not (out / "runs/fedrep-seed0/failure.json").exists()
    reference = tmp_path / "reference"
    subprocess.run([*script, "--out", str(reference)], cwd=ROOT, check=True, capture_output=True)
    expected = _digest(reference / "runs/fedrep-seed0")
    assert _digest(out / "runs/fedrep-seed0") == expected

    # fedpers run of the same configuration (the script's config.json), SIGTERM
    given = json.loads((reference / "runs/fedrep-seed0/config.json").read_text())
    own = ("results-dir", "run-name", "resume", "client-state-dir", "seed")
    config = tmp_path / "same.toml"
    config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in given.items() if k not in own))
    fedpers = [str(PYTHON.parent / "fedpers"), "run", str(config)]
    out = tmp_path / "cli"
    code, output = _interrupt(
        [*fedpers, "--out", str(out)], out / "runs/fedrep-seed0/rounds.jsonl", 3, signal.SIGTERM
    )
    _check_interrupted(code, output, signal.SIGTERM, [out / "runs/fedrep-seed0"])
    assert _resume(output)[:2] == [str(PYTHON.parent / "fedpers"), "run"]
    resumed = subprocess.run(_resume(output), cwd=ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert _digest(out / "runs/fedrep-seed0") == expected


@pytest.mark.flower
def test_a_script_through_flower_is_interrupted_and_resumed(tmp_path: Path) -> None:
    from fedpers.simulations import equality, launch
    from fedpers.simulations.inprocess import InProcessSimulation

    script = [str(PYTHON), "-m", "simulations.fedrep_images", "--quick", "--num-rounds", "12"]
    script += ["--methods", "fedrep", "--parallel", "1"]
    out = tmp_path / "flower"
    run = out / "runs/fedrep-seed0"
    # Its Flower and Ray state in a folder of its own: the other worker's simulations
    # keep theirs in the checkout's .flwr, alive while this one is checked.
    work = tmp_path / "work"
    sessions: list[Path] = []  # Ray's session folders while the run trains

    def ray_sessions() -> None:
        sessions.extend(launch.ray_directory(work).rglob("session_*"))

    code, output = _interrupt(
        [*script, "--out", str(out)],
        run / "rounds.jsonl",
        2,
        signal.SIGINT,
        {launch.WORK_ENV: str(work)},
        ray_sessions,
    )
    _check_interrupted(code, output, signal.SIGINT, [run])
    assert "fedrep-seed0 | start-up | " in output
    assert (run / "flower.log").stat().st_size > 0  # Flower's log, kept for the stopped run
    # every process it started inherited its FEDPERS_WORK_DIR; none is left, nor its
    # private FLWR_HOME, nor the Ray session it started (before: every run's stayed, 28
    # after an afternoon)
    assert launch.processes_with_env(launch.WORK_ENV, str(work)) == []
    assert list((work / ".flwr").glob("sim-*")) == []
    assert sessions, f"the run's Ray kept no session under {launch.ray_directory(work)}"
    assert [s for s in sessions if s.exists()] == []
    resumed = subprocess.run(_resume(output), cwd=ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert len((run / "rounds.jsonl").read_text().splitlines()) == 12
    # What a user sees before round 1 and after the run (before: nothing for a minute,
    # and no word of where the results went)
    lines = resumed.stdout.splitlines()
    assert "starting a local Flower SuperLink for the runs" in lines
    assert any(line.startswith("SuperLink ready on 127.0.0.1:") for line in lines)
    stages = [line.split(" | ")[2] for line in lines if line.startswith("fedrep-seed0 | start-up")]
    assert stages[:3] == [
        "flwr run: the simulation starts Ray and 20 virtual nodes",
        "waiting for 20 nodes and their partitions",
        "nodes registered, partitions known; choosing the initial model",
    ]
    restored = re.fullmatch(
        r"checkpoint of round (\d+) and the nodes' state restored; round (\d+) starts", stages[3]
    )
    assert restored, stages
    assert int(restored[2]) == int(restored[1]) + 1 >= 2
    done = [line for line in lines if line.startswith("fedrep-seed0 | done | ")]
    assert len(done) == 1
    assert done[0].startswith(f"fedrep-seed0 | done | results in {run} | ")
    assert " s, rounds " in done[0]
    config = json.loads((run / "config.json").read_text())
    twin = {k: v for k, v in config.items() if k not in ("resume", "results-dir")}
    alone = InProcessSimulation(echo=lambda line: None).run(
        {**twin, "results-dir": str(tmp_path / "twin")}
    )
    assert equality.difference(_outcome(alone), _outcome(run)) < 1e-9


def _outcome(directory: Path) -> dict[str, Any]:
    """A run directory as ``equality.difference`` compares it (no node states)."""
    lines = {
        name: [json.loads(x) for x in (directory / name).read_text().splitlines()]
        for name in ("rounds.jsonl", "clients.jsonl")
    }
    with np.load(directory / "checkpoint.npz") as stored:
        state = {k: stored[k] for k in stored.files if not k.startswith("__")}
    return {
        "rounds": lines["rounds.jsonl"],
        "clients": lines["clients.jsonl"],
        "state": state,
        "nodes": {},
    }


def test_resume_command_drops_overwrite_and_adds_resume() -> None:
    argv = ["/x/.venv/bin/python3.11", "-m", "simulations.fedrep_images", "--out", "a b"]
    assert (
        interrupt.resume_command([*argv, "--overwrite"])
        == "python -m simulations.fedrep_images --out 'a b' --resume"
    )
    cli = ["/x/.venv/bin/python", "/x/.venv/bin/fedpers", "run", "c.toml", "--out", "o"]
    assert interrupt.resume_command(cli) == "fedpers run c.toml --out o --resume"


def test_overwrite_keeps_interrupted_runs_unless_told_twice(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = out / "runs" / "fedrep-seed0"
    run.mkdir(parents=True)
    (out / MARKER).write_text("")
    (run / "checkpoint.npz").write_bytes(b"x")
    (run / "rounds.jsonl").write_text('{"round": 1}\n')
    with pytest.raises(SystemExit, match=r"interrupted runs that --resume can continue: "):
        prepare_output(out, overwrite=True)
    assert run.is_dir()
    with pytest.raises(SystemExit, match=r"give one"):
        prepare_output(out, overwrite=True, resume=True)
    assert prepare_output(out, overwrite=False, resume=True) == out.resolve()
    assert run.is_dir()
    prepare_output(out, overwrite=True, discard_interrupted=True)
    assert not run.exists()
    elsewhere = tmp_path / "not-a-script-output"
    elsewhere.mkdir()
    with pytest.raises(SystemExit, match=r"is not such a directory"):
        prepare_output(elsewhere, overwrite=False, resume=True)


@pytest.mark.parametrize(
    ("module", "offered"),
    [("fedrep_images", True), ("sheaf_shift", True), ("fedrep_linear", True), ("scale", False)],
)
def test_resume_is_offered_by_the_scripts_that_resume(
    module: str, offered: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    script = importlib.import_module(f"fedpers.simulations.{module}")
    with pytest.raises(SystemExit):
        script.main(["--help"])
    assert ("[--resume]" in capsys.readouterr().out) is offered
