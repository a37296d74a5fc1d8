"""Communication accuracy: Sheaf-FRL's test after the last round.

Every agent's whitened pilots and test latents (``query.latents``) go to its graph
neighbours, which transport them with the Procrustes map fitted on the same pilots and
decode them with their own heads (an EVALUATE with ``communication = 1``). Measured per
whitening: ``pilots`` (Sheaf-FRL's) and ``train`` (the non-cooperative baseline's,
whitened on the training latents). An agent whose latents fail screening is left out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedpers import protocol, records
from fedpers.families import sheaf as sheaf_family
from fedpers.strategies import screening
from fedpers.strategies.federation import Exchange, Federation

logger = logging.getLogger(__name__)


def communication_test(
    federation: Federation,
    grid: Grid,
    neighbours: Mapping[int, list[int]],
    modes: Iterable[sheaf_family.Whitening],
    private: Mapping[int, float],
    *,
    server_round: int,
    timeout: float,
) -> sheaf_family.CommunicationTest:
    """Communication accuracy of every directed edge, per whitening in ``modes``.

    Parameters
    ----------
    federation : Federation
        The partition map and the exchange.
    grid : Grid
        Flower's grid.
    neighbours : mapping of int to list of int
        Every agent (a key) and its graph neighbours.
    modes : iterable of Whitening
        The whitenings to measure under.
    private : mapping of int to float
        Every agent's last private accuracy, kept in the result.
    server_round, timeout : int, float
        The round the messages carry, and the seconds to wait for each exchange.
    """
    result = sheaf_family.CommunicationTest(private=dict(private))
    for mode in modes:
        ask_config = ConfigRecord(
            {sheaf_family.WHITENING: mode.value, protocol.ROUND: server_round}
        )
        ask = {p: RecordDict({protocol.CONFIG: ask_config}) for p in neighbours}
        shared = _latents(federation, grid, ask, timeout)
        tests = {
            receiver: _test(receiver, neighbours, shared, mode, server_round)
            for receiver in neighbours
        }
        exchange = federation.exchange(grid, MessageType.EVALUATE, tests, timeout=timeout)
        for agent, reason in sorted(exchange.failures.items()):
            logger.warning("communication test of agent %d failed: %s", agent, reason)
        result.edges[mode.value], result.by_whitening[mode.value] = _accuracies(exchange)
    return result


def _test(
    receiver: int,
    neighbours: Mapping[int, list[int]],
    shared: Mapping[int, RecordDict],
    mode: sheaf_family.Whitening,
    server_round: int,
) -> RecordDict:
    """The EVALUATE content of ``receiver``: what each neighbour shared, by sender."""
    relayed = {}
    for sender in (j for j in neighbours[receiver] if j in shared):
        sent = shared[sender].array_records[protocol.ARRAYS]
        for name in (sheaf_family.PILOTS, sheaf_family.LATENTS, sheaf_family.LABELS):
            relayed[sheaf_family.from_agent(name, sender)] = sent[name]
    config = ConfigRecord(
        {
            sheaf_family.WHITENING: mode.value,
            sheaf_family.COMMUNICATION: 1,
            protocol.ROUND: server_round,
        }
    )
    return RecordDict({protocol.ARRAYS: ArrayRecord(relayed), protocol.CONFIG: config})


def _accuracies(exchange: Exchange) -> tuple[dict[tuple[int, int], float], float]:
    """Accuracy of every directed edge ``(sender, receiver)``, and the mean over the
    receivers of their accuracy, from the replies that pass ``screening.defect`` (an
    agent with no neighbour to decode reports a NaN accuracy and no edge: left out)."""
    edges: dict[tuple[int, int], float] = {}
    per_receiver = []
    for receiver, reply in exchange.replies.items():
        if (reason := screening.defect(reply)) is not None:
            if not reply.has_error():
                logger.warning("communication test leaves agent %d out: %s", receiver, reason)
            continue
        values = reply.content.metric_records.get(protocol.METRICS, MetricRecord())
        for key, value in values.items():
            if (source := sheaf_family.edge_sender(key)) is not None:
                edges[(source, receiver)] = records.number(value, key)
        if protocol.ACCURACY in values:
            per_receiver.append(records.number(values[protocol.ACCURACY], protocol.ACCURACY))
    return edges, float(np.mean(per_receiver)) if per_receiver else float("nan")


def _latents(
    federation: Federation, grid: Grid, ask: dict[int, RecordDict], timeout: float
) -> dict[int, RecordDict]:
    """Every agent's whitened pilots and test latents (``query.latents``), of the
    agents whose reply passes screening; the others are left out of the test."""
    exchange = federation.exchange(grid, sheaf_family.QUERY_LATENTS, ask, timeout=timeout)
    good = {}
    for agent, reply in exchange.replies.items():
        reason = screening.first_defect(reply, [screening.defect, _latents_defect])
        if reason is None:
            good[agent] = reply.content
        else:
            logger.warning("communication test leaves agent %d out: %s", agent, reason)
    return good


def _latents_defect(reply: Message) -> str | None:
    """Why a ``query.latents`` answer is not pilots, latents of one width and their
    labels, or None."""
    arrays = screening.arrays_of(reply)
    names = {sheaf_family.PILOTS, sheaf_family.LATENTS, sheaf_family.LABELS}
    if set(arrays) != names:
        return f"arrays {sorted(arrays)}, expected {sorted(names)}"
    pilots, latents = arrays[sheaf_family.PILOTS], arrays[sheaf_family.LATENTS]
    if pilots.ndim != 2 or latents.ndim != 2 or pilots.shape[1] != latents.shape[1]:
        return "pilots and latents are not matrices of one width"
    if arrays[sheaf_family.LABELS].shape != (len(latents),):
        return "latents and labels do not match"
    return None
