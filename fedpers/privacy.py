"""Client-level differential privacy of the shared parts: clipping, noise, accounting.

The mechanism is DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent
Language Models", ICLR 2018; the fixed-denominator estimator): each sampled client's
update of the shared parts ``Delta_c = w_c - w`` (all shared arrays as one vector) is
clipped to norm ``C`` (``dp-clip``), the clipped updates are summed with equal weights
(a client's claimed size cannot change its influence, which the guarantee needs),
Gaussian noise of standard deviation ``z C`` (``dp-noise-multiplier``) is added to the
sum, and the server steps by ``dp-server-lr`` times the noised sum over the expected
number of sampled clients. A client that was sampled but sent nothing usable counts as
a zero update, so a screened-out or missing reply neither voids the guarantee nor the
round, and a round always releases the noised sum, even of no update at all.

Where the noise is added (``dp``):

- ``central``: the server clips every reply and adds all the noise. The server is
  trusted with the clients' updates; the guarantee covers what it releases (the shared
  model after every round) against everyone else.
- ``distributed``: each client clips its own update and adds its share of the noise,
  of standard deviation ``z C / sqrt(k)`` with ``k`` = ``dp-min-clients``, so any sum
  of ``k`` replies carries the full noise. No update leaves a device un-noised. The
  released noise never depends on how many replied: the server tops every round up to
  ``max(k, m)`` shares (``m`` the fixed sample size), so a round releases the same
  noise whoever replied; and it needs a fixed-size sample (``dp-sampling =
  "without-replacement"``): under Poisson sampling the number of shares, visible in the
  released noise, would say whether a client took part. A reply whose norm lies
  outside what an honest clipped and noised update has (``distributed_band``) is left
  out and its share topped up. Without secure aggregation the server sees each reply,
  noised only by its share; who is trusted for what: docs/privacy.md.

Sampling and the accountant. ``dp-sampling = "poisson"`` samples every seen client
independently with probability ``fraction-train``; its guarantee is for
add-or-remove-one-client neighbours, accounted for with the privacy loss distribution
(PLD) accountant of Google's ``dp-accounting`` (``PoissonSampledDpEvent``), which a test
checks against Opacus' PRV accountant. ``"without-replacement"`` keeps fedpers' fixed-
size sample; its guarantee is for replace-one neighbours (sensitivity ``2 C``, so the
accountant sees noise multiplier ``z / 2``), accounted for with the RDP accountant
(``SampledWithoutReplacementDpEvent``, Wang et al., AISTATS 2019): an upper bound, the
only accountant that supports it. With ``z > 0`` the noise and the sample come from a
generator seeded by the operating system (``secrets``), never from the run seed, which
every client knows: noise drawn from it could be subtracted, and a sample known to the
adversary amplifies nothing. With ``z = 0`` there is no guarantee (epsilon is infinite)
and the sample stays the seeded one.

Adaptive clipping (``dp-clip-quantile`` > 0, central only; Andrew et al., "Differentially
Private Learning with Adaptive Clipping", NeurIPS 2021): the clip starts at ``dp-clip``
and after each round moves geometrically toward the ``dp-clip-quantile`` quantile of the
sampled clients' update norms, estimated from a noised count of the updates within it
(``adapted_clip``). The count's noise ``sigma_b`` (``dp-clip-count-std``) takes a part of
the budget: the update's noise multiplier becomes ``(z^-2 - (2 sigma_b)^-2)^(-1/2)``, so
that both releases of a round together are the Gaussian mechanism of multiplier ``z``
that the accountant counts (their Theorem 1).

Nothing here imports torch or Flower; ``dp_accounting`` is imported when an epsilon is
computed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np

from fedpers.aggregation import weighted_mean
from fedpers.protocol import NODE_DP_MIN_NOISE
from fedpers.settings import ConfigError, at_least, finite, setting, step_size, within

if TYPE_CHECKING:
    from fedpers.config import RunConfig


class DpMode(StrEnum):
    """Where the noise of client-level DP is added (run-config ``dp``)."""

    NONE = "none"
    CENTRAL = "central"  # the server clips and adds the noise
    DISTRIBUTED = "distributed"  # each client clips and adds its share


class DpSampling(StrEnum):
    """How a private run samples its clients (run-config ``dp-sampling``)."""

    POISSON = "poisson"  # each seen client with probability fraction-train
    WITHOUT_REPLACEMENT = "without-replacement"  # fraction-train of them, fixed size


ADD_OR_REMOVE_ONE = "add-or-remove-one"
REPLACE_ONE = "replace-one"

# dp-audit-canaries: fewer show nothing; more cost M x d float32 values on the server.
# Here, not in fedpers.audit, so that checking a configuration imports no scipy.
FEWEST_CANARIES, MOST_CANARIES = 10, 10_000

# The accountant's discretization of the privacy loss: 1e-3 gives an epsilon within 1e-4
# (relative) of 1e-4's and never below it, ten times faster (tests/fedpers/test_privacy.py).
PLD_DISCRETIZATION = 1e-3


@dataclass(frozen=True)
class PrivacySettings:
    """Client-level differential privacy of the shared parts."""

    dp: DpMode = setting(
        DpMode.NONE,
        "`none`, `central` (the server clips each update and adds the noise) or "
        "`distributed` (each client clips its update and adds its share of the noise)",
    )
    dp_clip: float = setting(
        1.0,
        "largest norm of one client's update of the shared parts (all arrays as one "
        "vector); 0: no clipping (and no guarantee)",
    )
    dp_noise_multiplier: float = setting(
        1.0, "standard deviation of the noise on the sum of the clipped updates, / dp-clip"
    )
    dp_target_epsilon: float = setting(
        0.0,
        "> 0: choose dp-noise-multiplier before the run so that num-rounds rounds spend "
        "this epsilon at dp-delta (central only)",
    )
    dp_delta: float = setting(0.0, "delta of the guarantee; 0: 1 / (seen clients)^1.1")
    dp_sampling: DpSampling = setting(
        DpSampling.POISSON,
        "`poisson` (each seen client with probability fraction-train; add-or-remove-one "
        "neighbours) or `without-replacement` (a fixed-size sample; replace-one)",
    )
    dp_min_clients: int = setting(
        0,
        "distributed: replies that together carry the full noise, each adding "
        "1/sqrt(dp-min-clients) of it (0: the expected number sampled)",
    )
    dp_server_lr: float = setting(1.0, "the server's step along the noised mean update")
    dp_clip_quantile: float = setting(
        0.0,
        "> 0: adaptive clipping (Andrew et al. 2021, central only): the clip follows this "
        "quantile of the updates' norms, from dp-clip; 0: dp-clip throughout",
    )
    dp_clip_lr: float = setting(
        0.2, "adaptive clipping: the clip's geometric step, C <- C exp(-lr (b - quantile))"
    )
    dp_audit_canaries: int = setting(
        0,
        "plant this many canary clients in a private run's releases and report the "
        "empirical lower bound on epsilon they give (fedpers.audit, Steinke et al. "
        "2023; 10 to 10,000); 0: none",
    )
    dp_clip_count_std: float = setting(
        0.0,
        "adaptive clipping: the noise on the count of updates within the clip (0: the "
        "expected clients a round / 20, as Andrew et al.); must exceed the noise "
        "multiplier / 2",
    )

    def check(self) -> None:
        at_least("dp-clip", self.dp_clip, 0.0)
        finite("dp-noise-multiplier", self.dp_noise_multiplier, 0)
        finite("dp-target-epsilon", self.dp_target_epsilon, 0, note=" (0: use dp-noise-multiplier)")
        within("dp-delta", self.dp_delta, "[0, 1)")
        at_least("dp-min-clients", self.dp_min_clients, 0)
        step_size("dp-server-lr", self.dp_server_lr)
        if self.dp is DpMode.DISTRIBUTED and self.dp_target_epsilon > 0:
            raise ConfigError(
                "run-config key 'dp-target-epsilon' works with dp = 'central' only: under "
                "'distributed' every client sizes its own noise from dp-noise-multiplier. "
                "Choose it with `python -m fedpers.privacy --epsilon E ...` and set "
                "dp-noise-multiplier."
            )
        if self.dp is not DpMode.NONE and self.dp_target_epsilon > 0 and self.dp_clip == 0:
            raise ConfigError(
                "run-config key 'dp-target-epsilon' needs a 'dp-clip' above 0: noise is "
                "sized in multiples of the clip."
            )
        self._check_adaptive_clip()
        self._check_audit()
        if self.dp is DpMode.DISTRIBUTED and self.dp_sampling is DpSampling.POISSON:
            raise ConfigError(
                "run-config key 'dp' = 'distributed' needs dp-sampling = "
                "'without-replacement': each device adds its own share of the noise, so "
                "the released noise grows with the number of devices that replied, and "
                "under Poisson sampling that number says whether a client took part "
                "(docs/privacy.md). Set dp-sampling = 'without-replacement', or dp = "
                "'central'."
            )

    def _check_audit(self) -> None:
        count = self.dp_audit_canaries
        if count == 0:
            return
        if not FEWEST_CANARIES <= count <= MOST_CANARIES:
            raise ConfigError(
                f"run-config key 'dp-audit-canaries' = {count}: plant 0 (no audit) or "
                f"{FEWEST_CANARIES} to {MOST_CANARIES:,} canaries."
            )
        if self.dp is DpMode.NONE:
            raise ConfigError(
                "run-config key 'dp-audit-canaries' audits a private run's releases, and "
                "dp = 'none' releases without a guarantee: set dp = 'central' or "
                "'distributed', or dp-audit-canaries = 0."
            )

    def _check_adaptive_clip(self) -> None:
        within("dp-clip-quantile", self.dp_clip_quantile, "[0, 1)")
        step_size("dp-clip-lr", self.dp_clip_lr)
        finite(
            "dp-clip-count-std",
            self.dp_clip_count_std,
            0,
            note=" (0: the expected clients a round / 20)",
        )
        if self.dp_clip_quantile == 0 or self.dp is DpMode.NONE:
            return
        if self.dp is DpMode.DISTRIBUTED:
            raise ConfigError(
                "run-config key 'dp-clip-quantile' (adaptive clipping) works with dp = "
                "'central' only: under 'distributed' each device clips with a clip it "
                "must know before it trains. Set dp-clip-quantile = 0, or dp = 'central'."
            )
        if self.dp_clip == 0:
            raise ConfigError(
                "run-config key 'dp-clip-quantile' needs a 'dp-clip' above 0: the clip "
                "it adapts starts there."
            )


@dataclass(frozen=True)
class Mechanism:
    """One run's private mechanism, everything the guarantee depends on.

    Attributes
    ----------
    mode : DpMode
        Where the noise is added.
    clip : float
        ``C``: the largest norm of one client's update (``inf`` for ``dp-clip = 0``).
    noise_multiplier : float
        ``z``: the noise on the sum has standard deviation ``z C``.
    sampling : DpSampling
        How clients are sampled.
    population : int
        The clients sampled from (the seen ones).
    sampling_rate : float
        ``q``: each client's probability to be sampled in a round.
    cohort : float
        The expected number sampled per round, the denominator of the mean update
        (``q x population``; exactly the sample size without replacement).
    delta : float
        The guarantee's delta.
    min_clients : int
        Distributed: replies that together carry the full noise.
    server_lr : float
        The server's step along the noised mean update.
    clip_quantile : float
        Adaptive clipping's target quantile ``gamma`` (0: a fixed clip).
    clip_lr : float
        Adaptive clipping's geometric step ``eta_C``.
    count_std : float
        Adaptive clipping: ``sigma_b``, the noise on the count of updates within the
        clip (0 without adaptive clipping).
    audit_canaries : int
        Canaries the server plants for the empirical audit (``fedpers.audit``; 0: none).
    """

    mode: DpMode
    clip: float
    noise_multiplier: float
    sampling: DpSampling
    population: int
    sampling_rate: float
    cohort: float
    delta: float
    min_clients: int
    server_lr: float
    clip_quantile: float = 0.0
    clip_lr: float = 0.2
    count_std: float = 0.0
    audit_canaries: int = 0

    @property
    def adaptive(self) -> bool:
        """Whether the clip adapts (``dp-clip-quantile`` > 0)."""
        return self.clip_quantile > 0

    @property
    def update_noise_multiplier(self) -> float:
        """The noise on the sum of the updates, / the clip: ``z`` with a fixed clip;
        with adaptive clipping ``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``, so that the
        update and the noised count together are one Gaussian mechanism of multiplier
        ``z`` (Andrew et al. 2021, Theorem 1): the accountant counts ``z`` as before."""
        z = self.noise_multiplier
        if not self.adaptive or z == 0:
            return z
        return (z**-2 - (2 * self.count_std) ** -2) ** -0.5

    @property
    def neighboring(self) -> str:
        """The neighbouring relation of the guarantee."""
        return ADD_OR_REMOVE_ONE if self.sampling is DpSampling.POISSON else REPLACE_ONE

    @property
    def secret(self) -> bool:
        """Whether the noise and the sample must be secret: any noise at all."""
        return self.noise_multiplier > 0

    @property
    def sum_std(self) -> float:
        """Standard deviation of the noise on the sum of the clipped updates (0 without
        a finite clip and noise)."""
        if self.noise_multiplier == 0 or math.isinf(self.clip):
            return 0.0
        return self.update_noise_multiplier * self.clip

    @property
    def share_std(self) -> float:
        """Distributed: the standard deviation of the noise one client adds."""
        return self.sum_std / math.sqrt(self.min_clients)

    @property
    def released_shares(self) -> int:
        """Distributed: the shares of noise every release carries, whoever replied:
        ``max(k, m)`` for ``k`` = ``min_clients`` and the sample size ``m``; the server
        adds those of the sampled devices that sent no usable reply. Above ``k`` (when
        ``dp-min-clients`` is below the sample size) the release carries more noise
        than the accountant counts, never less."""
        return max(self.min_clients, round(self.cohort))

    def epsilon(self, releases: int) -> float:
        """Epsilon at ``delta`` after ``releases`` rounds (see ``epsilon``)."""
        return epsilon(
            self.sampling, self.noise_multiplier, self.sampling_rate, self.population,
            self.cohort, releases, self.delta, clip=self.clip,
        )  # fmt: skip

    def record(self, releases: int) -> dict[str, object]:
        """What anyone needs to recompute the guarantee with another accountant, and the
        epsilon spent (the summary's ``privacy``)."""
        return {
            "mode": str(self.mode),
            "noise_multiplier": self.noise_multiplier,
            "clip": self.clip,
            "sampling_rate": self.sampling_rate,
            "sampling": str(self.sampling),
            "neighboring": self.neighboring,
            "population": self.population,
            "expected_cohort": self.cohort,
            "rounds": releases,
            "delta": self.delta,
            "min_clients": self.min_clients if self.mode is DpMode.DISTRIBUTED else None,
            "released_shares": (self.released_shares if self.mode is DpMode.DISTRIBUTED else None),
            "server_lr": self.server_lr,
            "accountant": accountant_name(self.sampling),
            "epsilon": self.epsilon(releases),
            "adaptive_clip": (
                {
                    "quantile": self.clip_quantile,
                    "lr": self.clip_lr,
                    "count_std": self.count_std,
                    "update_noise_multiplier": self.update_noise_multiplier,
                }
                if self.adaptive
                else None
            ),
        }


@functools.lru_cache(maxsize=64)
def mechanism(
    settings: PrivacySettings, *, population: int, fraction: float, sample_size: int, rounds: int
) -> Mechanism | None:
    """The mechanism of a run's ``settings`` (None for ``dp = "none"``): its sampling
    rate from ``fraction`` (Poisson) or ``sample_size`` (without replacement), its delta
    and, with ``dp-target-epsilon``, the noise multiplier that spends it in ``rounds``
    (found once per process and configuration: the results are cached).
    """
    if settings.dp is DpMode.NONE:
        return None
    if settings.dp_sampling is DpSampling.POISSON:
        rate, cohort = fraction, fraction * population
    else:
        rate, cohort = sample_size / population, float(sample_size)
    delta = settings.dp_delta or default_delta(population)
    noise = settings.dp_noise_multiplier
    if settings.dp_target_epsilon > 0:
        noise = calibrate(
            settings.dp_target_epsilon, settings.dp_sampling, rate, population, cohort, rounds,
            delta,
        )  # fmt: skip
    minimum = settings.dp_min_clients or max(1, math.floor(cohort))
    clip = settings.dp_clip or math.inf
    quantile = settings.dp_clip_quantile
    # without noise there is no guarantee, and the count is exact: a seeded run repeats
    count_std = (settings.dp_clip_count_std or cohort / 20) if quantile > 0 and noise > 0 else 0.0
    if quantile > 0 and noise > 0 and not 2 * count_std > noise:
        raise ConfigError(
            f"adaptive clipping: the count's noise dp-clip-count-std = {count_std:g} must "
            f"exceed half the noise multiplier ({noise:g} / 2), or no noise is left for "
            "the update (Andrew et al. 2021, Theorem 1); raise dp-clip-count-std, or "
            "sample more clients a round (its default is the expected number / 20)."
        )
    return Mechanism(
        settings.dp, clip, noise, settings.dp_sampling, population, rate, cohort,
        delta, minimum, settings.dp_server_lr, quantile, settings.dp_clip_lr, count_std,
        settings.dp_audit_canaries,
    )  # fmt: skip


def default_delta(population: int) -> float:
    """``1 / population^1.1``: below one over the number of clients protected."""
    return float(population) ** -1.1


# ------------------------------------------------------------------------ the mechanism
def secret_generator() -> np.random.Generator:
    """A generator seeded by the operating system's entropy (128 bits of ``secrets``),
    unrelated to the run seed."""
    return np.random.default_rng(secrets.randbits(128))


def update_norm(arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> float:
    """The norm of ``arrays - reference``, all arrays as one vector, in float64."""
    total = 0.0
    for name, values in arrays.items():
        delta = values.astype(np.float64) - reference[name]
        total += float(np.sum(delta * delta))
    return math.sqrt(total)


def clipped(
    arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], clip: float
) -> dict[str, np.ndarray]:
    """``reference + Delta min(1, clip / ||Delta||)``, ``Delta = arrays - reference``:
    the arrays themselves when their update is within the clip (or not finite: screening
    rejects those before), else scaled onto the sphere of radius ``clip``, in the arrays'
    dtype.

    Raises
    ------
    ValueError
        If ``arrays`` and ``reference`` name different arrays.
    """
    if set(arrays) != set(reference):
        raise ValueError(
            f"the update has arrays {sorted(arrays)}, the reference {sorted(reference)}"
        )
    norm = update_norm(arrays, reference)
    if not norm > clip:
        return dict(arrays)
    scale = clip / norm
    out = {}
    for name, values in arrays.items():
        delta = values.astype(np.float64) - reference[name]
        out[name] = (reference[name] + scale * delta).astype(values.dtype)
    # Rounding to the arrays' dtype may leave the norm a hair above the clip: shrink by
    # 1e-6, then twice as much each time, until within (scale 0 is the reference itself).
    cut = 1e-6
    while update_norm(out, reference) > clip:
        scale = max(0.0, scale * (1 - cut))
        cut *= 2
        out = {
            name: (reference[name] + scale * (v.astype(np.float64) - reference[name])).astype(
                v.dtype
            )
            for name, v in arrays.items()
        }
    return out


def noised(
    arrays: Mapping[str, np.ndarray], std: float, generator: np.random.Generator
) -> dict[str, np.ndarray]:
    """``arrays`` plus independent Gaussian noise of standard deviation ``std`` on every
    value (added in float64, kept in the arrays' dtype); the arrays unchanged for
    ``std = 0``."""
    if std == 0:
        return dict(arrays)
    return {
        name: (values + generator.normal(0.0, std, size=values.shape)).astype(values.dtype)
        for name, values in arrays.items()
    }


def private_update(
    received: Mapping[str, np.ndarray],
    trained: Mapping[str, np.ndarray],
    clip: float,
    std: float,
    generator: np.random.Generator,
) -> dict[str, np.ndarray]:
    """Distributed DP on the device: the trained shared arrays with their update clipped
    to ``clip`` and noised by ``std`` (the run's ``Mechanism.clip`` and
    ``Mechanism.share_std``). Arrays the server did not send (none in the built-in
    rows) pass unchanged."""
    shared = {name: trained[name] for name in trained if name in received}
    reference = {name: received[name] for name in shared}
    private = noised(clipped(shared, reference, clip), std, generator)
    return {**dict(trained), **private}


def release(
    updates: Sequence[Mapping[str, np.ndarray]],
    reference: Mapping[str, np.ndarray],
    mechanism: Mechanism,
    generator: np.random.Generator,
) -> dict[str, np.ndarray]:
    """The next global arrays from the round's usable replies ``updates`` (already
    screened): ``w + lr (sum_c clip(Delta_c) + N(0, sigma^2)) / cohort``.

    Central: every update is clipped to ``C`` here and the noise has ``sigma = z C``.
    Distributed: the devices clipped and noised their updates (the strategy left out
    those outside ``distributed_band``); the server clips each to the band's top, which
    an honest noised update exceeds with probability below ``exp(-50)``, and adds the
    noise of the shares missing from ``released_shares``,
    ``sigma = share_std sqrt(released_shares - k)``, so that the released noise is the
    same however many replied.

    With the expected cohort complete (``k = cohort``, a sample without replacement with
    no reply lost) the mean is FedAvg's ``weighted_mean`` of the clipped arrays with
    equal weights, so with no noise, no clip and ``lr = 1`` the result is the same bits
    as the non-private mean of equally weighted clients.
    """
    names = list(reference)
    if mechanism.mode is DpMode.CENTRAL:
        kept = [clipped({n: u[n] for n in names}, reference, mechanism.clip) for u in updates]
        std = mechanism.sum_std
    else:
        _, bound = distributed_band(mechanism, sum(a.size for a in reference.values()))
        kept = [clipped({n: u[n] for n in names}, reference, bound) for u in updates]
        if len(kept) > mechanism.released_shares:
            raise ValueError(
                f"{len(kept)} replies, more than the {mechanism.released_shares} shares of "
                "noise a release carries: a distributed release needs a fixed-size sample"
            )
        std = mechanism.share_std * math.sqrt(mechanism.released_shares - len(kept))
    k = len(kept)
    if k and k == mechanism.cohort:
        centre = weighted_mean(kept, [1.0] * k)
    else:  # missing replies count as zero updates: the denominator stays the cohort
        centre = {}
        for name in names:
            total = np.zeros(reference[name].shape, dtype=np.float64)
            for arrays in kept:
                total += arrays[name].astype(np.float64) - reference[name]
            centre[name] = (reference[name] + total / mechanism.cohort).astype(
                reference[name].dtype
            )
    step = noised(centre, std / mechanism.cohort, generator)
    if mechanism.server_lr == 1.0:
        return step
    return {
        name: (
            reference[name]
            + mechanism.server_lr * (step[name].astype(np.float64) - reference[name])
        ).astype(reference[name].dtype)
        for name in names
    }


def adapted_clip(
    norms: Sequence[float], missing: int, mechanism: Mechanism, generator: np.random.Generator
) -> float:
    """The next round's clip under adaptive clipping (Andrew et al. 2021, Algorithm 1,
    geometric update): ``C exp(-eta_C (b - gamma))``, where ``b`` estimates the fraction
    of the sampled clients' updates within the clip ``C`` (``mechanism.clip``),
    ``b = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / cohort + 1/2`` with ``b_i = 1`` for
    ``||Delta_i|| <= C``, clamped to [0, 1]. ``norms`` are the round's usable updates'
    norms before clipping; ``missing`` sampled clients sent none (a zero update, within
    the clip).
    Centred, the count moves by at most 1/2 when a client joins or leaves, which is
    the sensitivity ``update_noise_multiplier`` assumes."""
    within_clip = sum(1 for n in norms if n <= mechanism.clip) + missing
    centred = within_clip - (len(norms) + missing) / 2
    noisy = centred + (generator.normal(0.0, mechanism.count_std) if mechanism.count_std else 0)
    # A fraction: clamped to [0, 1] (post-processing, free of privacy cost), so that a
    # small cohort's noise cannot take a step larger than the estimator's range allows
    fraction = min(1.0, max(0.0, noisy / mechanism.cohort + 0.5))
    return mechanism.clip * math.exp(-mechanism.clip_lr * (fraction - mechanism.clip_quantile))


def distributed_band(mechanism: Mechanism, size: int) -> tuple[float, float]:
    """The norms an honest device's update of ``size`` values has under distributed DP:
    its update ``Delta`` clipped to ``C`` plus its share of the noise ``e``, standard
    deviation ``s`` on every value. Each bound fails with probability below
    ``exp(-50)``:

    - above: ``||Delta + e||^2 = ||Delta||^2 + 2 <Delta, e> + ||e||^2``, with
      ``<Delta, e> <= 10 s C`` (a Gaussian's tail) and
      ``||e||^2 <= s^2 (d + 2 sqrt(50 d) + 100)`` (Laurent and Massart 2000, Lemma 1);
    - below: ``||Delta + e|| >= ||e|| - C`` with ``||e||^2 >= s^2 (d - 2 sqrt(50 d))``.

    A reply below the band left out most of its noise share; above it, it skipped its
    clip. The band cannot tell a clip skipped by less than its width: an unclipped
    update of norm ``D`` with its full share passes while
    ``D^2 <~ C^2 + 20 s C + s^2 (4 sqrt(50 d) + 100)`` (docs/privacy.md). (0, inf)
    without a finite clip.
    """
    clip, std = mechanism.clip, mechanism.share_std
    if math.isinf(clip):
        return 0.0, math.inf
    spread = 2 * math.sqrt(50 * size)
    low = std * math.sqrt(max(0.0, size - spread)) - clip
    high = math.sqrt(clip * clip + 20 * std * clip + std * std * (size + spread + 100))
    return max(0.0, low), high


class DeviceFloorError(RuntimeError):
    """A device's update would leave it with less noise than its own floor."""


def sent_noise(run: RunConfig) -> float:
    """The noise multiplier of the update a device of ``run`` sends: its noise share's
    standard deviation over the clip under ``dp = "distributed"``
    (``z / sqrt(dp-min-clients)``); 0 otherwise (the update leaves the device as
    trained: the server, if any, adds the noise)."""
    mechanism = run_mechanism(run)
    if mechanism is None or mechanism.mode is not DpMode.DISTRIBUTED:
        return 0.0
    return mechanism.share_std / mechanism.clip  # 0 without a clip: no share then


def device_floor(run: RunConfig, floor: object) -> None:
    """The device's own minimum noise (node config ``dp-min-noise``, None: no floor):
    the device, not the server, decides how little noise its update may carry. A run
    whose update would leave the device with a noise multiplier below it is refused
    before training, so the server can lower none of ``dp``, ``dp-noise-multiplier``,
    ``dp-min-clients`` or ``dp-clip`` below what the device accepts.

    Raises
    ------
    DeviceFloorError
        Naming the floor, what the run asks and the fix; also for a floor that is not a
        number of at least 0.
    """
    if floor is None:
        return
    try:
        least = float(floor)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        least = math.nan
    if isinstance(floor, bool) or not 0 <= least < math.inf:
        raise DeviceFloorError(
            f"node config '{NODE_DP_MIN_NOISE}' = {floor!r} is not a noise multiplier (a "
            f"number of at least 0): restart the SuperNode with --node-config "
            f'"{NODE_DP_MIN_NOISE}=1.0" or without the key'
        )
    sent = sent_noise(run)
    if sent >= least:
        return
    settings = run.group(PrivacySettings)
    if settings.dp is not DpMode.DISTRIBUTED:
        asked = f"dp = '{settings.dp}' sends it un-noised"
    elif settings.dp_clip == 0:
        asked = "dp-clip = 0 (no clip) gives it no noise share"
    else:
        asked = f"dp = 'distributed' gives its share a noise multiplier of {sent:.4g}"

    raise DeviceFloorError(
        f"this device's node config '{NODE_DP_MIN_NOISE}' = {least:g} refuses the run's "
        f"update: {asked}. It sends no update; the run needs dp = 'distributed' with "
        f"dp-noise-multiplier / sqrt(dp-min-clients) >= {least:g}"
    )


def poisson_sample(
    population: Sequence[int], rate: float, generator: np.random.Generator
) -> list[int]:
    """Each of ``population`` independently with probability ``rate``, sorted."""
    chosen = generator.random(len(population)) < rate
    return sorted(int(p) for p, taken in zip(population, chosen, strict=True) if taken)


# -------------------------------------------------------------------------- accounting
def accountant_name(sampling: DpSampling) -> str:
    """The accountant that ``epsilon`` uses for ``sampling``."""
    if sampling is DpSampling.POISSON:
        return f"dp-accounting PLD (PoissonSampledDpEvent, discretization {PLD_DISCRETIZATION})"
    return "dp-accounting RDP (SampledWithoutReplacementDpEvent, replace-one)"


def epsilon(
    sampling: DpSampling,
    noise_multiplier: float,
    rate: float,
    population: int,
    cohort: float,
    rounds: int,
    delta: float,
    *,
    clip: float = 1.0,
) -> float:
    """Epsilon at ``delta`` of ``rounds`` releases of the subsampled Gaussian mechanism:
    0 for no release, infinite without noise or clip."""
    if rounds == 0 or rate == 0:
        return 0.0
    if noise_multiplier == 0 or math.isinf(clip):
        return math.inf
    return _epsilon(sampling, noise_multiplier, rate, population, cohort, rounds, delta)


@functools.lru_cache(maxsize=1024)
def _epsilon(
    sampling: DpSampling,
    noise_multiplier: float,
    rate: float,
    population: int,
    cohort: float,
    rounds: int,
    delta: float,
) -> float:
    import dp_accounting
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    relation = dp_accounting.NeighboringRelation
    if sampling is DpSampling.POISSON:
        gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
        event: object = dp_accounting.PoissonSampledDpEvent(rate, gaussian)
        accountant: dp_accounting.PrivacyAccountant = PLDAccountant(
            relation.ADD_OR_REMOVE_ONE, value_discretization_interval=PLD_DISCRETIZATION
        )
    else:  # replace-one: the sum of clipped updates moves by up to 2 C
        gaussian = dp_accounting.GaussianDpEvent(noise_multiplier / 2)
        event = dp_accounting.SampledWithoutReplacementDpEvent(population, round(cohort), gaussian)
        accountant = RdpAccountant(neighboring_relation=relation.REPLACE_ONE)
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    return float(accountant.get_epsilon(delta))


def calibrate(
    target: float,
    sampling: DpSampling,
    rate: float,
    population: int,
    cohort: float,
    rounds: int,
    delta: float,
) -> float:
    """The smallest noise multiplier (to 0.1%) whose ``rounds`` releases spend at most
    ``target`` epsilon at ``delta``.

    Raises
    ------
    ConfigError
        If no noise multiplier up to 1000 reaches ``target``.
    """
    spent = functools.partial(
        epsilon, sampling, rate=rate, population=population, cohort=cohort, rounds=rounds,
        delta=delta,
    )  # fmt: skip
    low, high = 0.0, 1.0
    while spent(high) > target:
        low, high = high, 2 * high
        if high > 1000:
            raise ConfigError(
                f"run-config key 'dp-target-epsilon' = {target}: no noise multiplier up to "
                f"1000 spends so little in {rounds} rounds at sampling rate {rate:g}; raise "
                "it, or sample fewer clients per round, or run fewer rounds."
            )
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        low, high = (middle, high) if spent(middle) > target else (low, middle)
    return high


# ---------------------------------------------------------------------------- a run
EPSILON = "dp.epsilon"  # rounds.jsonl, server: epsilon spent after the round
RELEASES = "dp.releases"  # rounds.jsonl, server: the releases that epsilon counts
CLIP = "dp.clip"  # rounds.jsonl, server, adaptive clipping: the clip of the round
NEXT_CLIP = "dp.next-clip"  # rounds.jsonl, server, adaptive clipping: the next round's


def colluded(mechanism: Mechanism, fraction: float) -> Mechanism:
    """Distributed DP when ``fraction`` of every release's noise shares belong to devices
    that collude with the observer: each device knows its own share, so together they
    subtract theirs, and the release keeps ``1 - fraction`` of its noise variance, a
    noise multiplier of ``z sqrt(1 - fraction)`` (with secure aggregation too: the sum
    it reveals still carries their shares). ``epsilon`` of the result is the guarantee
    left against them.

    Raises
    ------
    ValueError
        If ``fraction`` is not in [0, 1).
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"a colluding fraction of the shares in [0, 1), not {fraction!r}")
    left = mechanism.noise_multiplier * math.sqrt(1 - fraction)
    return dataclasses.replace(mechanism, noise_multiplier=left)


def run_mechanism(run: RunConfig) -> Mechanism | None:
    """The mechanism of ``run`` (None without ``dp``): its clients are the seen ones,
    sampled at ``fraction-train`` (``clients_per_round`` of them without replacement)
    over ``num-rounds`` rounds."""
    return mechanism(
        run.group(PrivacySettings),
        population=run.seen_clients,
        fraction=run.fraction_train,
        sample_size=run.clients_per_round,
        rounds=run.num_rounds,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedpers.privacy --epsilon E --rounds T --rate Q --population N``: the
    noise multiplier that spends ``E`` (what ``dp-target-epsilon`` chooses), for runs
    whose clients must size their own noise (``dp = "distributed"``); with
    ``--colluding F,...`` also the epsilon left against devices that hold the fractions
    ``F`` of every release's noise shares (``colluded``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fedpers.privacy", description=main.__doc__)
    parser.add_argument("--epsilon", type=float, required=True)
    parser.add_argument("--rounds", type=int, required=True, help="num-rounds")
    parser.add_argument("--rate", type=float, required=True, help="fraction-train")
    parser.add_argument("--population", type=int, required=True, help="the seen clients")
    parser.add_argument("--delta", type=float, default=0.0, help="0: 1 / population^1.1")
    parser.add_argument("--sampling", choices=[str(s) for s in DpSampling], default="poisson")
    parser.add_argument(
        "--colluding",
        type=_fractions,
        default=[],
        help="comma-separated fractions of the shares, each in [0, 1)",
    )
    args = parser.parse_args(argv)
    sampling = DpSampling(args.sampling)
    cohort = args.rate * args.population
    if sampling is DpSampling.WITHOUT_REPLACEMENT:
        cohort = float(max(1, round(cohort)))
    delta = args.delta or default_delta(args.population)
    rate = cohort / args.population
    noise = calibrate(args.epsilon, sampling, rate, args.population, cohort, args.rounds, delta)
    print(f"dp-noise-multiplier = {noise:.4f}  # epsilon {args.epsilon} at delta {delta:.3g}")  # noqa: T201
    honest = Mechanism(
        DpMode.DISTRIBUTED, 1.0, noise, sampling, args.population, rate, cohort, delta,
        max(1, math.floor(cohort)), 1.0,
    )  # fmt: skip
    for fraction in args.colluding:
        left = colluded(honest, fraction)
        print(  # noqa: T201
            f"colluding {100 * fraction:g}% of the shares: noise multiplier "
            f"{left.noise_multiplier:.4f}, epsilon {left.epsilon(args.rounds):.3f}"
        )
    return 0


def _fractions(text: str) -> list[float]:
    """``--colluding``: comma-separated numbers in [0, 1)."""
    import argparse

    try:
        fractions = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not comma-separated numbers") from None
    if not all(0 <= f < 1 for f in fractions):
        raise argparse.ArgumentTypeError(f"'{text}': each fraction must be in [0, 1)")
    return fractions


if __name__ == "__main__":
    raise SystemExit(main())
