"""The weighted average against numpy, and its edge cases (hypothesis)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fedpers.aggregation import Aggregation, AggregationError, aggregate, weighted_mean

finite = st.floats(-1e6, 1e6, allow_nan=False, width=64)
ROBUST = {"reference": {"w": np.zeros(2, dtype=np.float32)}, "trim": 0.2, "clip": 2.0}


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda n: st.tuples(
            st.lists(arrays(np.float64, (3, 2), elements=finite), min_size=n, max_size=n),
            st.lists(st.floats(0.01, 1e3), min_size=n, max_size=n),
        )
    )
)
def test_equals_numpys_weighted_average(data: tuple[list[np.ndarray], list[float]]) -> None:
    values, weights = data
    result = weighted_mean([{"w": v} for v in values], weights)["w"]
    np.testing.assert_allclose(
        result, np.average(np.stack(values), axis=0, weights=weights), rtol=1e-9, atol=1e-6
    )


@settings(max_examples=30, deadline=None)
@given(arrays(np.float32, (4,), elements=st.floats(-1e6, 1e6, width=32)), st.floats(0.1, 100))
def test_a_single_reply_is_returned_as_is(value: np.ndarray, weight: float) -> None:
    result = weighted_mean([{"w": value}], [weight])["w"]
    assert result.dtype == np.float32
    np.testing.assert_array_equal(result, value)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(1e300, 1.7e308), min_size=2, max_size=5), st.data())
def test_huge_values_do_not_overflow(values: list[float], data: st.DataObject) -> None:
    weights = data.draw(st.lists(st.floats(0.5, 2.0), min_size=len(values), max_size=len(values)))
    result = weighted_mean([{"w": np.array([v])} for v in values], weights)["w"][0]
    assert np.isfinite(result)
    assert min(values) * (1 - 1e-12) <= result <= max(values) * (1 + 1e-12)


def test_edge_cases_raise_with_a_reason() -> None:
    one = {"w": np.ones(2)}
    with pytest.raises(AggregationError, match="no replies"):
        weighted_mean([], [])
    with pytest.raises(AggregationError, match="sum to zero"):
        weighted_mean([one, one], [0.0, 0.0])
    with pytest.raises(AggregationError, match="non-negative"):
        weighted_mean([one, one], [1.0, -1.0])
    with pytest.raises(AggregationError, match="non-negative"):
        weighted_mean([one], [float("nan")])
    with pytest.raises(AggregationError, match=r"float64\[3\]"):
        weighted_mean([one, {"w": np.ones(3)}], [1.0, 1.0])
    with pytest.raises(AggregationError, match="has arrays"):
        weighted_mean([one, {"v": np.ones(2)}], [1.0, 1.0])


@settings(max_examples=30, deadline=None)
@given(st.permutations(list(range(4))))
def test_order_of_replies_does_not_matter(order: list[int]) -> None:
    generator = np.random.default_rng(0)
    values = [generator.standard_normal(5) for _ in range(4)]
    weights = [1.0, 2.0, 3.0, 4.0]
    base = weighted_mean([{"w": v} for v in values], weights)["w"]
    permuted = weighted_mean([{"w": values[i]} for i in order], [weights[i] for i in order])["w"]
    np.testing.assert_allclose(permuted, base, rtol=1e-12, atol=1e-15)


# ---- robust aggregation, against hand computations and sorted-order oracles ----------
def _clients(values: list[float]) -> list[dict[str, np.ndarray]]:
    return [{"w": np.array([v, -v], dtype=np.float32)} for v in values]


def test_trimmed_mean_cuts_the_same_fraction_at_each_end() -> None:
    # Prepare: 10 clients, one wildly off; trim 0.2 cuts two values at each end
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 1e9]
    # Execute
    result = aggregate(Aggregation.TRIMMED_MEAN, _clients(values), [1.0] * 10, **ROBUST)["w"]
    # Assert: the mean of the middle six, computed by hand
    np.testing.assert_allclose(result, [5.5, -5.5], rtol=1e-6)
    assert result.dtype == np.float32


def test_median_is_numpys_coordinate_median_and_ignores_weights() -> None:
    rng = np.random.default_rng(0)
    stacked = rng.standard_normal((7, 3, 2))
    clients = [{"w": a} for a in stacked]
    result = aggregate(Aggregation.MEDIAN, clients, [1e12, 1, 1, 1, 1, 1, 1], **ROBUST)["w"]
    np.testing.assert_array_equal(result, np.sort(stacked, axis=0)[3])


def test_clipped_mean_bounds_each_update_by_the_median_norm() -> None:
    # Prepare: updates of norm 1, 1, 1 and 100 around a reference of zeros
    reference = {"w": np.zeros(2, dtype=np.float64)}
    clients = [{"w": np.array([1.0, 0.0])} for _ in range(3)] + [{"w": np.array([0.0, -100.0])}]
    # Execute: clip at 2 x the median norm (1.0)
    result = aggregate(
        Aggregation.CLIPPED_MEAN, clients, [1.0] * 4, reference=reference, trim=0.2, clip=2.0
    )["w"]
    # Assert: the outlier counts as (0, -2); the mean is ((3, 0) + (0, -2)) / 4
    np.testing.assert_allclose(result, [0.75, -0.5], rtol=1e-12)


def test_mean_is_weighted_mean_to_the_bit() -> None:
    rng = np.random.default_rng(1)
    clients = [{"w": rng.standard_normal((4, 3)).astype(np.float32)} for _ in range(5)]
    weights = [3.0, 1.0, 4.0, 1.0, 5.0]
    result = aggregate(Aggregation.MEAN, clients, weights, **ROBUST)
    np.testing.assert_array_equal(result["w"], weighted_mean(clients, weights)["w"])


def test_robust_aggregation_rejects_mismatched_replies() -> None:
    clients = [{"w": np.zeros(2)}, {"w": np.zeros(3)}]
    for method in (Aggregation.TRIMMED_MEAN, Aggregation.MEDIAN, Aggregation.CLIPPED_MEAN):
        with pytest.raises(AggregationError, match="reply 1"):
            aggregate(method, clients, [1.0, 1.0], reference={"w": np.zeros(2)}, trim=0.1, clip=1)
