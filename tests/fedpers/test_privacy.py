"""Client-level DP (fedpers.privacy): the clip, the noise, the sample and the accountant,
each against a bound or an independent oracle (Opacus' PRV accountant, the analytic
Gaussian mechanism, scipy's chi-squared quantiles)."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_array_equal
from scipy import optimize, stats

from fedpers import privacy
from fedpers.aggregation import weighted_mean
from fedpers.config import load_run_config
from fedpers.privacy import DpMode, DpSampling, Mechanism
from fedpers.settings import ConfigError

FALSE_FAILURE = 1e-6  # each statistical test below fails a correct mechanism this rarely


def _mechanism(**changes: object) -> Mechanism:
    values: dict[str, object] = {
        "mode": DpMode.CENTRAL,
        "clip": 1.0,
        "noise_multiplier": 1.0,
        "sampling": DpSampling.WITHOUT_REPLACEMENT,
        "population": 100,
        "sampling_rate": 0.1,
        "cohort": 10.0,
        "delta": 1e-5,
        "min_clients": 10,
        "server_lr": 1.0,
    }
    values.update(changes)
    return Mechanism(**values)  # type: ignore[arg-type]


def _arrays(draw: st.DrawFn, shapes: tuple[tuple[int, ...], ...], scale: float) -> dict:
    return {
        f"a{i}": np.asarray(
            draw(
                st.lists(
                    st.floats(-scale, scale, allow_nan=False, width=32),
                    min_size=int(np.prod(s)),
                    max_size=int(np.prod(s)),
                )
            ),
            dtype=np.float32,
        ).reshape(s)
        for i, s in enumerate(shapes)
    }


@st.composite
def updates(draw: st.DrawFn) -> tuple[dict, dict, float]:
    shapes = tuple(
        draw(st.lists(st.sampled_from([(3,), (2, 2), (1,), (4, 1)]), min_size=1, max_size=3))
    )
    scale = draw(st.sampled_from([2.0**-10, 1.0, 2.0**10]))
    return (
        _arrays(draw, shapes, scale),
        _arrays(draw, shapes, scale),
        draw(st.floats(1e-3, 1e3)),
    )


# ------------------------------------------------------------------------------ the clip
@settings(max_examples=300, deadline=None)
@given(updates())
def test_no_clipped_update_exceeds_the_clip(case: tuple[dict, dict, float]) -> None:
    arrays, reference, clip = case
    out = privacy.clipped(arrays, reference, clip)
    norm = privacy.update_norm(arrays, reference)
    assert privacy.update_norm(out, reference) <= clip
    assert {n: (a.shape, a.dtype) for n, a in out.items()} == {
        n: (a.shape, a.dtype) for n, a in arrays.items()
    }
    if norm <= clip:  # within the clip: the very arrays, bit for bit
        for name in arrays:
            assert_array_equal(out[name], arrays[name])
    else:  # shortened onto the sphere, to the rounding of float32 values near reference
        size = sum(a.size for a in arrays.values())
        largest = max(1.0, *(float(np.max(np.abs(a))) for a in reference.values()))
        rounding = 4 * math.sqrt(size) * largest * 2.0**-23
        assert privacy.update_norm(out, reference) >= clip * (1 - 1e-5) - 4 * rounding


def test_clipping_keeps_the_direction() -> None:
    reference = {"w": np.zeros(4, dtype=np.float32)}
    arrays = {"w": np.array([3.0, 4.0, 0.0, 0.0], dtype=np.float32)}
    out = privacy.clipped(arrays, reference, 1.0)
    np.testing.assert_allclose(out["w"], [0.6, 0.8, 0.0, 0.0], rtol=1e-5)


def test_a_device_update_under_distributed_dp_is_clipped_before_its_noise() -> None:
    # With no noise, what leaves the device is the clipped update of the shared parts
    mechanism = _mechanism(mode=DpMode.DISTRIBUTED, noise_multiplier=0.0, clip=0.5)
    received = {"body": np.zeros(3, np.float32)}
    trained = {"body": np.array([10.0, 0.0, 0.0], np.float32)}
    out = privacy.private_update(
        received, trained, mechanism.clip, mechanism.share_std, privacy.secret_generator()
    )
    np.testing.assert_allclose(out["body"], [0.5, 0.0, 0.0], rtol=1e-6)


# ----------------------------------------------------------------------------- the noise
def _chi2_bounds(count: int) -> tuple[float, float]:
    return (
        stats.chi2.ppf(FALSE_FAILURE / 2, count) / count,
        stats.chi2.ppf(1 - FALSE_FAILURE / 2, count) / count,
    )


def test_central_noise_has_the_stated_standard_deviation() -> None:
    # Prepare: no update at all, so the release is the reference plus the noise / cohort
    mechanism = _mechanism(noise_multiplier=1.3, clip=0.7, cohort=10.0)
    reference = {"w": np.zeros(50_000, dtype=np.float64)}
    # Execute
    released = privacy.release([], reference, mechanism, privacy.secret_generator())
    # Assert: sum of squares / sigma^2 is chi-squared with 50,000 degrees
    sigma = 1.3 * 0.7 / 10.0
    low, high = _chi2_bounds(50_000)
    assert low < float(np.mean((released["w"] / sigma) ** 2)) < high
    assert abs(float(np.mean(released["w"]))) < 6 * sigma / math.sqrt(50_000)


def _share(mechanism: Mechanism, zero: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What an honest device with no update sends: its share of the noise alone."""
    return privacy.private_update(
        zero, zero, mechanism.clip, mechanism.share_std, privacy.secret_generator()
    )


def test_distributed_shares_sum_to_the_stated_noise_and_missing_shares_are_topped_up() -> None:
    mechanism = _mechanism(
        mode=DpMode.DISTRIBUTED, noise_multiplier=2.0, clip=1.0, min_clients=4, cohort=4.0
    )
    zero = {"w": np.zeros(20_000, dtype=np.float64)}
    low, high = _chi2_bounds(20_000)
    # One device's share: z C / sqrt(k_min)
    assert low < float(np.mean((_share(mechanism, zero)["w"] / (2.0 / 2)) ** 2)) < high
    # Two usable replies of the four: the server adds the two missing shares, so the
    # released sum carries z C in all
    replies = [_share(mechanism, zero) for _ in range(2)]
    released = privacy.release(replies, zero, mechanism, privacy.secret_generator())
    total = released["w"] * mechanism.cohort  # the noised sum of the updates
    assert low < float(np.mean((total / 2.0) ** 2)) < high


@pytest.mark.parametrize("replies", [0, 3, 8])
def test_a_distributed_release_carries_the_same_noise_however_many_replied(replies: int) -> None:
    """Issue 43: the released noise was max(n, k) shares, so with dp-min-clients k below
    the sample size m its level said how many devices replied. Now every release
    carries max(k, m) shares: here 8 of standard deviation z C / sqrt(4) = 1, so the
    sum's noise has variance 8, for 0, 3 or all 8 replies."""
    mechanism = _mechanism(
        mode=DpMode.DISTRIBUTED, noise_multiplier=2.0, clip=1.0, min_clients=4, cohort=8.0
    )
    zero = {"w": np.zeros(20_000, dtype=np.float64)}
    shares = [_share(mechanism, zero) for _ in range(replies)]
    released = privacy.release(shares, zero, mechanism, privacy.secret_generator())
    total = released["w"] * mechanism.cohort
    low, high = _chi2_bounds(20_000)
    assert mechanism.released_shares == 8
    assert low < float(np.mean(total**2)) / 8 < high


def test_distributed_dp_with_poisson_sampling_is_refused_naming_the_fix() -> None:
    """Issue 43: under Poisson sampling the number of devices that replied, and with it
    the released noise, depends on whether a client took part."""
    with pytest.raises(ConfigError, match="needs dp-sampling = 'without-replacement'"):
        load_run_config({"dp": "distributed"})
    load_run_config({"dp": "distributed", "dp-sampling": "without-replacement"})
    load_run_config({"dp": "central"})  # the server adds a fixed noise: Poisson is fine


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 30_000),
    clip=st.floats(1e-3, 1e3),
    noise=st.floats(0.0, 10.0),
    min_clients=st.integers(1, 1000),
    norm=st.floats(0.0, 1.0),
)
def test_an_honest_distributed_update_lies_within_the_band(
    size: int, clip: float, noise: float, min_clients: int, norm: float
) -> None:
    """Whatever the size, clip and share, an update within the clip plus its share of
    the noise lies within ``distributed_band`` (each side fails with probability below
    exp(-50)); an update without its noise lies below the band wherever the band's
    bottom is above the clip."""
    mechanism = _mechanism(
        mode=DpMode.DISTRIBUTED, noise_multiplier=noise, clip=clip, min_clients=min_clients
    )
    generator = np.random.default_rng(size)
    direction = generator.normal(size=size)
    update = direction / np.linalg.norm(direction) * norm * clip
    zero = {"w": np.zeros(size)}
    sent = privacy.private_update(
        zero, {"w": update}, clip, mechanism.share_std, privacy.secret_generator()
    )
    low, high = privacy.distributed_band(mechanism, size)
    assert low <= privacy.update_norm(sent, zero) <= high
    if low > clip:
        bare = privacy.private_update(zero, {"w": update}, clip, 0.0, privacy.secret_generator())
        assert privacy.update_norm(bare, zero) < low


def test_the_band_catches_a_skipped_clip_beyond_its_stated_width() -> None:
    """An unclipped update of norm D with its full share passes only while
    D^2 <~ C^2 + 20 s C + s^2 (4 sqrt(50 d) + 100) (docs/privacy.md): at 10,000 values,
    C = 1 and s = z C / sqrt(k) = 0.5, about 27.3 C, where the bound before issue 43,
    C + s (sqrt(d) + 10), let through 56 C. Twice that width is caught every time."""
    mechanism = _mechanism(mode=DpMode.DISTRIBUTED, noise_multiplier=2.0, min_clients=16)
    size, clip, std = 10_000, 1.0, mechanism.share_std
    width = math.sqrt(clip**2 + 20 * std * clip + std**2 * (4 * math.sqrt(50 * size) + 100))
    assert width == pytest.approx(27.26, abs=0.01)
    _, high = privacy.distributed_band(mechanism, size)
    generator = np.random.default_rng(0)
    zero = {"w": np.zeros(size)}
    for _ in range(20):
        direction = generator.normal(size=size)
        update = {"w": direction / np.linalg.norm(direction) * 2 * width}
        sent = privacy.private_update(zero, update, math.inf, std, privacy.secret_generator())
        assert privacy.update_norm(sent, zero) > high


def test_noise_is_not_drawn_from_the_run_seed() -> None:
    mechanism = _mechanism()
    reference = {"w": np.zeros(8)}
    first = privacy.release([], reference, mechanism, privacy.secret_generator())
    second = privacy.release([], reference, mechanism, privacy.secret_generator())
    assert not np.array_equal(first["w"], second["w"])


def test_without_noise_or_clip_a_full_cohort_is_fedavg_with_equal_weights_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    reference = {"b": rng.normal(size=(5, 3)).astype(np.float32)}
    replies = [{"b": rng.normal(size=(5, 3)).astype(np.float32)} for _ in range(10)]
    mechanism = _mechanism(noise_multiplier=0.0, clip=math.inf, cohort=10.0)
    released = privacy.release(replies, reference, mechanism, privacy.secret_generator())
    fedavg = weighted_mean(replies, [130.0] * 10)  # the non-private mean, equal sizes
    assert_array_equal(released["b"], fedavg["b"])


def test_a_missing_reply_counts_as_a_zero_update() -> None:
    reference = {"w": np.zeros(2)}
    replies = [{"w": np.array([1.0, 2.0])}, {"w": np.array([3.0, 2.0])}]
    mechanism = _mechanism(noise_multiplier=0.0, clip=math.inf, cohort=4.0)
    released = privacy.release(replies, reference, mechanism, privacy.secret_generator())
    np.testing.assert_allclose(released["w"], [1.0, 1.0])  # the sum over 4, not over 2


@settings(max_examples=100, deadline=None)
@given(updates(), st.integers(1, 5))
def test_one_client_moves_the_central_release_by_at_most_its_clip(
    case: tuple[dict, dict, float], cohort: int
) -> None:
    # The sensitivity the accountant assumes: without noise, replacing one client's
    # update moves the released mean by at most 2 C / cohort, removing it by C / cohort
    honest, reference, clip = case
    hostile = {n: a * 1e6 + 1e3 for n, a in honest.items()}
    mechanism = _mechanism(noise_multiplier=0.0, clip=clip, cohort=float(cohort))
    gen = privacy.secret_generator()
    others = [honest] * (cohort - 1)
    base = privacy.release([*others, honest], reference, mechanism, gen)
    swapped = privacy.release([*others, hostile], reference, mechanism, gen)
    removed = privacy.release(others, reference, mechanism, gen)
    scale = max(1.0, *(float(np.max(np.abs(a))) for a in reference.values()))
    slack = 1e-5 * scale  # float32 rounding of the released arrays
    assert privacy.update_norm(swapped, base) <= 2 * clip / cohort + slack * math.sqrt(16)
    assert privacy.update_norm(removed, base) <= clip / cohort + slack * math.sqrt(16)


# ---------------------------------------------------------------------------- the sample
def test_poisson_sampling_has_the_stated_rate() -> None:
    population = list(range(1000))
    gen = np.random.default_rng(1)
    sizes = [len(privacy.poisson_sample(population, 0.05, gen)) for _ in range(400)]
    # 400,000 Bernoulli(0.05) draws: the count is within 5 standard deviations
    mean, sd = 400 * 1000 * 0.05, math.sqrt(400 * 1000 * 0.05 * 0.95)
    assert abs(sum(sizes) - mean) < 5 * sd


# ------------------------------------------------------------------------ the accountant
@pytest.mark.parametrize(
    ("noise", "rate", "rounds"), [(0.8, 0.01, 100), (1.5, 0.1, 100), (1.0, 0.05, 30)]
)
def test_pld_agrees_with_opacus_prv_within_five_percent(
    noise: float, rate: float, rounds: int
) -> None:
    from opacus.accountants import PRVAccountant

    delta = 1e-5
    ours = privacy.epsilon(DpSampling.POISSON, noise, rate, 1000, rate * 1000, rounds, delta)
    prv = PRVAccountant()
    for _ in range(rounds):
        prv.step(noise_multiplier=noise, sample_rate=rate)
    theirs = prv.get_epsilon(delta)
    assert abs(ours - theirs) <= 0.05 * theirs, (ours, theirs)


def _analytic_gaussian_epsilon(sigma: float, delta: float) -> float:
    """The exact epsilon of one Gaussian mechanism of sensitivity 1 (Balle & Wang, ICML
    2018, Theorem 8): delta(eps) = Phi(1/(2s) - eps s) - e^eps Phi(-1/(2s) - eps s)."""

    def gap(eps: float) -> float:
        return (
            stats.norm.cdf(0.5 / sigma - eps * sigma)
            - math.exp(eps) * stats.norm.cdf(-0.5 / sigma - eps * sigma)
            - delta
        )

    return float(optimize.brentq(gap, 0.0, 500.0))


@pytest.mark.parametrize(("noise", "rounds"), [(5.0, 10), (20.0, 100), (2.0, 1)])
def test_every_client_every_round_is_the_closed_form_gaussian(noise: float, rounds: int) -> None:
    # q = 1: rounds Gaussian releases of noise z compose to one of z / sqrt(rounds)
    delta = 1e-5
    exact = _analytic_gaussian_epsilon(noise / math.sqrt(rounds), delta)
    pld = privacy.epsilon(DpSampling.POISSON, noise, 1.0, 100, 100.0, rounds, delta)
    assert abs(pld - exact) <= 0.01 * exact, (pld, exact)
    # Without replacement (replace-one, sensitivity 2 C): the RDP bound is an upper
    # bound of the exact epsilon of noise z / 2, and within 40% of it here
    wor = privacy.epsilon(DpSampling.WITHOUT_REPLACEMENT, noise, 1.0, 100, 100.0, rounds, delta)
    exact_replace = _analytic_gaussian_epsilon(noise / 2 / math.sqrt(rounds), delta)
    assert exact_replace <= wor <= 1.4 * exact_replace, (wor, exact_replace)


def test_the_coarser_discretization_changes_epsilon_by_under_1e4() -> None:
    from dp_accounting import GaussianDpEvent, NeighboringRelation, PoissonSampledDpEvent
    from dp_accounting.pld import PLDAccountant

    fine = PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4)
    fine.compose(PoissonSampledDpEvent(0.1, GaussianDpEvent(2.0)), 100)
    coarse = privacy.epsilon(DpSampling.POISSON, 2.0, 0.1, 100, 10.0, 100, 1e-5)
    assert abs(coarse - fine.get_epsilon(1e-5)) <= 1e-4 * coarse
    assert coarse >= fine.get_epsilon(1e-5)  # the coarser is pessimistic, never optimistic


def test_no_release_costs_nothing_and_no_noise_guarantees_nothing() -> None:
    assert privacy.epsilon(DpSampling.POISSON, 1.0, 0.1, 100, 10.0, 0, 1e-5) == 0.0
    assert privacy.epsilon(DpSampling.POISSON, 0.0, 0.1, 100, 10.0, 5, 1e-5) == math.inf
    spent = [privacy.epsilon(DpSampling.POISSON, 1.0, 0.1, 100, 10.0, r, 1e-5) for r in (1, 10)]
    assert 0 < spent[0] < spent[1]


@pytest.mark.parametrize("sampling", list(DpSampling))
def test_calibration_spends_at_most_the_target(sampling: DpSampling) -> None:
    args = (sampling, 0.1, 100, 10.0, 50, 1e-5)
    noise = privacy.calibrate(4.0, *args)
    assert privacy.epsilon(sampling, noise, *args[1:]) <= 4.0
    assert privacy.epsilon(sampling, noise * 0.99, *args[1:]) > 4.0


# ------------------------------------------------------------------------- the settings
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"dp": "central", "algorithm": "fedgmm"}, "'mixture' family"),
        ({"dp": "central", "algorithm": "sheaf-frl"}, "'sheaf' family"),
        ({"dp": "central", "dataset": "linear"}, "'linear' family"),
        ({"dp": "central", "aggregation": "trimmed-mean"}, "aggregation = 'mean'"),
        ({"dp": "central", "dp-clip": -1.0}, "'dp-clip'"),
        ({"dp": "central", "dp-noise-multiplier": -1.0}, "'dp-noise-multiplier'"),
        ({"dp": "distributed", "dp-target-epsilon": 2.0}, "'central' only"),
        ({"dp": "central", "dp-target-epsilon": 2.0, "dp-clip": 0.0}, "'dp-clip' above 0"),
        ({"dp": "central", "dp-delta": 1.0}, "'dp-delta'"),
        ({"dp": "central", "dp-server-lr": 0.0}, "'dp-server-lr'"),
        # adaptive clipping
        ({"dp": "distributed", "dp-clip-quantile": 0.5}, "'central' only"),
        ({"dp": "central", "dp-clip-quantile": 1.0}, "'dp-clip-quantile'"),
        ({"dp": "central", "dp-clip-quantile": 0.5, "dp-clip": 0.0}, "starts there"),
        ({"dp": "central", "dp-clip-lr": 0.0}, "'dp-clip-lr'"),
        ({"dp": "central", "dp-clip-count-std": -1.0}, "'dp-clip-count-std'"),
        ({"dp": "distributed"}, "needs dp-sampling = 'without-replacement'"),
        # the one-run audit
        ({"dp": "central", "dp-audit-canaries": 5}, "'dp-audit-canaries' = 5"),
        ({"dp": "central", "dp-audit-canaries": 10_001}, "'dp-audit-canaries' = 10001"),
        ({"dp-audit-canaries": 100}, "audits a private run's releases"),
    ],
)
def test_bad_privacy_settings_are_refused_before_the_run(overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_run_config(overrides)


def test_a_run_mechanism_reads_the_population_and_the_default_delta() -> None:
    run = load_run_config(
        {"dp": "central", "num-clients": 200, "unseen-fraction": 0.0, "fraction-train": 0.05}
    )
    mechanism = privacy.run_mechanism(run)
    assert mechanism is not None
    assert (mechanism.population, mechanism.sampling_rate, mechanism.cohort) == (200, 0.05, 10.0)
    assert mechanism.delta == pytest.approx(200**-1.1)
    assert mechanism.neighboring == privacy.ADD_OR_REMOVE_ONE
    assert privacy.run_mechanism(load_run_config({})) is None


# ------------------------------------------------------------------ adaptive clipping
def _adaptive(**changes: object) -> Mechanism:
    return _mechanism(**{"clip_quantile": 0.5, "clip_lr": 0.2, "count_std": 0.5, **changes})


@pytest.mark.parametrize(("noise", "count_std"), [(1.0, 0.5 + 1e-9), (1.0, 2.0), (0.5, 10.0)])
def test_the_update_and_the_count_together_spend_the_accounted_multiplier(
    noise: float, count_std: float
) -> None:
    """Andrew et al.'s Theorem 1, checked by an independent route: the RDP accountant
    composing the two Gaussian releases of a round (the update at z_Delta, the centred
    count at 2 sigma_b: its sensitivity is 1/2) spends what one release at z spends."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    mechanism = _adaptive(noise_multiplier=noise, count_std=count_std)
    z_update = mechanism.update_noise_multiplier
    assert z_update > noise  # the count takes a part of the budget
    assert mechanism.sum_std == pytest.approx(z_update * mechanism.clip)

    def spent(event: dp_accounting.DpEvent) -> float:
        accountant = RdpAccountant()
        sampled = dp_accounting.PoissonSampledDpEvent(0.05, event)
        accountant.compose(dp_accounting.SelfComposedDpEvent(sampled, 100))
        return float(accountant.get_epsilon(1e-5))

    both = dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(z_update), dp_accounting.GaussianDpEvent(2 * count_std)]
    )
    assert spent(both) == pytest.approx(spent(dp_accounting.GaussianDpEvent(noise)), rel=1e-9)


def test_the_clip_moves_geometrically_by_the_counted_fraction() -> None:
    """Without the count's noise, the closed form of Algorithm 1: C exp(-eta (b - gamma)),
    b the fraction of the expected cohort within the clip (a missing reply is a zero
    update: within)."""
    mechanism = _adaptive(count_std=0.0, cohort=10.0, clip=2.0)
    generator = np.random.default_rng(0)
    norms = [0.5, 1.0, 2.0, 3.0, 4.0, 9.0, 2.5, 0.1]  # 4 within the clip of 2
    adapted = privacy.adapted_clip(norms, 2, mechanism, generator)  # and 2 missing: 6 of 10
    assert adapted == pytest.approx(2.0 * math.exp(-0.2 * (0.6 - 0.5)))
    every = privacy.adapted_clip([0.1] * 10, 0, mechanism, generator)
    none = privacy.adapted_clip([9.0] * 10, 0, mechanism, generator)
    assert every == pytest.approx(2.0 * math.exp(-0.2 * 0.5))  # all within: it shrinks
    assert none == pytest.approx(2.0 * math.exp(0.2 * 0.5))  # none within: it grows


def test_the_count_noise_has_the_stated_standard_deviation() -> None:
    """log(C'/C) = -eta (b - gamma), so over many draws its standard deviation is
    eta sigma_b / cohort: chi-squared bounds at FALSE_FAILURE."""
    mechanism = _adaptive(count_std=3.0, cohort=40.0)
    generator = np.random.default_rng(1)
    # half within the clip of 1: the fraction is 1/2 plus noise of std 0.075, 6.7 std
    # from the clamp at 0 and 1
    half_within = [0.5] * 20 + [2.0] * 20
    draws = 20_000
    logs = np.array(
        [math.log(privacy.adapted_clip(half_within, 0, mechanism, generator)) for _ in range(draws)]
    )
    expected = 0.2 * 3.0 / 40.0
    variance = float(np.var(logs, ddof=1))
    low = stats.chi2.ppf(FALSE_FAILURE / 2, draws - 1) / (draws - 1)
    high = stats.chi2.ppf(1 - FALSE_FAILURE / 2, draws - 1) / (draws - 1)
    assert low * expected**2 <= variance <= high * expected**2


def test_the_clip_converges_to_the_target_quantile_of_the_norms() -> None:
    """Iterated on a fixed population of update norms (lognormal), the clip settles near
    their gamma-quantile: within the norms' 5-percentile band around it."""
    rng = np.random.default_rng(2)
    population = rng.lognormal(mean=0.0, sigma=1.0, size=1000)
    for quantile in (0.3, 0.5, 0.8):
        mechanism = _adaptive(clip_quantile=quantile, count_std=5.0, cohort=100.0, clip=10.0)
        clip = mechanism.clip
        history = []
        for _ in range(400):
            cohort = rng.choice(population, 100, replace=False)
            clip = privacy.adapted_clip(cohort, 0, dataclasses.replace(mechanism, clip=clip), rng)
            history.append(clip)
        settled = float(np.median(history[-100:]))
        low, high = np.quantile(population, [quantile - 0.05, quantile + 0.05])
        assert low <= settled <= high, (quantile, settled, low, high)


def test_a_count_noise_too_small_for_the_noise_multiplier_is_refused() -> None:
    # 10 clients a round: sigma_b defaults to 0.5, and z = 1 needs sigma_b > 0.5
    run = load_run_config(
        {"dp": "central", "dp-clip-quantile": 0.5, "num-clients": 100, "unseen-fraction": 0.0}
    )
    with pytest.raises(ConfigError, match=r"must exceed half the noise multiplier \(1 / 2\)"):
        privacy.run_mechanism(run)


def test_the_docs_list_the_algorithms_that_accept_dp_from_the_code() -> None:
    """docs/privacy.md's opening names every algorithm a run with ``dp`` accepts and
    that shares a model, and ``local``: before issue 43 it listed FedSGD (refused) and
    left out six that accept it."""
    from pathlib import Path

    from fedpers import algorithms
    from fedpers.simulations.fedrep_images import NEEDS_BATCH_NORM

    accepted = set()
    for name in algorithms.names():
        model = {"model": "mnist1d-mlp-bn"} if name in NEEDS_BATCH_NORM else {}
        try:
            load_run_config({"algorithm": name, "dp": "central", **model})
        except ConfigError:
            continue
        accepted.add(name)
    text = (Path(__file__).parents[2] / "docs" / "privacy.md").read_text()
    opening = text.split("\n\n")[1]
    named = set(re.findall(r"`([a-z0-9-]+)`", opening)) & set(algorithms.names())
    assert named == accepted


@pytest.mark.parametrize(
    ("floor", "run", "refused"),
    [
        (None, {"dp": "none"}, None),
        (0.0, {"dp": "none"}, None),
        (0.5, {"dp": "none"}, "dp = 'none' sends it un-noised"),
        (0.5, {"dp": "central"}, "dp = 'central' sends it un-noised"),
        (0.3, {"dp-noise-multiplier": 1.0}, None),  # 1 / sqrt(8) = 0.354
        (0.5, {"dp-noise-multiplier": 1.0}, "a noise multiplier of 0.3536"),
        (0.5, {"dp-noise-multiplier": 2.0}, None),
        (0.5, {"dp-noise-multiplier": 2.0, "dp-clip": 0.0}, "dp-clip = 0 (no clip)"),
        ("x", {"dp": "none"}, "is not a noise multiplier"),
        (-1.0, {"dp": "none"}, "is not a noise multiplier"),
        (True, {"dp": "none"}, "is not a noise multiplier"),
        (math.nan, {"dp": "none"}, "is not a noise multiplier"),
    ],
)
def test_a_device_floor_refuses_what_sends_less_noise(
    floor: object, run: dict, refused: str | None
) -> None:
    values = {
        "dp": "distributed", "dp-sampling": "without-replacement", "num-clients": 8,
        "fraction-train": 1.0, **run,
    }  # fmt: skip
    config = load_run_config(values)
    if refused is None:
        privacy.device_floor(config, floor)
    else:
        with pytest.raises(privacy.DeviceFloorError, match=re.escape(refused)):
            privacy.device_floor(config, floor)


def test_colluders_leave_the_noise_of_the_shares_they_do_not_hold() -> None:
    """The figures of docs/privacy.md's collusion table: z sqrt(1 - f), and the epsilon
    the accountant gives it (the same accountant as the run's)."""
    population, rate, rounds = 1000, 0.05, 30
    delta = privacy.default_delta(population)
    sampling = DpSampling.WITHOUT_REPLACEMENT
    noise = privacy.calibrate(1.0, sampling, rate, population, 50.0, rounds, delta)
    honest = _mechanism(
        mode=DpMode.DISTRIBUTED, noise_multiplier=noise, population=population,
        sampling_rate=rate, cohort=50.0, delta=delta, min_clients=50,
    )  # fmt: skip
    table = {0.0: (3.930, 1.000), 0.2: (3.515, 1.174), 0.5: (2.779, 1.683), 0.8: (1.757, 3.505)}
    for fraction, (multiplier, spent) in table.items():
        left = privacy.colluded(honest, fraction)
        assert left.noise_multiplier == pytest.approx(multiplier, abs=6e-4)
        assert left.epsilon(rounds) == pytest.approx(spent, abs=6e-4)
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        privacy.colluded(honest, 1.0)


def test_the_collusion_command_prints_the_table_and_refuses_a_bad_fraction(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--epsilon", "1", "--rounds", "30", "--rate", "0.05", "--population", "1000",
            "--sampling", "without-replacement"]  # fmt: skip
    privacy.main([*args, "--colluding", "0.2,0.5"])
    printed = capsys.readouterr().out
    assert "colluding 20% of the shares: noise multiplier 3.5148, epsilon 1.174" in printed
    assert "colluding 50% of the shares: noise multiplier 2.7787, epsilon 1.683" in printed
    for bad in ("1.5", "x", "-0.1"):
        with pytest.raises(SystemExit):
            privacy.main([*args, "--colluding", bad])
