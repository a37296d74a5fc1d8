"""The one-run audit (fedpers.audit): its lower bound holds for a mechanism whose epsilon
is known exactly (randomized response), comes close to it with many canaries, never
exceeds the accountant's epsilon of a correct Gaussian release, and exceeds it when the
noise is left out."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedpers import audit
from fedpers.privacy import DpMode, DpSampling, Mechanism


def _randomized_response(m: int, epsilon: float, generator: np.random.Generator) -> float:
    """Guess each of ``m`` coins from its epsilon-DP randomized response (told truly
    with probability e^eps / (1 + e^eps)): every guess, so W is exactly Binomial."""
    truth = 1 / (1 + math.exp(-epsilon))
    correct = int((generator.random(m) < truth).sum())
    return audit.epsilon_lower_bound(m, m, correct, 0.0)


def test_the_bound_holds_for_an_exactly_epsilon_dp_mechanism() -> None:
    """Randomized response at epsilon 1 is exactly 1-DP: over 400 audits of 1,000 coins
    the lower bound exceeds 1 in at most 5% of them (it may, by its confidence),
    counted with a binomial margin."""
    generator = np.random.default_rng(0)
    above = sum(_randomized_response(1000, 1.0, generator) > 1.0 for _ in range(400))
    assert above <= 0.05 * 400 + 3 * math.sqrt(400 * 0.05 * 0.95)


def test_many_canaries_bring_the_bound_close_to_epsilon() -> None:
    generator = np.random.default_rng(1)
    bound = _randomized_response(100_000, 1.0, generator)
    assert 0.95 < bound <= 1.0 + 0.02


def test_delta_and_fewer_correct_guesses_lower_the_bound() -> None:
    assert audit.epsilon_lower_bound(1000, 200, 150, 0.0) > audit.epsilon_lower_bound(
        1000, 200, 150, 1e-4
    )
    assert audit.epsilon_lower_bound(1000, 200, 100, 0.0) == 0.0  # chance: nothing shown
    assert audit.p_value(10, 4, 4, 0.0, 0.0) == pytest.approx(0.5**4)


def _mechanism(noise: float) -> Mechanism:
    return Mechanism(
        DpMode.CENTRAL, 1.0, noise, DpSampling.POISSON, 100, 0.5, 50.0, 1e-5, 50, 1.0,
        audit_canaries=1000,
    )  # fmt: skip


def _audit(mechanism: Mechanism, std: float, rounds: int, seed: int) -> float:
    """``rounds`` central releases with no client update (the canaries alone), noise of
    standard deviation ``std`` on the sum, scored as a run scores them."""
    generator = np.random.default_rng(seed)
    reference = {"w": np.zeros((40, 50), np.float32)}
    canaries = audit.CanaryAudit.plant(mechanism.audit_canaries, reference, generator)
    for _ in range(rounds):
        flat = canaries.contribution(mechanism.clip, mechanism.sampling_rate, generator)
        flat = flat + generator.normal(0.0, std, flat.shape)
        released = {"w": (reference["w"] + flat.reshape(40, 50) / mechanism.cohort)}
        canaries.observe(reference, released)
        reference = {"w": released["w"].astype(np.float32)}
    return canaries.result(mechanism.delta)["epsilon_lower"]


def test_a_correct_release_is_never_caught_and_one_without_noise_is() -> None:
    """At z = 5 and rate 0.5, 10 releases spend the accountant's epsilon (about 1.2);
    the audit of the same releases stays below it. Left out, the noise no longer hides
    the canaries: the audit's bound then lies far above what was claimed."""
    mechanism = _mechanism(5.0)
    claimed = mechanism.epsilon(10)
    assert 1 < claimed < 1.5
    for seed in range(5):
        assert _audit(mechanism, mechanism.sum_std, 10, seed) <= claimed
    broken = _audit(mechanism, 0.0, 10, 0)
    assert broken > 2 * claimed


def test_an_audit_kept_in_a_checkpoint_continues_with_its_canaries() -> None:
    """``state`` then ``restore``: the same directions (drawn again from the kept seed),
    coins, scores and rounds; a state over other arrays is refused."""
    reference = {"w": np.zeros((3, 4), np.float32), "b": np.zeros(4, np.float32)}
    planted = audit.CanaryAudit.plant(50, reference, np.random.default_rng(7))
    moved = {k: v + np.random.default_rng(1).normal(size=v.shape) for k, v in reference.items()}
    planted.observe(reference, moved)
    again = audit.CanaryAudit.restore(planted.state(), reference)
    np.testing.assert_array_equal(again.directions, planted.directions)
    np.testing.assert_array_equal(again.included, planted.included)
    np.testing.assert_array_equal(again.scores, planted.scores)
    assert (again.rounds, again.names) == (1, ("w", "b"))
    np.testing.assert_allclose(np.linalg.norm(again.directions, axis=1), 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="not over"):
        audit.CanaryAudit.restore(planted.state(), {"w": reference["w"]})
    other = audit.CanaryAudit.plant(50, reference, np.random.default_rng(8))
    assert not np.array_equal(other.directions, planted.directions)
