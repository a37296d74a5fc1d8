"""Deliberate client faults, for testing what the server does with them.

Run-config key ``fault-injection``: comma-separated ``kind:partition[@round]`` entries;
without ``@round`` the fault happens every round (``fedpers.faults`` parses them).
Kinds:

- ``raise``: the ClientApp raises (Flower returns an error reply);
- ``sleep``: the client sleeps ``round-timeout + 5`` seconds before training (its reply
  comes too late);
- ``nan``: the reply's arrays are NaN;
- ``shape``: the reply's first array has an extra row;
- ``dtype``: the reply's arrays are float16.

Empty (the default) injects nothing. It exists for the fault-tolerance tests and for
anyone who wants to see the server's behaviour on their own setup.
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import ConfigRecord

from clients.common import Arrays, Metrics, config_int
from fedpers import protocol
from fedpers.config import RunConfig
from fedpers.faults import parse_faults


class InjectedFaultError(RuntimeError):
    """The fault a ``raise`` entry asked for."""


def _active(run: RunConfig, partition: int, config: ConfigRecord) -> set[str]:
    if not run.fault_injection:
        return set()
    server_round = config_int(config, protocol.ROUND, default=0)
    return {
        kind
        for kind, p, at in parse_faults(run.fault_injection)
        if p == partition and (at is None or at == server_round)
    }


def before_fit(run: RunConfig, partition: int, config: ConfigRecord) -> None:
    """Raise or sleep, if this node is asked to in this round."""
    active = _active(run, partition, config)
    if "raise" in active:
        round_number = config_int(config, protocol.ROUND, default=0)
        raise InjectedFaultError(f"injected fault in round {round_number}")
    if "sleep" in active:
        time.sleep(run.round_timeout + 5.0)


def after_fit(
    run: RunConfig, partition: int, config: ConfigRecord, arrays: Arrays, metrics: Metrics
) -> tuple[Arrays, Metrics]:
    """Corrupt the reply, if this node is asked to in this round."""
    active = _active(run, partition, config)
    if not arrays or not active & {"nan", "shape", "dtype"}:
        return arrays, metrics
    if "nan" in active:
        arrays = {k: np.full_like(v, np.nan) for k, v in arrays.items()}
    if "dtype" in active:
        arrays = {k: v.astype(np.float16) for k, v in arrays.items()}
    if "shape" in active:
        first = next(iter(arrays))
        arrays = {**arrays, first: np.concatenate([arrays[first], arrays[first][:1]])}
    return arrays, metrics
