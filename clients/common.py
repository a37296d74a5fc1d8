"""Types and helpers every client uses; no torch, so numpy-only clients start fast."""

from __future__ import annotations

import numpy as np
from flwr.app import ConfigRecord

Arrays = dict[str, np.ndarray]
Metrics = dict[str, float]


def config_int(config: ConfigRecord, key: str, default: int | None = None) -> int:
    """An integer entry of the server's ConfigRecord, with a clear error if absent."""
    if key not in config:
        if default is not None:
            return default
        raise KeyError(f"the server's message lacks config entry '{key}'")
    return int(config[key])  # type: ignore[arg-type]


def config_float(config: ConfigRecord, key: str) -> float:
    """A float entry of the server's ConfigRecord, with a clear error if absent."""
    if key not in config:
        raise KeyError(f"the server's message lacks config entry '{key}'")
    return float(config[key])  # type: ignore[arg-type]
