"""``records.values`` decodes an ``Array`` exactly as ``Array.numpy()`` (numpy's own
``np.load``) does: the oracle, for every array hypothesis generates and for bytes that
a client may have edited; a failure is numpy's own error."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedpers import protocol, records

DTYPES = st.sampled_from(
    ["<f4", "<f8", ">f8", "<f2", "<i8", "<i4", "|u1", "|i1", "|b1", "<c16", "<u2"]
)


def _outcome(decode: object, array: Array) -> tuple[str, np.ndarray | None]:
    try:
        out = decode(array)  # type: ignore[operator]
    except Exception as error:  # the oracle's error is the expected one
        return type(error).__name__, None
    return "ok", out


def _same(array: Array) -> None:
    theirs = _outcome(Array.numpy, array)
    ours = _outcome(records.values, array)
    assert ours[0] == theirs[0]
    if theirs[1] is not None:
        assert ours[1] is not None
        assert ours[1].dtype == theirs[1].dtype
        assert ours[1].shape == theirs[1].shape
        np.testing.assert_array_equal(ours[1], theirs[1])
        assert ours[1].flags.writeable


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    hnp.arrays(
        dtype=DTYPES,
        shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6),
    ),
    st.booleans(),
)
def test_every_generated_array_decodes_as_numpy_decodes_it(
    value: np.ndarray, fortran: bool
) -> None:
    _same(Array(np.asfortranarray(value) if fortran else value))


@settings(max_examples=300, deadline=None)
@given(
    hnp.arrays(dtype=DTYPES, shape=hnp.array_shapes(min_dims=1, max_dims=3, max_side=5)),
    st.integers(min_value=0, max_value=400),
    st.binary(min_size=0, max_size=8),
    st.sampled_from(["replace", "truncate", "append"]),
)
def test_edited_bytes_decode_or_fail_as_numpy_does(
    value: np.ndarray, position: int, patch: bytes, edit: str
) -> None:
    array = Array(value)
    data = array.data
    at = position % (len(data) + 1)
    if edit == "replace":
        data = data[:at] + patch + data[at + len(patch) :]
    elif edit == "truncate":
        data = data[:at]
    else:
        data = data + patch
    _same(Array(dtype=array.dtype, shape=tuple(array.shape), stype=array.stype, data=data))


def test_a_remembered_header_serves_the_next_array_of_that_shape() -> None:
    first, second = np.arange(6.0).reshape(2, 3), -np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(records.values(Array(first)), first)
    np.testing.assert_array_equal(records.values(Array(second)), second)
    short = Array(second)
    truncated = Array(
        dtype=short.dtype, shape=tuple(short.shape), stype=short.stype, data=short.data[:-8]
    )
    with pytest.raises(ValueError, match="EOF"):  # numpy's, although the header is known
        records.values(truncated)


@pytest.mark.parametrize(
    ("at", "byte"),
    [(6, 0), (6, 3), (6, 9), (7, 1), (8, 0), (8, 255), (9, 1), (10, ord("["))],
    ids=[
        "major-0",
        "major-3",
        "major-9",
        "minor-1",
        "length-0",
        "length-255",
        "length-high",
        "header",
    ],
)
def test_edited_header_fields_decode_or_fail_as_numpy_does(at: int, byte: int) -> None:
    array = Array(np.arange(12, dtype="<f4").reshape(3, 4))
    records.values(array)  # its header is now remembered
    data = bytearray(array.data)
    data[at] = byte
    _same(Array(dtype=array.dtype, shape=tuple(array.shape), stype=array.stype, data=bytes(data)))


@settings(max_examples=50, deadline=None)
@given(
    hnp.arrays(
        st.sampled_from([np.float32, np.float64, np.int64]),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    )
)
def test_contiguous_keeps_every_shape_so_a_digest_survives_the_wire(array: np.ndarray) -> None:
    # np.ascontiguousarray makes a 0-d array (BatchNorm's step count) 1-d: a node's
    # arrays then differed from the digest it sent of them, and the vote on the initial
    # model of a BatchNorm model failed (found 2026-12-07).
    sent = records.values(Array(records.contiguous(array)))
    assert sent.shape == array.shape
    assert sent.dtype == array.dtype
    assert sent.flags.c_contiguous
    np.testing.assert_array_equal(sent, array)
    assert np.array_equal(protocol.arrays_digest({"a": sent}), protocol.arrays_digest({"a": array}))
