"""Reply screening on its own: each check's verdict on hand-made replies."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from hypothesis import given
from hypothesis import strategies as st

from fedpers import protocol
from fedpers.strategies import screening


def _reply(
    arrays: dict[str, np.ndarray] | None = None,
    metrics: dict[str, float] | None = None,
    node: int = 7,
) -> Message:
    request = Message(content=RecordDict(), message_type=MessageType.TRAIN, dst_node_id=node)
    request.metadata.__dict__["_message_id"] = f"m{node}"
    content = RecordDict({protocol.METRICS: MetricRecord(metrics or {protocol.NUM_EXAMPLES: 3.0})})
    if arrays is not None:
        content[protocol.ARRAYS] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    return Message(content=content, reply_to=request)


def _error(node: int = 7) -> Message:
    request = Message(content=RecordDict(), message_type=MessageType.TRAIN, dst_node_id=node)
    request.metadata.__dict__["_message_id"] = f"m{node}"
    return Message(Error(code=0, reason="boom"), reply_to=request)


W = np.ones((2, 3), dtype=np.float32)


def test_defect_names_errors_and_non_finite_values() -> None:
    assert screening.defect(_reply({"w": W})) is None
    assert screening.defect(_error()) == "client error: boom"
    bad = W.copy()
    bad[1, 2] = np.inf
    assert screening.defect(_reply({"w": bad})) == "non-finite values in array 'arrays/w'"
    nan_metric = {protocol.NUM_EXAMPLES: 3.0, protocol.LOSS: float("nan")}
    assert screening.defect(_reply(metrics=nan_metric)) == "non-finite metric 'loss'"


def test_weight_defect_needs_a_non_negative_num_examples() -> None:
    assert screening.weight_defect(_reply()) is None
    assert screening.weight_defect(_reply(metrics={protocol.LOSS: 1.0})) == (
        "no 'num-examples' metric"
    )
    negative = {protocol.NUM_EXAMPLES: -1.0}
    assert screening.weight_defect(_reply(metrics=negative)) == (
        "metric 'num-examples' = -1 is outside its range [0, inf]"
    )


def test_arrays_defect_compares_with_what_was_expected() -> None:
    sent = screening.array_specs(ArrayRecord({"w": Array(W), "v": Array(W[0])}))
    same = ArrayRecord({"w": Array(W), "v": Array(W[0])})
    assert screening.arrays_defect(same, sent) is None
    wrong_shape = ArrayRecord({"w": Array(np.ones((3, 3), dtype=np.float32)), "v": Array(W[0])})
    assert screening.arrays_defect(wrong_shape, sent) == (
        "array 'w' is float32[3, 3], expected float32[2, 3]"
    )
    wrong_dtype = ArrayRecord({"w": Array(W.astype(np.float64)), "v": Array(W[0])})
    assert "float64[2, 3]" in str(screening.arrays_defect(wrong_dtype, sent))
    partial = ArrayRecord({"w": Array(W)})
    assert screening.arrays_defect(partial, sent) == "arrays missing from the reply: ['v']"
    assert screening.arrays_defect(partial, sent, exact=False) is None
    extra = ArrayRecord({"w": Array(W), "v": Array(W[0]), "x": Array(W)})
    assert screening.arrays_defect(extra, sent) == "arrays the server did not expect: ['x']"
    renamed = ArrayRecord({"w": Array(W), "v2": Array(W[0])})
    assert screening.arrays_defect(renamed, sent) == "arrays missing from the reply: ['v']"


def _with_array(array: Array) -> Message:
    reply = _reply({"w": W})
    reply.content[protocol.ARRAYS] = ArrayRecord({"w": array})
    return reply


def test_defect_decodes_every_array_and_checks_what_it_declares() -> None:
    # Declared shape and dtype right, data not: bytes of another array
    other = Array(np.ones((5, 5), dtype=np.float64))
    lying = Array(dtype="float32", shape=(2, 3), stype=other.stype, data=other.data)
    assert screening.defect(_with_array(lying)) == (
        "array 'w' declares float32[2, 3] but holds float64[5, 5]"
    )
    garbage = Array(dtype="float32", shape=(2, 3), stype=other.stype, data=b"not numpy")
    assert screening.defect(_with_array(garbage)) == "array 'w' does not decode (ValueError)"
    unknown = Array(dtype="float32", shape=(2, 3), stype="pickle", data=b"x")
    assert screening.defect(_with_array(unknown)) == (
        "array 'w' is serialized as 'pickle', not numpy"
    )
    text = Array(np.array(["a", "b"]))
    assert "non-numeric dtype" in str(screening.defect(_with_array(text)))


def test_defect_needs_numbers_as_metrics_and_only_named_records() -> None:
    listed = _reply(metrics={protocol.NUM_EXAMPLES: 3.0, protocol.LOSS: [1.0, 2.0]})
    assert screening.defect(listed) == "metric 'loss' is list, not a number"
    reply = _reply({"w": W})
    reply.content["smuggled"] = ArrayRecord({"w": Array(W)})
    assert screening.defect(reply) == (
        "a record named 'smuggled': a reply carries only 'arrays' (an ArrayRecord) and "
        "'metrics' (a MetricRecord)"
    )


def test_weight_defect_needs_a_finite_non_negative_number() -> None:
    as_list = _reply(metrics={protocol.NUM_EXAMPLES: [3.0]})
    assert screening.weight_defect(as_list) == "metric 'num-examples' is list, not a number"
    nan = _reply(metrics={protocol.NUM_EXAMPLES: float("nan")})
    assert screening.weight_defect(nan) == "non-finite metric 'num-examples'"


def test_symmetric_psd_defect_against_eigenvalues() -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4, 4))
    psd = a @ np.swapaxes(a, 1, 2)
    assert screening.symmetric_psd_defect("s", psd) is None
    assert screening.symmetric_psd_defect("s", psd + np.triu(np.ones((4, 4)), 1)) == (
        "'s' [0] is not symmetric"
    )
    negative = psd.copy()
    negative[1] -= 100 * np.eye(4)  # eigenvalues shifted below zero
    assert "not positive semi-definite" in str(screening.symmetric_psd_defect("s", negative))


def test_screen_turns_a_check_that_raises_into_a_rejection() -> None:
    def broken(reply: Message) -> str | None:
        raise KeyError("gamma")

    screened = screening.screen([_reply({"w": W}, node=4)], [broken], lambda r: 9)
    assert screened.kept == []
    assert screened.rejected == [(9, "screening failed: KeyError: 'gamma'")]


def test_screen_keeps_the_good_and_names_the_first_reason_of_the_bad() -> None:
    # Prepare: node 1 fine, node 2 an error, node 3 without weight and with NaN
    good = _reply({"w": W}, node=1)
    bad_nan = W.copy()
    bad_nan[0, 0] = np.nan
    replies = [good, _error(node=2), _reply({"w": bad_nan}, {protocol.LOSS: 1.0}, node=3)]
    # Execute
    screened = screening.screen(
        replies,
        [screening.defect, screening.weight_defect],
        partition_of=lambda r: r.metadata.src_node_id * 10,
    )
    # Assert
    assert screened.kept == [good]
    assert screened.rejected == [
        (20, "client error: boom"),
        (30, "non-finite values in array 'arrays/w'"),
    ]


# ------------------------------------------------------------ update norms
_FINITE = st.floats(-1e6, 1e6, allow_nan=False)


@given(
    st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=1, max_size=4),
    st.integers(0, 2**32 - 1),
)
def test_update_norm_is_the_norm_of_the_concatenated_differences(
    shapes: list[tuple[int, int]], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    sent = {f"a{i}": rng.normal(size=s) for i, s in enumerate(shapes)}
    returned = {n: (v + rng.normal(size=v.shape)).astype(np.float32) for n, v in sent.items()}
    returned["not-sent"] = np.ones(3, dtype=np.float32)  # no counterpart: not counted
    returned["counts"] = np.ones(2, dtype=np.int64)
    sent["counts"] = np.zeros(2, dtype=np.int64)  # not floating point: not counted
    oracle = np.linalg.norm(
        np.concatenate(
            [returned[n].astype(np.float64).ravel() - sent[n].ravel() for n in sent if n[0] == "a"]
        )
    )
    assert screening.update_norm(returned, sent) == pytest.approx(oracle, rel=1e-12)


@given(st.lists(_FINITE, min_size=1, max_size=40))
def test_lower_median_is_statistics_median_low(values: list[float]) -> None:
    assert screening.lower_median(values) == statistics.median_low(values)


@given(
    st.lists(st.floats(0, 1e6, allow_nan=False), min_size=0, max_size=30),
    st.floats(1, 100),
)
def test_norm_outliers_are_exactly_the_norms_beyond_cap_times_the_lower_median(
    norms: list[float], cap: float
) -> None:
    bound, beyond = screening.norm_outliers(norms, cap)
    if len(norms) < 2 or statistics.median_low(norms) == 0:
        assert (bound, beyond) == (math.inf, [])
        return
    assert bound == cap * statistics.median_low(norms)
    assert beyond == [i for i, n in enumerate(norms) if n > bound]
    # fewer than half can be beyond it: the lower median and those below it never are
    assert len(beyond) < (len(norms) + 1) / 2


@given(st.lists(st.floats(0.1, 10), min_size=3, max_size=30), st.floats(0, 1e12))
def test_one_changed_norm_cannot_raise_the_bound_beyond_the_others_largest(
    honest: list[float], attacker: float
) -> None:
    # Whatever one reply claims, the lower median stays within the honest norms, so the
    # bound is at most cap times the largest honest norm and the attacker's own norm is
    # judged against it.
    cap = 10.0
    bound, beyond = screening.norm_outliers([*honest, attacker], cap)
    assert cap * min(honest) <= bound <= cap * max(honest)
    assert (len(honest) in beyond) == (attacker > bound)


def test_a_matrix_that_overflowed_is_not_positive_semi_definite() -> None:
    # Finite statistics can imply an infinite covariance (1e300 squared): inf passed the
    # symmetry test (atol inf) and eigvalsh gave no negative eigenvalue to find.
    identity = np.eye(3)
    for bad in (np.inf, -np.inf, np.nan):
        matrix = identity.copy()
        matrix[0, 0] = bad
        reason = screening.symmetric_psd_defect("c", np.stack([identity, matrix]))
        assert reason == "'c' [1] is not finite"
    assert screening.symmetric_psd_defect("c", identity[None]) is None
