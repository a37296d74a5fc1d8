"""Deliberate client faults and attacks, for testing what the server does with them.

Run-config key ``fault-injection`` says which partitions misbehave, how and when
(``fedpers.faults``: ``kind[=value]:partitions[@round]``). The hooks here are called by
the ClientApp at the points where a real faulty or hostile client would act:

- ``before_fit``: fail (``raise``) or be too late (``sleep``);
- ``device_privacy``: under ``dp = "distributed"``, skip the noise share or the clip;
- ``after_fit``: change what training produced (malformed arrays; sign-flipped,
  noisy, huge or inflated updates; bad mixture statistics);
- ``on_wire``: break the reply message itself (bytes, serialization, metric types);
- ``startup``: corrupt answers to start-up queries (round 0);
- ``relay``: corrupt what agents relay to their neighbours.

The arrays that the family-specific kinds aim at are the family's to name
(``FamilySpec.fault_targets``); nothing here knows a family.

Empty (the default) injects nothing.
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import Array, ConfigRecord, Message, MetricRecord

from fedpers import protocol
from fedpers.cohort import Arrays, Metrics
from fedpers.config import RunConfig
from fedpers.faults import Fault, parse_faults
from fedpers.records import config_int
from fedpers.seeding import rng


class InjectedFaultError(RuntimeError):
    """The fault a ``raise`` entry asked for."""


def _active(run: RunConfig, partition: int, server_round: int) -> dict[str, Fault]:
    if not run.fault_injection:
        return {}
    return {
        fault.kind: fault
        for fault in parse_faults(run.fault_injection)
        if fault.applies(partition, server_round)
    }


def _value(fault: Fault) -> float:
    assert fault.value is not None  # the kinds read here all have a default
    return fault.value


def before_fit(run: RunConfig, partition: int, config: ConfigRecord) -> None:
    """Raise or sleep, if this node is asked to in this round."""
    server_round = config_int(config, protocol.ROUND, default=0)
    active = _active(run, partition, server_round)
    if "raise" in active:
        raise InjectedFaultError(f"injected fault in round {server_round}")
    if "sleep" in active:
        time.sleep(run.round_timeout + 5.0)


def device_privacy(
    run: RunConfig, partition: int, config: ConfigRecord, clip: float, std: float
) -> tuple[float, float]:
    """The clip and the noise share a device applies under ``dp = "distributed"``: the
    run's ``clip`` and ``std``, unless it is asked to skip one (``dp-no-clip``: no clip;
    ``dp-no-noise``: no noise)."""
    active = _active(run, partition, config_int(config, protocol.ROUND, default=0))
    return (
        float("inf") if "dp-no-clip" in active else clip,
        0.0 if "dp-no-noise" in active else std,
    )


def after_fit(
    run: RunConfig,
    partition: int,
    config: ConfigRecord,
    received: Arrays,
    arrays: Arrays,
    metrics: Metrics,
) -> tuple[Arrays, Metrics]:
    """Change what training produced, if this node is asked to in this round."""
    server_round = config_int(config, protocol.ROUND, default=0)
    active = _active(run, partition, server_round)
    if not active:
        return arrays, metrics
    arrays, metrics = dict(arrays), dict(metrics)
    if fault := active.get("sign-flip"):
        scale = _value(fault)
        arrays = {
            k: (received[k] - scale * (v - received[k])).astype(v.dtype) if k in received else v
            for k, v in arrays.items()
        }
    if fault := active.get("noise"):
        generator = rng(run.seed, "fault-noise", partition, server_round)
        arrays = {
            k: (v + generator.normal(0.0, _value(fault), v.shape)).astype(v.dtype)
            if k in received
            else v
            for k, v in arrays.items()
        }
    if fault := active.get("huge"):
        arrays = {k: np.full_like(v, _value(fault)) for k, v in arrays.items()}
    if "nan" in active:
        arrays = {k: np.full_like(v, np.nan) for k, v in arrays.items()}
    if "dtype" in active:
        arrays = {k: v.astype(np.float16) for k, v in arrays.items()}
    targets = run.family.fault_targets
    for name in targets.select(targets.responsibilities, list(arrays)):
        if fault := active.get("responsibilities"):
            arrays[name] = np.full_like(arrays[name], _value(fault))
        if "responsibilities-shape" in active:
            arrays[name] = np.concatenate([arrays[name], arrays[name][:1]])
    if active.keys() & {"non-psd", "asymmetric"}:
        for name in targets.select(targets.second_moments, list(arrays)):
            arrays[name] = _bad_second_moments(arrays[name], asymmetric="asymmetric" in active)
    if arrays and active.keys() & {"shape", "rename", "extra", "drop"}:
        first = next(iter(arrays))
        if "shape" in active:
            arrays[first] = np.concatenate([arrays[first], arrays[first][:1]])
        if "extra" in active:
            arrays[f"{first}.extra"] = arrays[first].copy()
        if "rename" in active:
            arrays[f"{first}.renamed"] = arrays.pop(first)
        if "drop" in active:
            arrays.pop(first, None)
    if fault := active.get("inflate"):
        metrics[protocol.NUM_EXAMPLES] = _value(fault)
    if "zero-examples" in active:
        metrics[protocol.NUM_EXAMPLES] = 0.0
    return arrays, metrics


def _bad_second_moments(second: np.ndarray, *, asymmetric: bool) -> np.ndarray:
    """Second moments that no data has: indefinite, or not symmetric."""
    bad = second.copy()
    if bad.ndim == 3:  # full covariances (M1, d, d)
        scale = 10.0 * max(1.0, float(np.max(np.abs(bad))))
        if asymmetric:
            bad[:, 0, -1] += scale
        else:
            bad -= scale * np.eye(bad.shape[-1])
    else:  # diagonal (M1, d)
        bad -= 10.0 * max(1.0, float(np.max(np.abs(bad))))
    return bad


def on_wire(run: RunConfig, partition: int, config: ConfigRecord, reply: Message) -> Message:
    """Break the reply message itself, if this node is asked to in this round."""
    server_round = config_int(config, protocol.ROUND, default=0)
    active = _active(run, partition, server_round)
    if not active or reply.has_error():
        return reply
    content = reply.content
    records = content.array_records.get(protocol.ARRAYS)
    if records is not None and len(records) and active.keys() & {"corrupt-data", "bad-stype"}:
        name = next(iter(records.keys()))
        array = records[name]
        if "corrupt-data" in active:
            other = Array(np.arange(7, dtype=np.float64))
            records[name] = Array(
                dtype=array.dtype, shape=tuple(array.shape), stype=array.stype, data=other.data
            )
        else:
            records[name] = Array(
                dtype=array.dtype, shape=tuple(array.shape), stype="pickle", data=array.data
            )
    metrics = content.metric_records.get(protocol.METRICS)
    if metrics is not None:
        values = dict(metrics)
        if "examples-list" in active:
            values[protocol.NUM_EXAMPLES] = [float(str(values.get(protocol.NUM_EXAMPLES, 0.0)))]
        if "loss-list" in active:
            values[protocol.LOSS] = [float("nan")]
        content[protocol.METRICS] = MetricRecord(values)
    return reply


def startup(run: RunConfig, partition: int, arrays: Arrays) -> Arrays:
    """Corrupt an answer to a start-up query (round 0), if asked to."""
    active = _active(run, partition, 0)
    if fault := active.get("startup-scale"):  # the values, not the sample counts
        arrays = {
            k: v * _value(fault) if v.dtype.kind == "f" and "count" not in k else v
            for k, v in arrays.items()
        }
    if "startup-nan" in active:
        arrays = {
            k: np.full_like(v, np.nan) if v.dtype.kind == "f" else v for k, v in arrays.items()
        }
    if "startup-width" in active:
        arrays = {
            k: np.pad(v, ((0, 0), (0, 1))) if v.ndim == 2 and v.dtype.kind == "f" else v
            for k, v in arrays.items()
        }
    return arrays


def relay(run: RunConfig, partition: int, config: ConfigRecord, arrays: Arrays) -> Arrays:
    """Corrupt what an agent relays to its neighbours, if asked to in this round: the
    arrays its family names ``fault_targets.relayed`` (Sheaf-FRL's pilots, own or
    transported, Sheaf-FMTL's projections, FedMuscle's representations, CoMFed's
    prototypes)."""
    active = _active(run, partition, config_int(config, protocol.ROUND, default=0))
    targets = run.family.fault_targets
    pilots = targets.select(targets.relayed, arrays)
    if fault := active.get("pilots-scale"):
        arrays = {**arrays, **{k: arrays[k] * _value(fault) for k in pilots}}
    if "pilots-nan" in active:
        arrays = {**arrays, **{k: np.full_like(arrays[k], np.nan) for k in pilots}}
    return arrays
