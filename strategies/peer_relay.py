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

import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterable

import numpy as np
from fedpers.strategies import screening
from fedpers.strategies.base import FedpersStrategy, _mean_metrics
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
        self.dims = [spec.latent for spec in run.agent_specs()]
        self.pilot_count = 0  # rows of a pilot matrix: what most agents send, first time
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
        expected: Callable[[int], dict[str, screening.ArraySpec]],
    ) -> dict[int, dict[str, np.ndarray]]:
        """Send each agent its content; return the decoded arrays of every agent whose
        reply is what ``expected(agent)`` says, whitened as pilots are (``screening.
        pilots_defect``). An agent that fails, or sends anything else, is recorded as
        the round's rejection and its neighbours get nothing from it this round; bytes
        of everything exchanged are counted."""
        exchange = self.federation.exchange(grid, message_type, contents, timeout=self.timeout)
        for record in [*contents.values(), *exchange.ok().values()]:
            for arrays in record.array_records.values():
                self._count(server_round, arrays.count_bytes())
        if not self.pilot_count:
            self.pilot_count = _most_common_rows(exchange.ok().values())
        good: dict[int, dict[str, np.ndarray]] = {}
        for agent, reply in exchange.replies.items():
            relayed = functools.partial(self._relay_defect, expected=expected(agent))
            reason = screening.first_defect(reply, [screening.defect, relayed])
            if reason is not None:
                self.reject(server_round, agent, f"{message_type}: {reason}")
                continue
            good[agent] = screening.arrays_of(reply)
        for agent in sorted(set(exchange.failures) - set(exchange.replies)):
            self.reject(server_round, agent, f"{message_type}: {exchange.failures[agent]}")
        return good

    def _relay_defect(self, reply: Message, expected: dict[str, screening.ArraySpec]) -> str | None:
        returned = reply.content.array_records.get(protocol.ARRAYS, ArrayRecord())
        if reason := screening.arrays_defect(returned, expected):
            return reason
        for name, values in screening.arrays_of(reply).items():
            kind, _ = protocol.agent_of(name) if "." in name else (name, -1)
            if kind == protocol.MAP:
                reason = screening.orthonormal_defect(name, values)
            else:
                reason = screening.pilots_defect(name, values)
            if reason is not None:
                return reason
        return None

    def _pilots_spec(self, agent: int) -> screening.ArraySpec:
        return (self.pilot_count, self.dims[agent]), "float64"

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
            record = ArrayRecord(
                {k: Array(np.ascontiguousarray(v)) for k, v in relayed.get(agent, {}).items()}
            )
            self._count(server_round, record.count_bytes())
            contents[agent] = RecordDict(
                {protocol.ARRAYS: record, protocol.CONFIG: ConfigRecord(dict(config))}
            )
        return contents

    def _relay(
        self, server_round: int, config: ConfigRecord, grid: Grid
    ) -> dict[int, dict[str, np.ndarray]]:
        """What each agent receives with its TRAIN message (only what passed screening)."""
        everyone = self.agents
        empty = {p: RecordDict({protocol.CONFIG: ConfigRecord(dict(config))}) for p in everyone}

        def own_pilots(agent: int) -> dict[str, screening.ArraySpec]:
            return {protocol.PILOTS: self._pilots_spec(agent)}

        if self.variant == SheafVariant.HETEROGENEOUS:
            pilots = self._exchange(grid, protocol.QUERY_PILOTS, empty, server_round, own_pilots)
            return {
                i: {
                    protocol.from_agent(protocol.PILOTS, j): pilots[j][protocol.PILOTS]
                    for j in self.neighbours[i]
                    if j in pilots
                }
                for i in everyone
            }
        if self.variant == SheafVariant.HOMOGENEOUS:
            targets = sorted({b for _, b in self.edges})
            pilots = self._exchange(
                grid,
                protocol.QUERY_PILOTS,
                {p: empty[p] for p in targets},
                server_round,
                own_pilots,
            )
            owned_edges = {
                a: [b for x, b in self.edges if x == a and b in pilots]
                for a in sorted({a for a, _ in self.edges})
            }
            owned = {
                a: RecordDict(
                    {
                        protocol.CONFIG: ConfigRecord({protocol.ROUND: server_round}),
                        protocol.ARRAYS: ArrayRecord(
                            {
                                protocol.from_agent(protocol.PILOTS, b): Array(
                                    pilots[b][protocol.PILOTS]
                                )
                                for b in targets_of_a
                            }
                        ),
                    }
                )
                for a, targets_of_a in owned_edges.items()
            }

            def maps_of(owner: int) -> dict[str, screening.ArraySpec]:
                d = self.dims[owner]
                expected: dict[str, screening.ArraySpec] = {}
                for b in owned_edges[owner]:
                    expected[protocol.from_agent(protocol.TRANSPORTED, b)] = (
                        (self.pilot_count, d),
                        "float64",
                    )
                    expected[protocol.from_agent(protocol.MAP, b)] = ((d, d), "float64")
                return expected

            transported = self._exchange(grid, protocol.QUERY_MAPS, owned, server_round, maps_of)
            out: dict[int, dict[str, np.ndarray]] = {i: {} for i in everyone}
            for a, b in self.edges:
                if a not in transported or b not in owned_edges.get(a, []):
                    continue
                for kind in (protocol.TRANSPORTED, protocol.MAP):
                    out[b][protocol.from_agent(kind, a)] = transported[a][
                        protocol.from_agent(kind, b)
                    ]
            return out
        # private: each agent sends its pilots transported into each neighbour's frame
        contents = {
            p: RecordDict(
                {
                    protocol.CONFIG: ConfigRecord({protocol.ROUND: server_round}),
                    protocol.ARRAYS: ArrayRecord(
                        {protocol.NEIGHBOURS: Array(np.array(self.neighbours[p], dtype=np.int64))}
                    ),
                }
            )
            for p in everyone
        }

        def transported_to(agent: int) -> dict[str, screening.ArraySpec]:
            return {
                protocol.from_agent(protocol.TRANSPORTED, j): self._pilots_spec(agent)
                for j in self.neighbours[agent]
            }

        transported = self._exchange(
            grid, protocol.QUERY_TRANSPORT, contents, server_round, transported_to
        )
        return {
            j: {
                protocol.from_agent(protocol.TRANSPORTED, i): transported[i][
                    protocol.from_agent(protocol.TRANSPORTED, j)
                ]
                for i in self.neighbours[j]
                if i in transported
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
            shared = self._latents(grid, ask, timeout)
            tests = {}
            for receiver in self.agents:
                relayed = {}
                for sender in (j for j in self.neighbours[receiver] if j in shared):
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

    def _latents(
        self, grid: Grid, ask: dict[int, RecordDict], timeout: float
    ) -> dict[int, RecordDict]:
        """Every agent's whitened pilots and test latents (``query.latents``), of the
        agents whose reply passes screening; the others are left out of the test."""
        exchange = self.federation.exchange(grid, protocol.QUERY_LATENTS, ask, timeout=timeout)
        good = {}
        for agent, reply in exchange.replies.items():
            reason = screening.first_defect(reply, [screening.defect, self._latents_defect])
            if reason is None:
                good[agent] = reply.content
            else:
                logger.warning("communication test leaves agent %d out: %s", agent, reason)
        return good

    def _latents_defect(self, reply: Message) -> str | None:
        arrays = screening.arrays_of(reply)
        names = {protocol.PILOTS, protocol.LATENTS, protocol.LABELS}
        if set(arrays) != names:
            return f"arrays {sorted(arrays)}, expected {sorted(names)}"
        pilots, latents = arrays[protocol.PILOTS], arrays[protocol.LATENTS]
        if pilots.ndim != 2 or latents.ndim != 2 or pilots.shape[1] != latents.shape[1]:
            return "pilots and latents are not matrices of one width"
        if arrays[protocol.LABELS].shape != (len(latents),):
            return "latents and labels do not match"
        return None


class NonCooperative(PeerRelay):
    """Sheaf-FRL's lambda = 0 baseline: nothing exchanged while training; aligned after
    training, whitened on the training latents (the paper's) or on the pilots."""

    cooperative = False
    whitening_modes = (Whitening.TRAIN, Whitening.PILOTS)


def _most_common_rows(contents: Iterable[RecordDict]) -> int:
    """The row count most pilot-like arrays declare (maps excluded): the number of
    pilots, which every honest agent shares."""
    rows = [
        array.shape[0]
        for content in contents
        for name, array in content.array_records.get(protocol.ARRAYS, ArrayRecord()).items()
        if len(array.shape) == 2 and not name.startswith(protocol.MAP + ".")
    ]
    return Counter(rows).most_common(1)[0][0] if rows else 0
