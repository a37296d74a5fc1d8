"""Reply screening on its own: each check's verdict on hand-made replies."""

from __future__ import annotations

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

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
