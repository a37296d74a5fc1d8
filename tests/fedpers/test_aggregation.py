"""The weighted average against numpy, and its edge cases (hypothesis)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fedpers.aggregation import AggregationError, weighted_mean

finite = st.floats(-1e6, 1e6, allow_nan=False, width=64)


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
