"""Sheaf-FMTL's relay (Ben Issaid et al. 2025; the agents are
``fedpers/algorithms/sheaf_fmtl.py``):
the server holds nothing and forwards, each round, every agent's ``P_ij theta_i`` to
neighbour ``j`` with its ``train`` message.

It asks every agent for its projections (``query.projections``); a reply must hold
exactly one float32 vector ``projection.<j>`` of the edge's interaction dimension
``d_ij`` (``fedpers.algorithms.sheaf_fmtl.interaction_dims``, computed here from the agents'
architectures) per neighbour, finite; anything else leaves the agent out of the round's
relay, and its neighbours train without its term. How far a received vector can move
an agent is bounded on the agent (``sheaf-clip``). After the last round the agents are
aligned and their communication accuracy measured (``PeerRelay.final_test``), whitened
on their training latents as the paper's baselines are and on the pilots as Sheaf-FRL
is.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from fedpers import protocol
from fedpers.algorithms.sheaf_fmtl import interaction_dims
from fedpers.config import RunConfig
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import PROJECTION
from fedpers.strategies import screening
from fedpers.strategies.peer_relay import PeerRelay


class SheafFMTL(PeerRelay):
    """Relay each agent's projections ``P_ij theta_i`` to its neighbours."""

    whitening_modes = (sheaf_family.Whitening.TRAIN, sheaf_family.Whitening.PILOTS)

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.edge_dims = interaction_dims(run)

    def _relay(
        self, server_round: int, config: ConfigRecord, grid: Grid
    ) -> dict[int, dict[str, np.ndarray]]:
        """Every agent's projection for ``j``, to ``j``, keyed by its sender."""
        sent = self._ask(
            sheaf_family.QUERY_PROJECTIONS,
            server_round,
            config,
            grid,
            self.agents,
            self._projections_spec,
            vote=False,
        )
        return {
            j: {
                sheaf_family.from_agent(PROJECTION, i): sent[i][
                    sheaf_family.from_agent(PROJECTION, j)
                ]
                for i in self.neighbours[j]
                if i in sent
            }
            for j in self.agents
        }

    def _projections_spec(self, agent: int) -> dict[str, screening.ArraySpec]:
        return {
            sheaf_family.from_agent(PROJECTION, j): ((self.edge_dims[agent, j],), "float32")
            for j in self.neighbours[agent]
        }

    def _relay_defect(self, reply: Message, expected: dict[str, screening.ArraySpec]) -> str | None:
        """Exactly the expected vectors (their values are finite: ``screening.decode``)."""
        returned = reply.content.array_records.get(protocol.ARRAYS, ArrayRecord())
        return screening.arrays_defect(returned, expected)
