"""CoMFed's relay (Badi, Ben Issaid and Bennis 2026; the agents are
``fedpers/algorithms/comfed.py``):
the server holds nothing and forwards, each round, every agent's projected class
prototypes and their counts to its graph neighbours.

It asks every agent (``query.prototypes``) for one float32 matrix ``prototypes``
(classes x ``comfed-dim``) and one float64 vector ``prototype-counts`` of non-negative
whole numbers; anything else, or non-finite values, leaves the agent out of the round's
relay. A neighbour's prototypes are targets the agent is pulled toward: how far one
round can move it is bounded on the agent (``sheaf-clip`` on each step), whatever they
hold. After the last round communication accuracy is measured through the agents'
learned maps (whitening mode ``projection``: ``pinv(P_j) P_i z``, the paper's) and, as
for the other baselines, aligned on the pilots.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from fedpers import protocol
from fedpers.algorithms.comfed import comfed_dim
from fedpers.config import RunConfig
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import PROTOTYPE_COUNTS, PROTOTYPES
from fedpers.strategies import screening
from fedpers.strategies.peer_relay import PeerRelay


class ComFed(PeerRelay):
    """Relay each agent's projected class prototypes to its neighbours."""

    whitening_modes = (sheaf_family.Whitening.PROJECTION, sheaf_family.Whitening.PILOTS)

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.shape = (run.num_classes, comfed_dim(run))

    def _relay(
        self, server_round: int, config: ConfigRecord, grid: Grid
    ) -> dict[int, dict[str, np.ndarray]]:
        sent = self._ask(
            sheaf_family.QUERY_PROTOTYPES,
            server_round,
            config,
            grid,
            self.agents,
            self._prototypes_spec,
            vote=False,
        )
        return {
            i: {
                sheaf_family.from_agent(name, j): sent[j][name]
                for j in self.neighbours[i]
                if j in sent
                for name in (PROTOTYPES, PROTOTYPE_COUNTS)
            }
            for i in self.agents
        }

    def _prototypes_spec(self, agent: int) -> dict[str, screening.ArraySpec]:
        return {
            PROTOTYPES: (self.shape, "float32"),
            PROTOTYPE_COUNTS: ((self.shape[0],), "float64"),
        }

    def _relay_defect(self, reply: Message, expected: dict[str, screening.ArraySpec]) -> str | None:
        """The expected arrays; counts non-negative whole numbers."""
        returned = reply.content.array_records.get(protocol.ARRAYS, ArrayRecord())
        if reason := screening.arrays_defect(returned, expected):
            return reason
        counts = screening.arrays_of(reply)[PROTOTYPE_COUNTS]
        if np.any(counts < 0) or np.any(counts != np.round(counts)):
            return "prototype counts are not non-negative whole numbers"
        return None
