"""Typed reads of Flower record values, in one place.

A ``MetricRecord`` or ``ConfigRecord`` value is typed as a union (numbers, strings,
bytes, lists of them), so reading one as a number needs a check, not a cast. These
helpers check and convert; a value of another type is a ``TypeError`` that names the
key, which screening turns into a rejection on the server and the ClientApp into a
clean error line on a device.
"""

from __future__ import annotations

from collections.abc import Mapping

from flwr.app import ConfigRecord


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
