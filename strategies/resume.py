"""A resumed run's nodes continue from the state its checkpoint saw, or it is refused.

Before round ``R + 1`` of a run resumed from its checkpoint of round ``R``, every node
is asked (``query.snapshot``) to restore its state from its newest snapshot of a round
up to ``R``, and to say which round that was. The checkpoint knows, for each partition,
the last round ``e`` whose training reply came back without error (a client replies
after it saved its snapshot; ``Checkpoint.trained``). The resume is refused, before any
round, if a node

- restored nothing, or a round before ``e`` (its snapshots deleted, or the newest
  damaged): it would continue from an older state than the uninterrupted run;
- refused its newest snapshot because it is not its own (another partition's, another
  run's, another round's: ``clients.device_state.SnapshotError``);
- held state already (a node that served this run before the resume), or did not answer.

A node that restored a round after ``e`` (its reply was lost, its snapshot was not)
continues from there, as it would have in the uninterrupted run. Only the algorithms
whose clients keep state (``AlgorithmSpec.keeps_state``) are asked.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedpers import protocol
from fedpers.checkpoint import Checkpoint, ResumeError
from fedpers.strategies.federation import Exchange

if TYPE_CHECKING:
    from fedpers.strategies.base import FedpersStrategy


class DeviceStateError(ResumeError):
    """A resumed run's node cannot continue from the state its checkpoint saw."""


def restore_devices(
    strategy: FedpersStrategy, grid: Grid, checkpoint: Checkpoint, *, where: Path, timeout: float
) -> None:
    """Have every node restore its state for the round after ``checkpoint`` (the
    checkpoint file ``where``), or refuse the resume.

    Raises
    ------
    DeviceStateError
        Naming each partition whose state does not continue the checkpoint, and why.
    """
    partitions = sorted(strategy.federation.node_of_partition)
    config = ConfigRecord({protocol.ROUND: checkpoint.round, protocol.RUN_TOKEN: checkpoint.token})
    exchange = strategy.federation.broadcast(
        grid,
        protocol.QUERY_SNAPSHOT,
        partitions,
        RecordDict({protocol.CONFIG: config}),
        timeout=timeout,
    )
    if defects := snapshot_defects(exchange, checkpoint):
        raise DeviceStateError(
            f"cannot resume from {where} (round {checkpoint.round}): the device state of "
            f"{len(defects)} partition(s) does not continue it: {'; '.join(defects[:5])}. "
            "Put back each node's own snapshots (under client-state-dir, or the node's "
            "state-dir), or start afresh (resume = false)"
        )


def snapshot_defects(exchange: Exchange, checkpoint: Checkpoint) -> list[str]:
    """``partition P: why`` for each partition of ``exchange`` (the answers to
    ``query.snapshot``) whose restored state does not continue ``checkpoint``."""
    defects = []
    for partition in exchange.sent:
        if partition in exchange.failures:
            defects.append(f"partition {partition}: {exchange.failures[partition]}")
        elif reason := _defect(exchange.replies[partition], checkpoint, partition):
            defects.append(f"partition {partition}: {reason}")
    return defects


def _defect(reply: Message, checkpoint: Checkpoint, partition: int) -> str | None:
    metrics = reply.content.metric_records.get(protocol.METRICS)
    restored = None if metrics is None else metrics.get(protocol.SNAPSHOT_ROUND)
    if isinstance(restored, bool) or not isinstance(restored, int | float):
        return f"answered no '{protocol.SNAPSHOT_ROUND}'"
    if restored == -1:
        return "its node held state before the resume, of an unknown round; restart the node"
    if not (0 <= restored <= checkpoint.round and float(restored).is_integer()):
        return f"restored round {restored}, not in 0..{checkpoint.round}"
    expected = checkpoint.trained.get(partition, 0)
    if restored < expected:
        found = f"the newest it read is of round {int(restored)}" if restored else "none"
        return (
            f"no snapshot of round {expected} or later, the last it trained in ({found}): "
            "it would start again from an older state"
        )
    return None
