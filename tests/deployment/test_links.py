"""The link model of tests/deployment/links.py (netem's delay, jitter, loss, rate and
limit) against its stated bounds, on generated frames: no network needed."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.deployment.links import Direction, Impairment


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(60, 1514), min_size=1, max_size=200),
    gaps=st.lists(st.floats(0, 0.01), min_size=200, max_size=200),
    seed=st.integers(0, 2**31),
)
def test_frames_leave_in_order_after_delay_jitter_and_their_transmission(
    sizes: list[int], gaps: list[float], seed: int
) -> None:
    model = Impairment(delay_s=0.150, jitter_s=0.030, loss=0.0, rate_bps=5e6)
    link = Direction(model, random.Random(seed))
    now, arrivals = 0.0, []
    for size, gap in zip(sizes, gaps, strict=False):
        now += gap
        link.arrive(bytes(size), now)
        arrivals.append(now)
    departures = [d for d, _ in link.queue]
    assert departures == sorted(departures)  # no reordering
    previous = 0.0
    for arrived, departure, size in zip(arrivals, departures, sizes, strict=True):
        transmission = 8 * size / model.rate_bps
        assert departure >= arrived + model.delay_s - model.jitter_s + transmission - 1e-12
        assert departure >= previous + transmission - 1e-12  # the link carries one at a time
        # never later than its own worst delay or the frame ahead of it, plus its own time
        assert (
            departure
            <= max(arrived + model.delay_s + model.jitter_s, previous) + transmission + 1e-12
        )
        previous = departure
    assert link.due(departures[-1])
    assert not link.queue


def test_loss_rate_is_as_set() -> None:
    """10,000 frames at 2 %: the count lost is within 4.5 standard deviations of 200
    (a false failure about once in 10^5 runs; the seed is fixed besides)."""
    link = Direction(Impairment(loss=0.02), random.Random(7))
    delivered = 0
    for index in range(10_000):
        link.arrive(bytes(100), index * 1e-3)
        delivered += len(link.due(index * 1e-3))
    sd = (10_000 * 0.02 * 0.98) ** 0.5
    assert abs(link.counts["lost"] - 200) <= 4.5 * sd
    assert link.counts["overflow"] == 0
    assert link.counts["lost"] + delivered + len(link.queue) == 10_000


def test_no_more_than_limit_frames_wait() -> None:
    link = Direction(Impairment(loss=0.0, limit=5), random.Random(0))
    for _ in range(8):
        link.arrive(bytes(1000), 0.0)
    assert len(link.queue) == 5
    assert link.counts["overflow"] == 3


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"jitter_s": 0.2, "delay_s": 0.1}, "jitter"),
        ({"loss": 1.0}, "loss"),
        ({"rate_bps": 0.0}, "rate"),
    ],
)
def test_bad_models_are_refused(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Impairment(**fields)


def test_netem_arguments_say_the_same_model() -> None:
    assert Impairment().netem_args() == [
        "delay", "150ms", "30ms", "loss", "2%", "rate", "5000kbit", "limit", "1000",
    ]  # fmt: skip
