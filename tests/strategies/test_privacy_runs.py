"""Private runs end to end, in process (the real ServerApp and ClientApps on an
InProcessGrid): the mechanism with no noise and no clip is the non-private run, bit for
bit, and a private run records the epsilon it spent, as a second accountant counts it."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpers import privacy
from fedpers.checkpoint import ResumeError
from fedpers.config import load_run_config
from fedpers.privacy import DpSampling
from fedpers.reports import read_rounds
from fedpers.strategies import build_strategy
from tests.simulations.conftest import InProcessSimulation

# Equal training sizes (each MNIST-1D client generates 130 samples): FedAvg's weights are
# equal, as the private mean's are.
BASE = {
    "algorithm": "fedavg",
    "num-clients": 8,
    "partitioner": "generated",
    "fraction-train": 0.5,
    "num-rounds": 3,
    "final-rounds": 1,
    "epochs": 1,
}


def _run(tmp_path: Path, name: str, **overrides: Any) -> Path:
    values = {**BASE, "results-dir": str(tmp_path), "run-name": name, **overrides}
    return InProcessSimulation().run(values)


def _rounds(directory: Path) -> list[dict[str, Any]]:
    lines = (directory / "rounds.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_no_noise_and_no_clip_is_the_non_private_run_bit_for_bit(tmp_path: Path, mode: str) -> None:
    # Prepare / Execute: the same run without DP, and with DP that adds nothing
    plain = _run(tmp_path, "plain")
    inert = _run(
        tmp_path, f"inert-{mode}", dp=mode, **{"dp-noise-multiplier": 0.0, "dp-clip": 0.0,
        "dp-sampling": "without-replacement"},
    )  # fmt: skip
    # Assert: the same final arrays and the same figures every round
    a, b = np.load(plain / "final_arrays.npz"), np.load(inert / "final_arrays.npz")
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name])
    for x, y in zip(_rounds(plain), _rounds(inert), strict=True):
        assert x["train"] == y["train"]
        assert x["evaluate"] == y["evaluate"]
        assert x.get("clients") == y.get("clients")
    assert json.loads((inert / "summary.json").read_text())["privacy"]["epsilon"] is None


def test_a_private_run_records_the_epsilon_a_second_accountant_counts(tmp_path: Path) -> None:
    from opacus.accountants import PRVAccountant

    # Execute: central DP, Poisson sampling at 0.5 of 8 clients, 3 rounds
    directory = _run(
        tmp_path, "private", dp="central",
        **{"dp-noise-multiplier": 2.0, "dp-clip": 1.0, "dp-delta": 1e-5},
    )  # fmt: skip
    summary = json.loads((directory / "summary.json").read_text())["privacy"]
    rounds = _rounds(directory)
    # Assert: the mechanism as recorded, epsilon growing every round
    assert summary["sampling"] == "poisson"
    assert summary["neighboring"] == "add-or-remove-one"
    assert (summary["population"], summary["sampling_rate"], summary["rounds"]) == (8, 0.5, 3)
    assert summary["delta"] == 1e-5
    spent = [r["server"][privacy.EPSILON] for r in rounds]
    assert spent == sorted(spent)
    assert spent[0] > 0
    assert spent[-1] == pytest.approx(summary["epsilon"])
    expected = privacy.epsilon(DpSampling.POISSON, 2.0, 0.5, 8, 4.0, 3, summary["delta"])
    assert summary["epsilon"] == pytest.approx(expected)
    prv = PRVAccountant()
    for _ in range(3):
        prv.step(noise_multiplier=2.0, sample_rate=0.5)
    assert abs(summary["epsilon"] - prv.get_epsilon(summary["delta"])) <= 0.05 * summary["epsilon"]
    assert all(math.isfinite(x) for r in rounds for x in r["evaluate"].values())


def test_a_target_epsilon_chooses_the_noise_and_is_not_exceeded(tmp_path: Path) -> None:
    directory = _run(
        tmp_path, "target", algorithm="fedrep", dp="central",
        **{"dp-target-epsilon": 8.0, "dp-clip": 1.0, "dp-sampling": "without-replacement"},
    )  # fmt: skip
    summary = json.loads((directory / "summary.json").read_text())["privacy"]
    assert summary["neighboring"] == "replace-one"
    assert summary["epsilon"] <= 8.0
    assert summary["noise_multiplier"] == pytest.approx(
        privacy.calibrate(8.0, DpSampling.WITHOUT_REPLACEMENT, 0.5, 8, 4.0, 3, 8**-1.1)
    )


def test_an_adaptive_clip_is_recorded_applied_and_resumed(tmp_path: Path) -> None:
    """Adaptive clipping end to end: each round applies the clip the round before chose
    (from dp-clip), the epsilon is the fixed-clip run's (the accountant counts z), and
    a resumed strategy continues from the clip of its last recorded round."""

    adaptive = {
        "dp": "central", "dp-noise-multiplier": 1.0, "dp-clip": 0.5,
        "dp-clip-quantile": 0.5, "dp-clip-count-std": 1.0, "dp-delta": 1e-5,
    }  # fmt: skip
    directory = _run(tmp_path, "adaptive", **adaptive)
    rounds = [r["server"] for r in _rounds(directory)]
    assert rounds[0][privacy.CLIP] == 0.5
    for before, after in itertools.pairwise(rounds):
        assert after[privacy.CLIP] == before[privacy.NEXT_CLIP]
    assert len({r[privacy.CLIP] for r in rounds}) == len(rounds)  # it moved every round
    summary = json.loads((directory / "summary.json").read_text())["privacy"]
    assert summary["adaptive_clip"]["update_noise_multiplier"] == pytest.approx(
        (1.0 - (2 * 1.0) ** -2) ** -0.5
    )
    expected = privacy.epsilon(DpSampling.POISSON, 1.0, 0.5, 8, 4.0, 3, 1e-5)
    assert summary["epsilon"] == pytest.approx(expected)
    # Resume after round 2: the strategy continues at round 2's next clip
    config = load_run_config({**BASE, **adaptive})
    strategy = build_strategy(config)
    records = read_rounds(directory)[:2]
    strategy.resume_after(records)
    assert strategy.clip == rounds[1][privacy.NEXT_CLIP]
    del records[-1].server[privacy.NEXT_CLIP]
    with pytest.raises(ResumeError, match=r"round 2 of rounds.jsonl has no 'dp.next-clip'"):
        build_strategy(config).resume_after(records)


def test_each_release_clips_at_the_clip_the_round_before_chose() -> None:
    """The strategy's release, without noise (so the count is exact too): the update is
    clipped at the current clip, not dp-clip, and the next clip is Algorithm 1's."""

    config = load_run_config(
        {**BASE, "dp": "central", "dp-noise-multiplier": 0.0, "dp-clip": 1.0,
         "dp-clip-quantile": 0.5, "dp-sampling": "without-replacement"}
    )  # fmt: skip
    strategy = build_strategy(config)
    assert strategy.privacy is not None
    reference = {"w": np.zeros(4)}
    strategy.current_shared = reference
    strategy.sampled = [0, 1, 2, 3]
    strategy.clip = 0.25  # as if earlier rounds had moved it from 1.0
    updates = [{"w": np.full(4, 1.0)}, {"w": np.full(4, 0.01)}, {"w": np.full(4, 0.01)}]
    released = strategy.private_release(updates, strategy.privacy)
    # the first (norm 2) clipped to norm 0.25, not dp-clip's 1; the fourth sampled
    # client missing: a zero update; the mean over the cohort of 4
    expected = (np.full(4, 0.125) + np.full(4, 0.01) + np.full(4, 0.01)) / 4
    np.testing.assert_allclose(released["w"], expected, rtol=1e-12)
    # within the clip: the two small updates and the missing client, 3 of 4
    assert strategy.applied_clip == 0.25
    assert strategy.clip == pytest.approx(0.25 * math.exp(-0.2 * (3 / 4 - 0.5)))
