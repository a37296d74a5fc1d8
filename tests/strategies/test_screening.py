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
from strategies import screening


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
    assert screening.weight_defect(_reply(metrics=negative)) == "negative number of examples"


def test_arrays_mismatch_compares_with_what_was_sent() -> None:
    sent = screening.array_specs(ArrayRecord({"w": Array(W), "v": Array(W[0])}))
    same = ArrayRecord({"w": Array(W), "v": Array(W[0])})
    assert screening.arrays_mismatch(same, sent, require_all=True) is None
    wrong_shape = ArrayRecord({"w": Array(np.ones((3, 3), dtype=np.float32)), "v": Array(W[0])})
    assert screening.arrays_mismatch(wrong_shape, sent, require_all=True) == (
        "array 'w' is float32[3, 3], expected float32[2, 3]"
    )
    wrong_dtype = ArrayRecord({"w": Array(W.astype(np.float64)), "v": Array(W[0])})
    assert "float64[2, 3]" in str(screening.arrays_mismatch(wrong_dtype, sent, require_all=True))
    partial = ArrayRecord({"w": Array(W)})
    assert screening.arrays_mismatch(partial, sent, require_all=True) == (
        "arrays missing from the reply: ['v']"
    )
    assert screening.arrays_mismatch(partial, sent, require_all=False) is None


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
