"""Peer relay for Sheaf-FRL (2026): the server holds no model and only relays pilots.

Each round it gathers every agent's pilot matrix (``query.pilots``) and sends each agent
exactly its graph neighbours' matrices with ``train``; agents refit their incident
restriction maps and train locally. It never sees a model parameter. Variants (run-config
key ``sheaf-variant``):

- ``heterogeneous`` (default): raw whitened pilots go to neighbours and both endpoints of
  an edge compute its map (from the same two matrices, hence the same map);
- ``homogeneous`` (equal latent dimensions): the edge's source computes its one SVD
  (``query.maps``) and its pilots travel already transported to the target;
- ``private`` (equal latent dimensions): agents only send pilots transported into each
  neighbour's coordinates with their current maps (``query.transport``); the relay
  never sees an agent's own coordinates.

``non-cooperative`` (lambda = 0) exchanges nothing while training. After the last round
``final_evaluation`` measures communication accuracy: every agent's whitened test
latents go to its neighbours, which transport them with the Procrustes map fitted on the
same pilots and decode them with their own heads. Bytes are counted from the arrays of
every training exchange.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid

from fedpers import protocol, sheaf
from fedpers.config import RunConfig, SheafVariant
from fedpers.protocol import CommunicationTest, Whitening
from strategies.base import FedpersStrategy, _mean_metrics

logger = logging.getLogger(__name__)


class PeerRelay(FedpersStrategy):
    """Relay pilots between graph neighbours; every agent trains every round.

    Reads the graph (``num-clients``, ``sheaf-density``, ``seed``: the same graph on
    every party), ``sheaf-variant`` and ``round-timeout`` besides what
    ``FedpersStrategy`` reads.

    Attributes
    ----------
    cooperative : bool
        False for the lambda = 0 baseline (``NonCooperative``): no pilots are
        exchanged while training.
    whitening_modes : tuple of Whitening
        Whitenings under which communication accuracy is measured at the end:
        ``pilots`` (Sheaf-FRL's) and/or ``train`` (the paper's baseline).
    """

    cooperative = True
    whitening_modes: tuple[Whitening, ...] = (Whitening.PILOTS,)

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.edges = run.sheaf_graph()
        self.variant = run.sheaf_variant
        self.timeout = run.round_timeout
        self.agents = list(range(run.num_clients))
        self.neighbours = {i: sheaf.neighbours(self.edges, i) for i in self.agents}
        self.bytes_sent: dict[int, int] = {}
        self.private_accuracy: dict[int, float] = {}

    def sample(self, server_round: int) -> list[int]:
        """Every agent, every round."""
        return self.agents

    # --------------------------------------------------------------- exchanges
    def _exchange(
        self,
        grid: Grid,
        message_type: str,
        contents: dict[int, RecordDict],
        server_round: int,
    ) -> dict[int, ArrayRecord]:
        """Send each agent its content, return each agent's reply arrays; count bytes.
        Every agent must answer."""
        replies = self.federation.exchange(
            grid, message_type, contents, timeout=self.timeout
        ).require_all()
        for record in [*contents.values(), *replies.values()]:
            for arrays in record.array_records.values():
                self._count(server_round, arrays.count_bytes())
        return {p: r.array_records.get(protocol.ARRAYS, ArrayRecord()) for p, r in replies.items()}

    def _count(self, server_round: int, count: int) -> None:
        self.bytes_sent[server_round] = self.bytes_sent.get(server_round, 0) + count

    # ------------------------------------------------------------------- hooks
    def initial_arrays(self, grid: Grid, *, timeout: float) -> ArrayRecord:
        """No model is shared: the global arrays stay empty."""
        return ArrayRecord()

    def train_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> dict[int, RecordDict]:
        """Gather and relay pilots (as the variant says); TRAIN every agent with what
        its neighbours sent."""
        config[protocol.ROUND] = server_round
        relayed = self._relay(server_round, config, grid) if self.cooperative else {}
        contents = {}
        for agent in self.agents:
            record = ArrayRecord(relayed.get(agent, {}))
            self._count(server_round, record.count_bytes())
            contents[agent] = RecordDict(
                {protocol.ARRAYS: record, protocol.CONFIG: ConfigRecord(dict(config))}
            )
        return contents

    def _relay(
        self, server_round: int, config: ConfigRecord, grid: Grid
    ) -> dict[int, dict[str, Array]]:
        """What each agent receives with its TRAIN message."""
        everyone = self.agents
        empty = {p: RecordDict({protocol.CONFIG: ConfigRecord(dict(config))}) for p in everyone}
        if self.variant == SheafVariant.HETEROGENEOUS:
            pilots = self._exchange(grid, protocol.QUERY_PILOTS, empty, server_round)
            return {
                i: {
                    protocol.from_agent(protocol.PILOTS, j): pilots[j][protocol.PILOTS]
                    for j in self.neighbours[i]
                }
                for i in everyone
            }
        if self.variant == SheafVariant.HOMOGENEOUS:
            targets = sorted({b for _, b in self.edges})
            pilots = self._exchange(
                grid, protocol.QUERY_PILOTS, {p: empty[p] for p in targets}, server_round
            )
            owners = sorted({a for a, _ in self.edges})
            owned = {
                a: RecordDict(
                    {
                        protocol.ARRAYS: ArrayRecord(
                            {
                                protocol.from_agent(protocol.PILOTS, b): pilots[b][protocol.PILOTS]
                                for x, b in self.edges
                                if x == a
                            }
                        )
                    }
                )
                for a in owners
            }
            transported = self._exchange(grid, protocol.QUERY_MAPS, owned, server_round)
            out: dict[int, dict[str, Array]] = {i: {} for i in everyone}
            for a, b in self.edges:
                for kind in (protocol.TRANSPORTED, protocol.MAP):
                    out[b][protocol.from_agent(kind, a)] = transported[a][
                        protocol.from_agent(kind, b)
                    ]
            return out
        # private: each agent sends its pilots transported into each neighbour's frame
        contents = {
            p: RecordDict(
                {
                    protocol.ARRAYS: ArrayRecord(
                        {protocol.NEIGHBOURS: Array(np.array(self.neighbours[p], dtype=np.int64))}
                    )
                }
            )
            for p in everyone
        }
        transported = self._exchange(grid, protocol.QUERY_TRANSPORT, contents, server_round)
        return {
            j: {
                protocol.from_agent(protocol.TRANSPORTED, i): transported[i][
                    protocol.from_agent(protocol.TRANSPORTED, j)
                ]
                for i in self.neighbours[j]
            }
            for j in everyone
        }

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Nothing to aggregate but metrics (agents return no arrays)."""
        valid = self.screen(server_round, replies)
        for reply in valid:
            for arrays in reply.content.array_records.values():
                self._count(server_round, arrays.count_bytes())
        return None, _mean_metrics([r.content for r in valid])

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Mean private accuracy over agents (each reply weighs 1); keeps per-agent values."""
        replies = list(replies)
        for reply in replies:
            if not reply.has_error():
                accuracy = reply.content.metric_records[protocol.METRICS][protocol.ACCURACY]
                self.private_accuracy[self.federation.partition(reply)] = float(accuracy)  # type: ignore[arg-type]
        return super().aggregate_evaluate(server_round, replies)

    def round_metrics(self, server_round: int) -> dict[str, float]:
        """Bytes of the round's training exchanges (both directions)."""
        return {"bytes": float(self.bytes_sent.get(server_round, 0))}

    # -------------------------------------------------------------- final test
    def final_test(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        config: ConfigRecord,
        *,
        server_round: int,
        timeout: float,
    ) -> CommunicationTest:
        """Communication accuracy of every directed edge, per whitening mode."""
        result = CommunicationTest(private=dict(self.private_accuracy))
        for mode in self.whitening_modes:
            mode_config = ConfigRecord(
                {protocol.WHITENING: mode.value, protocol.ROUND: server_round}
            )
            ask = {p: RecordDict({protocol.CONFIG: mode_config}) for p in self.agents}
            shared = self.federation.exchange(
                grid, protocol.QUERY_LATENTS, ask, timeout=timeout
            ).require_all()
            tests = {}
            for receiver in self.agents:
                relayed = {}
                for sender in self.neighbours[receiver]:
                    sent = shared[sender].array_records[protocol.ARRAYS]
                    for name in (protocol.PILOTS, protocol.LATENTS, protocol.LABELS):
                        relayed[protocol.from_agent(name, sender)] = sent[name]
                config_record = ConfigRecord(
                    {
                        protocol.WHITENING: mode.value,
                        protocol.COMMUNICATION: 1,
                        protocol.ROUND: server_round,
                    }
                )
                tests[receiver] = RecordDict(
                    {protocol.ARRAYS: ArrayRecord(relayed), protocol.CONFIG: config_record}
                )
            exchange = self.federation.exchange(grid, MessageType.EVALUATE, tests, timeout=timeout)
            for agent, reason in sorted(exchange.failures.items()):
                logger.warning("communication test of agent %d failed: %s", agent, reason)
            edges: dict[tuple[int, int], float] = {}
            per_receiver = []
            for receiver, content in exchange.ok().items():
                values = content.metric_records[protocol.METRICS]
                for key, value in values.items():
                    if (source := protocol.edge_sender(key)) is not None:
                        edges[(source, receiver)] = float(value)  # type: ignore[arg-type]
                if np.isfinite(float(values[protocol.ACCURACY])):  # type: ignore[arg-type]
                    per_receiver.append(float(values[protocol.ACCURACY]))  # type: ignore[arg-type]
            result.edges[mode.value] = edges
            result.by_whitening[mode.value] = (
                float(np.mean(per_receiver)) if per_receiver else float("nan")
            )
        return result


class NonCooperative(PeerRelay):
    """Sheaf-FRL's lambda = 0 baseline: nothing exchanged while training; aligned after
    training, whitened on the training latents (the paper's) or on the pilots."""

    cooperative = False
    whitening_modes = (Whitening.TRAIN, Whitening.PILOTS)
