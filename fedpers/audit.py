"""An empirical lower bound on a private run's epsilon, from the run itself.

Steinke, Nasr and Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS
2023): plant ``m`` canaries, each included independently with probability 1/2 (a
secret coin); after training, guess from what was released which canaries were
included. If the mechanism is ``(epsilon, delta)``-DP, the number ``W`` of correct
guesses among ``r`` satisfies (their Theorem 7)

    P[W >= v] <= P[B >= v] + 2 m delta max_{1 <= i <= v} P[v - i <= B < v] / i,

for ``B`` a Binomial(r, q) variable and
``q = e^epsilon / (1 + e^epsilon)``. The audit's lower bound at confidence ``1 - beta``
is the largest epsilon whose bound on ``P[W >= v]`` for the observed ``v`` is below
``beta``: a mechanism that spends less than it claims is never caught but with
probability ``beta``; one that spends more is caught when the canaries are visible.

In a federated run (``dp-audit-canaries`` > 0, ``dp = "central"`` or ``"distributed"``:
the release is the noised sum either way, its noise added by the server or by the
devices' shares and the server's top-up) a canary is a client
the server adds on its own: a fixed random direction ``u_i`` of the shared parts (all
arrays as one unit vector) and a coin. An included canary is sampled every round as a
real client is (independently, at the run's sampling rate) and then contributes the
update ``C u_i``, exactly at the clip, to the sum before the noise: the worst case the
clip allows, in the direction the auditor will look. The auditor sees what the
guarantee covers, every released model, and scores canary ``i`` by the sum over rounds
of ``<u_i, w_t - w_(t-1)>``; it guesses "included" for the ``k`` highest scores and
"excluded" for the ``k`` lowest (``k`` fixed before the run: ``m / 10``, at least 1).
The released model then carries the canaries too, an update of norm about
``C sqrt(m q / 2)`` a round over the cohort, which an audited run pays in accuracy.

Nothing here imports torch or Flower.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95  # the audit's lower bound holds with this probability
GUESS_FRACTION = 0.1  # guesses on each side: this fraction of the canaries (at least 1)
EPSILON_CEILING = 50.0  # the search stops here: an audit this strong has found a broken run
SEED_WORDS = 4  # 64-bit words of the secret seed of the canaries' directions


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """The bound on ``P[W >= v]`` of an ``(epsilon, delta)``-DP mechanism with ``m``
    canaries and ``r`` guesses (module docstring), at most 1."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, not v={v}, r={r}, m={m}")
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    if delta == 0 or v == 0:
        return min(1.0, tail)
    below = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, q))  # P[v-i <= B < v]
    alpha = float(np.max(below / np.arange(1, v + 1)))
    return min(1.0, tail + 2 * m * delta * alpha)


def epsilon_lower_bound(
    m: int, r: int, v: int, delta: float, *, confidence: float = CONFIDENCE
) -> float:
    """The largest epsilon (to 1e-4) that ``v`` correct guesses of ``r`` reject at
    ``confidence``: 0 when none is rejected, ``EPSILON_CEILING`` when every one below it
    is."""
    beta = 1 - confidence
    if p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    if p_value(m, r, v, EPSILON_CEILING, delta) < beta:
        return EPSILON_CEILING
    low, high = 0.0, EPSILON_CEILING  # p_value(low) < beta <= p_value(high)
    while high - low > 1e-4:
        middle = (low + high) / 2
        low, high = (middle, high) if p_value(m, r, v, middle, delta) < beta else (low, middle)
    return low


@dataclass
class CanaryAudit:
    """The canaries of one run: their directions, secret coins and running scores."""

    directions: np.ndarray  # (m, d) float32, unit rows
    included: np.ndarray  # (m,) bool, the secret coins
    scores: np.ndarray  # (m,) float64
    names: tuple[str, ...]  # the shared arrays, in the order of the flat vector
    seed: np.ndarray  # (SEED_WORDS,) int64, the directions' (a checkpoint keeps it, not them)
    rounds: int = 0

    @classmethod
    def plant(
        cls, count: int, reference: Mapping[str, np.ndarray], generator: np.random.Generator
    ) -> CanaryAudit:
        """``count`` canaries over the shared arrays ``reference`` (their shapes), from
        ``generator`` (the run's secret one: the coins must not be guessable). The
        directions come from a secret seed drawn from it, so that a checkpoint keeps
        them in 32 bytes (``state``)."""
        seed = generator.integers(0, 2**63 - 1, size=SEED_WORDS, dtype=np.int64)
        included = generator.random(count) < 0.5
        directions = _directions(seed, count, reference)
        return cls(directions, included, np.zeros(count), tuple(reference), seed)

    def state(self) -> dict[str, np.ndarray]:
        """What a checkpoint keeps of the audit: the directions' seed, the coins, the
        scores, the rounds observed and the arrays' order (``restore``)."""
        return {
            "seed": self.seed.copy(),
            "included": self.included.copy(),
            "scores": self.scores.copy(),
            "rounds": np.array(self.rounds, dtype=np.int64),
            "names": np.array(self.names),
        }

    @classmethod
    def restore(
        cls, state: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]
    ) -> CanaryAudit:
        """The audit ``state`` kept (a resumed run's), its directions drawn again from
        its seed over ``reference``'s shapes.

        Raises
        ------
        ValueError
            If ``state`` is not an audit's state over the arrays of ``reference``.
        """
        missing = sorted({"seed", "included", "scores", "rounds", "names"} - set(state))
        if missing:
            raise ValueError(f"the audit's state lacks {missing}")
        names = tuple(str(n) for n in np.atleast_1d(state["names"]))
        included = np.asarray(state["included"], dtype=bool)
        scores = np.asarray(state["scores"], dtype=np.float64)
        seed = np.asarray(state["seed"], dtype=np.int64)
        if names != tuple(reference) or included.shape != scores.shape or included.ndim != 1:
            raise ValueError(
                f"the audit's state is over arrays {list(names)} with {included.shape} coins "
                f"and {scores.shape} scores, not over {list(reference)}"
            )
        if seed.shape != (SEED_WORDS,) or not np.all(np.isfinite(scores)):
            raise ValueError(
                "the audit's state holds no seed of its directions or a score not finite"
            )
        directions = _directions(seed, len(included), reference)
        return cls(directions, included, scores, names, seed, int(state["rounds"]))

    def contribution(self, clip: float, rate: float, generator: np.random.Generator) -> np.ndarray:
        """The flat sum of this round's canary updates: each included canary sampled
        with probability ``rate`` adds ``clip u_i``."""
        sampled = self.included & (generator.random(len(self.included)) < rate)
        return clip * self.directions[sampled].sum(axis=0, dtype=np.float64)

    def observe(self, before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray]) -> None:
        """Score a release: ``<u_i, w_t - w_(t-1)>`` added to every canary's score."""
        change = np.concatenate(
            [(after[n].astype(np.float64) - before[n]).ravel() for n in self.names]
        )
        self.scores += self.directions @ change.astype(np.float32)
        self.rounds += 1

    def result(self, delta: float) -> dict[str, float]:
        """The guesses (the ``k`` highest scores "included", the ``k`` lowest
        "excluded"), how many were right, and the lower bound on epsilon they give."""
        m = len(self.scores)
        k = max(1, math.floor(GUESS_FRACTION * m))
        order = np.argsort(self.scores, kind="stable")
        guessed_in, guessed_out = order[m - k :], order[:k]
        correct = int(self.included[guessed_in].sum() + (~self.included[guessed_out]).sum())
        return {
            "canaries": float(m),
            "guesses": float(2 * k),
            "correct": float(correct),
            "rounds": float(self.rounds),
            "confidence": CONFIDENCE,
            "epsilon_lower": epsilon_lower_bound(m, 2 * k, correct, delta),
        }


def _directions(seed: np.ndarray, count: int, reference: Mapping[str, np.ndarray]) -> np.ndarray:
    """``count`` unit rows over the flat shared arrays of ``reference``, from ``seed``."""
    size = sum(int(a.size) for a in reference.values())
    generator = np.random.default_rng([int(word) for word in seed])
    directions = generator.standard_normal((count, size), dtype=np.float32)
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    return directions
