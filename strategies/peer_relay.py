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
``final_test`` measures communication accuracy (``strategies.communication``). Bytes
are counted from the arrays of every training exchange.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterable

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid

from fedpers import protocol, records, sheaf
from fedpers.config import RunConfig
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import SheafVariant
from fedpers.strategies import screening
from fedpers.strategies.base import FedpersStrategy, mean_metrics
from fedpers.strategies.communication import communication_test

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
    whitening_modes : tuple of sheaf_family.Whitening
        Whitenings under which communication accuracy is measured at the end:
        ``pilots`` (Sheaf-FRL's) and/or ``train`` (the paper's baseline).
    """

    cooperative = True
    whitening_modes: tuple[sheaf_family.Whitening, ...] = (sheaf_family.Whitening.PILOTS,)

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.edges = sheaf_family.run_graph(run)
        self.variant = sheaf_family.settings(run).sheaf_variant
        self.timeout = run.round_timeout
        self.agents = list(range(run.num_clients))
        self.dims = [spec.latent for spec in sheaf_family.run_agent_specs(run)]
        self.pilot_count = 0  # rows of a pilot matrix: what most agents send, first time
        self.neighbours = {i: sheaf.neighbours(self.edges, i) for i in self.agents}
        self.bytes_sent: dict[int, int] = {}
        self._relay_rejections: dict[int, list[str]] = {}  # by round
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
        *,
        vote: bool = True,
    ) -> dict[int, dict[str, np.ndarray]]:
        """Send each agent its content; return the decoded arrays of every agent whose
        reply is what ``expected(agent)`` says, whitened as pilots are (``screening.
        pilots_defect``). An agent that fails, or sends anything else, is recorded as
        the round's rejection and its neighbours get nothing from it this round; bytes
        of everything exchanged are counted. With ``vote`` the first exchange sets the
        number of pilots (``_agreed_rows``); exchanges without pilots pass False."""
        exchange = self.federation.exchange(grid, message_type, contents, timeout=self.timeout)
        for record in [*contents.values(), *exchange.ok().values()]:
            for arrays in record.array_records.values():
                self._count(server_round, arrays.count_bytes())
        if vote and not self.pilot_count:
            self.pilot_count = _agreed_rows(exchange.ok().values(), asked=len(contents))
            if not self.pilot_count:
                no_vote = (
                    f"{message_type}: no majority of the {len(contents)} agents asked agrees "
                    "on the number of pilots; no pilots are relayed this round"
                )
                logger.warning("round %d: %s", server_round, no_vote)
                self._relay_rejections.setdefault(server_round, []).append(no_vote)
        good: dict[int, dict[str, np.ndarray]] = {}
        for agent, reply in exchange.replies.items():
            relayed = functools.partial(self._relay_defect, expected=expected(agent))
            reason = screening.first_defect(reply, [screening.defect, relayed])
            if reason is not None:
                self._reject(server_round, agent, f"{message_type}: {reason}")
                continue
            good[agent] = screening.arrays_of(reply)
        for agent in sorted(set(exchange.failures) - set(exchange.replies)):
            self._reject(server_round, agent, f"{message_type}: {exchange.failures[agent]}")
        return good

    def _reject(self, server_round: int, agent: int, reason: str) -> None:
        logger.warning(
            "round %d: left out the reply of partition %d: %s", server_round, agent, reason
        )
        self._relay_rejections.setdefault(server_round, []).append(f"partition {agent}: {reason}")

    def configure_train_rejections(self, server_round: int) -> tuple[str, ...]:
        """The relay's answers left out this round, with why (the loop records them
        first, before the TRAIN exchange's)."""
        return tuple(self._relay_rejections.get(server_round, ()))

    def _relay_defect(self, reply: Message, expected: dict[str, screening.ArraySpec]) -> str | None:
        returned = reply.content.array_records.get(protocol.ARRAYS, ArrayRecord())
        if reason := screening.arrays_defect(returned, expected):
            return reason
        for name, values in screening.arrays_of(reply).items():
            kind, _ = sheaf_family.agent_of(name) if "." in name else (name, -1)
            if kind == sheaf_family.MAP:
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
                {k: Array(records.contiguous(v)) for k, v in relayed.get(agent, {}).items()}
            )
            self._count(server_round, record.count_bytes())
            contents[agent] = RecordDict(
                {protocol.ARRAYS: record, protocol.CONFIG: ConfigRecord(dict(config))}
            )
        return contents

    def _relay(
        self, server_round: int, config: ConfigRecord, grid: Grid
    ) -> dict[int, dict[str, np.ndarray]]:
        """What each agent receives with its TRAIN message (only what passed
        screening), as the variant relays it."""
        if self.variant == SheafVariant.HETEROGENEOUS:
            return self._relay_heterogeneous(server_round, config, grid)
        if self.variant == SheafVariant.HOMOGENEOUS:
            return self._relay_homogeneous(server_round, config, grid)
        return self._relay_private(server_round, grid)

    def _ask(
        self,
        message_type: str,
        server_round: int,
        config: ConfigRecord,
        grid: Grid,
        agents: list[int],
        expected: Callable[[int], dict[str, screening.ArraySpec]],
        *,
        vote: bool = True,
    ) -> dict[int, dict[str, np.ndarray]]:
        """A relay query with the round's config to ``agents``: the decoded answers of
        those that pass (``_exchange``)."""
        asked = {p: RecordDict({protocol.CONFIG: ConfigRecord(dict(config))}) for p in agents}
        return self._exchange(grid, message_type, asked, server_round, expected, vote=vote)

    def _ask_pilots(
        self, server_round: int, config: ConfigRecord, grid: Grid, agents: list[int]
    ) -> dict[int, dict[str, np.ndarray]]:
        """``query.pilots`` to ``agents``: the whitened pilots of those that pass."""
        return self._ask(
            sheaf_family.QUERY_PILOTS, server_round, config, grid, agents, self._own_pilots
        )

    def _own_pilots(self, agent: int) -> dict[str, screening.ArraySpec]:
        return {sheaf_family.PILOTS: self._pilots_spec(agent)}

    def _relay_heterogeneous(
        self, server_round: int, config: ConfigRecord, grid: Grid
    ) -> dict[int, dict[str, np.ndarray]]:
        """Every agent's raw whitened pilots to each of its neighbours, which fit the
        edge's map themselves."""
        pilots = self._ask_pilots(server_round, config, grid, self.agents)
        return {
            i: {
                sheaf_family.from_agent(sheaf_family.PILOTS, j): pilots[j][sheaf_family.PILOTS]
                for j in self.neighbours[i]
                if j in pilots
            }
            for i in self.agents
        }

    def _relay_homogeneous(
        self, server_round: int, config: ConfigRecord, grid: Grid
    ) -> dict[int, dict[str, np.ndarray]]:
        """The targets' pilots to each edge's source, which computes the edge's map
        (``query.maps``); the map and the source's transported pilots go to the target."""
        pilots = self._ask_pilots(server_round, config, grid, sorted({b for _, b in self.edges}))
        owned = {
            a: [b for x, b in self.edges if x == a and b in pilots]
            for a in sorted({a for a, _ in self.edges})
        }
        asked = {a: _pilots_of(server_round, pilots, targets) for a, targets in owned.items()}
        expected = functools.partial(self._maps_spec, owned)
        maps = self._exchange(grid, sheaf_family.QUERY_MAPS, asked, server_round, expected)
        relayed: dict[int, dict[str, np.ndarray]] = {i: {} for i in self.agents}
        for a, b in self.edges:
            if a not in maps or b not in owned.get(a, []):
                continue
            for kind in (sheaf_family.TRANSPORTED, sheaf_family.MAP):
                relayed[b][sheaf_family.from_agent(kind, a)] = maps[a][
                    sheaf_family.from_agent(kind, b)
                ]
        return relayed

    def _maps_spec(self, owned: dict[int, list[int]], owner: int) -> dict[str, screening.ArraySpec]:
        """What ``owner`` answers ``query.maps``: for each edge it owns, its pilots
        transported to the target and the edge's map."""
        d = self.dims[owner]
        expected: dict[str, screening.ArraySpec] = {}
        for b in owned[owner]:
            expected[sheaf_family.from_agent(sheaf_family.TRANSPORTED, b)] = (
                (self.pilot_count, d),
                "float64",
            )
            expected[sheaf_family.from_agent(sheaf_family.MAP, b)] = ((d, d), "float64")
        return expected

    def _relay_private(self, server_round: int, grid: Grid) -> dict[int, dict[str, np.ndarray]]:
        """Each agent's pilots transported into each neighbour's frame with its own
        current maps (``query.transport``): the relay never sees an agent's own
        coordinates."""
        asked = {
            p: RecordDict(
                {
                    protocol.CONFIG: ConfigRecord({protocol.ROUND: server_round}),
                    protocol.ARRAYS: ArrayRecord(
                        {
                            sheaf_family.NEIGHBOURS: Array(
                                np.array(self.neighbours[p], dtype=np.int64)
                            )
                        }
                    ),
                }
            )
            for p in self.agents
        }
        sent = self._exchange(
            grid, sheaf_family.QUERY_TRANSPORT, asked, server_round, self._transported_spec
        )
        return {
            j: {
                sheaf_family.from_agent(sheaf_family.TRANSPORTED, i): sent[i][
                    sheaf_family.from_agent(sheaf_family.TRANSPORTED, j)
                ]
                for i in self.neighbours[j]
                if i in sent
            }
            for j in self.agents
        }

    def _transported_spec(self, agent: int) -> dict[str, screening.ArraySpec]:
        return {
            sheaf_family.from_agent(sheaf_family.TRANSPORTED, j): self._pilots_spec(agent)
            for j in self.neighbours[agent]
        }

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Nothing to aggregate but metrics (agents return no arrays)."""
        valid = self._count_replies(server_round, replies)
        return None, mean_metrics([r.content for r in valid])

    def _count_replies(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The replies, their arrays' bytes added to the round's count."""
        valid = list(replies)
        for reply in valid:
            for arrays in reply.content.array_records.values():
                self._count(server_round, arrays.count_bytes())
        return valid

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Mean private accuracy over agents (each reply weighs 1); keeps per-agent values
        of the replies that pass ``screen_evaluate``. The loop passes only those; the
        screen is repeated here (idempotent: a capped weight is within its bound) so
        that a direct caller cannot skip it, and only once."""
        replies = list(self.screen_evaluate(server_round, replies).kept)
        for reply in replies:
            accuracy = reply.content.metric_records[protocol.METRICS].get(protocol.ACCURACY)
            if accuracy is not None:
                self.private_accuracy[self.federation.partition(reply)] = records.number(accuracy)
        return mean_metrics([r.content for r in replies])

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
    ) -> sheaf_family.CommunicationTest:
        """Communication accuracy of every directed edge, per whitening mode
        (``strategies.communication``)."""
        return communication_test(
            self.federation,
            grid,
            self.neighbours,
            self.whitening_modes,
            self.private_accuracy,
            server_round=server_round,
            timeout=timeout,
        )


class NonCooperative(PeerRelay):
    """Sheaf-FRL's lambda = 0 baseline: nothing exchanged while training; aligned after
    training, whitened on the training latents (the paper's) or on the pilots."""

    cooperative = False
    whitening_modes = (sheaf_family.Whitening.TRAIN, sheaf_family.Whitening.PILOTS)


def _agreed_rows(contents: Iterable[RecordDict], *, asked: int) -> int:
    """The number of pilots, as a strict majority of the ``asked`` agents give it, or 0.

    Each agent votes once: with the row count its pilot-like arrays (maps excluded) all
    share; an agent whose arrays disagree, or that sent none, does not vote. One agent
    sending many arrays has one vote, so no minority sets the count, for good, that
    every honest agent would then be rejected by.
    """
    votes: Counter[int] = Counter()
    for content in contents:
        rows = {
            array.shape[0]
            for name, array in content.array_records.get(protocol.ARRAYS, ArrayRecord()).items()
            if len(array.shape) == 2 and not name.startswith(sheaf_family.MAP + ".")
        }
        if len(rows) == 1:
            votes[rows.pop()] += 1
    if not votes:
        return 0
    count, agents = votes.most_common(1)[0]
    return count if 2 * agents > asked else 0


def _pilots_of(
    server_round: int, pilots: dict[int, dict[str, np.ndarray]], targets: list[int]
) -> RecordDict:
    """A ``query.maps`` message: the pilots of the edges' ``targets``."""
    return RecordDict(
        {
            protocol.CONFIG: ConfigRecord({protocol.ROUND: server_round}),
            protocol.ARRAYS: ArrayRecord(
                {
                    sheaf_family.from_agent(sheaf_family.PILOTS, b): Array(
                        pilots[b][sheaf_family.PILOTS]
                    )
                    for b in targets
                }
            ),
        }
    )
