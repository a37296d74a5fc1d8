"""Fault tolerance through real `flwr run` simulations: faults injected on purpose, a
run that falls below its minimum of replies, and a SIGKILLed server resumed."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from fedpers.reports import read_rounds, read_summary
from fedpers.simulations.launch import FlowerRunError, LocalSimulation
from tests.simulations.conftest import InProcessSimulation, assert_same_numbers

pytestmark = pytest.mark.flower


def test_faulty_clients_are_left_out_until_too_few_remain(
    simulation: LocalSimulation, tmp_path: Path
) -> None:
    faults = "sleep:1@1,raise:2@2,nan:3@2," + ",".join(f"raise:{p}@3" for p in range(5))
    with pytest.raises(
        FlowerRunError, match="round 3: 1 usable replies of 6, fewer than min-replies = 2"
    ):
        simulation.run(
            {
                "dataset": "digits",
                "num-clients": 6,
                "fraction-train": 1.0,
                "num-rounds": 4,
                "round-timeout": 10.0,
                "min-replies": 2,
                "fault-injection": faults,
                "results-dir": str(tmp_path),
                "run-name": "faults",
            },
            # Two actors, as in a run on two cores: with one, the client that sleeps past
            # the round's timeout would hold up every other client of the round.
            cpus_per_client=1,
        )
    directory = tmp_path / "faults"
    rounds = read_rounds(directory)  # every line complete and readable
    assert [r.round for r in rounds] == [1, 2, 3]
    assert rounds[0].rejections == ["partition 1: no reply within 10 s"]
    assert rounds[1].failures == 2
    assert rounds[1].rejections[0].startswith("partition 2: client error")
    assert (
        rounds[1].rejections[1] == "partition 3: non-finite values in array 'arrays/body.0.weight'"
    )
    assert rounds[2].replies == 1
    assert all(r.evaluate["accuracy"] > 0 for r in rounds)
    failure = json.loads((directory / "failure.json").read_text())
    assert failure["rounds_completed"] == 3
    assert "RoundFailedError" in failure["reason"]
    assert not (directory / "summary.json").exists()
    assert (directory / "checkpoint.npz").exists()


def test_a_killed_server_resumes_to_the_uninterrupted_result(
    simulation: LocalSimulation, tmp_path: Path
) -> None:
    settings = {
        "dataset": "digits",
        "num-clients": 10,
        "fraction-train": 0.5,
        "num-rounds": 4,
        "results-dir": str(tmp_path),
        "client-state-dir": str(tmp_path / "device-state"),
    }
    # The uninterrupted run in process: the double writes what Flower's run writes, to
    # 1e-9 (tests/simulations/conftest.py), and a resume that restored the wrong state
    # misses by far more.
    straight = InProcessSimulation().run({**settings, "run-name": "straight"})
    outcome: dict[str, object] = {}

    def interrupted() -> None:
        try:
            outcome["dir"] = simulation.run({**settings, "run-name": "resumed"})
        except FlowerRunError as error:
            outcome["error"] = error

    runner = threading.Thread(target=interrupted)
    runner.start()
    rounds_file = tmp_path / "resumed" / "rounds.jsonl"
    deadline = time.monotonic() + 180
    while not (rounds_file.exists() and len(rounds_file.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline, "the run never reached round 2"
        time.sleep(0.05)
    assert simulation.kill_server()  # SIGKILL: no chance to write anything more
    runner.join(timeout=120)
    assert "error" in outcome
    # Neither a summary nor a failure was written: the error shows Flower's side.
    assert "superlink.log (last 30 lines)" in str(outcome["error"])
    assert len(read_rounds(tmp_path / "resumed")) < 4
    resumed = simulation.run({**settings, "run-name": "resumed", "resume": True})
    assert [r.round for r in read_rounds(resumed)] == [1, 2, 3, 4]
    for a, b in zip(read_rounds(straight), read_rounds(resumed), strict=True):
        assert_same_numbers((a.train, a.evaluate), (b.train, b.evaluate), f"round {a.round}")
    assert read_summary(resumed)["final_accuracy"] == pytest.approx(
        read_summary(straight)["final_accuracy"], rel=1e-9
    )
