"""Typed reads of Flower record values, in one place.

A ``MetricRecord`` or ``ConfigRecord`` value is typed as a union (numbers, strings,
bytes, lists of them), so reading one as a number needs a check, not a cast. These
helpers check and convert; a value of another type is a ``TypeError`` that names the
key, which screening turns into a rejection on the server and the ClientApp into a
clean error line on a device.

``values`` decodes an ``Array`` as ``Array.numpy()`` does, without parsing the same
.npy header again for every message.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ConfigRecord


def number(value: object, key: str = "value") -> float:
    """``value`` as a float, if it is an int or a float (not a bool).

    Raises
    ------
    TypeError
        Naming ``key``, for any other type.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"'{key}' is {type(value).__name__}, not a number")
    return float(value)


def integer(value: object, key: str = "value") -> int:
    """``value`` as an int, if it is an int or an integral float (not a bool).

    Raises
    ------
    TypeError
        Naming ``key``, for any other type or a float with a fraction.
    """
    as_float = number(value, key)
    if not as_float.is_integer():
        raise TypeError(f"'{key}' is {value!r}, not an integer")
    return int(value) if isinstance(value, int) else int(as_float)


def numbers(record: Mapping[str, object]) -> dict[str, float]:
    """Every value of a record as a float (``number`` of each)."""
    return {key: number(value, key) for key, value in record.items()}


def config_int(config: ConfigRecord, key: str, default: int | None = None) -> int:
    """An integer entry of the server's ConfigRecord, with a clear error if absent."""
    if key not in config:
        if default is not None:
            return default
        raise KeyError(f"the server's message lacks config entry '{key}'")
    return integer(config[key], key)


def config_float(config: ConfigRecord, key: str) -> float:
    """A float entry of the server's ConfigRecord, with a clear error if absent."""
    if key not in config:
        raise KeyError(f"the server's message lacks config entry '{key}'")
    return number(config[key], key)


# ------------------------------------------------------------------------------- arrays
_NPY_MAGIC = b"\x93NUMPY"
_HEADER_CACHE_SIZE = 1024
_headers: dict[bytes, tuple[np.dtype[Any], tuple[int, ...]]] = {}


def values(array: Array) -> np.ndarray:
    """The numpy array an ``Array`` holds: what ``array.numpy()`` returns, value for
    value, dtype and shape (a writable copy, as ``np.load`` gives), faster.

    ``Array.numpy()`` is ``np.load`` on the bytes, which parses the .npy header with
    ``ast.literal_eval`` for every array: 0.1-0.2 ms, a fifth of a FedGMM script's
    message handling (122,000 decodes, cProfile). The headers of a run repeat (one per
    array name), so each distinct header is parsed once, by numpy, and remembered (at
    most ``_HEADER_CACHE_SIZE``; a flood of distinct headers only empties the memory).
    Anything but a C-ordered, numeric, version 1 or 2 .npy goes to ``array.numpy()``, and
    so does any failure, so that errors are numpy's own.
    """
    data = array.data
    if (
        array.stype != "numpy.ndarray"
        or not isinstance(data, bytes)
        or data[:6] != _NPY_MAGIC
        or data[7:8] != b"\x00"  # a minor version numpy refuses
    ):
        return array.numpy()
    try:
        major = data[6]
        width = 2 if major == 1 else 4
        length = int.from_bytes(data[8 : 8 + width], "little")
        start = 8 + width + length
        header = data[8 + width : start]
        known = _headers.get(header)
        if known is None:
            known = _parse_header(data, major)
            if len(_headers) >= _HEADER_CACHE_SIZE:
                _headers.clear()
            _headers[header] = known
        dtype, shape = known
        count = math.prod(shape)
        flat = np.frombuffer(data, dtype=dtype, count=count, offset=start)
        return flat.reshape(shape).copy()
    except (ValueError, TypeError, IndexError, _FallbackError):
        return array.numpy()


class _FallbackError(Exception):
    """A header ``values`` leaves to ``np.load``."""


def _parse_header(data: bytes, major: int) -> tuple[np.dtype[Any], tuple[int, ...]]:
    readers = {1: np.lib.format.read_array_header_1_0, 2: np.lib.format.read_array_header_2_0}
    if major not in readers:
        raise _FallbackError
    stream = io.BytesIO(data)
    np.lib.format.read_magic(stream)
    shape, fortran, dtype = readers[major](stream)  # numpy's own parser and checks
    if fortran or dtype.hasobject or dtype.kind not in "biufc":
        raise _FallbackError
    return dtype, tuple(int(n) for n in shape)


def contiguous(array: np.ndarray) -> np.ndarray:
    """``array`` C-contiguous in its own shape, for an ``Array``: ``np.ascontiguousarray``
    returns a 0-d array (BatchNorm's step count) as 1-d, which a model of the 0-d buffer
    then refuses (and a digest of the arrays no longer matches them)."""
    return np.ascontiguousarray(array) if np.ndim(array) else np.array(array)


def unflatten(flat: np.ndarray, reference: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``flat`` (one vector) cut into arrays of ``reference``'s shapes, in its order, as
    views of ``flat`` (its dtype)."""
    out, start = {}, 0
    for name, array in reference.items():
        out[name] = flat[start : start + array.size].reshape(array.shape)
        start += array.size
    return out
