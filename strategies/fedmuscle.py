"""FedMuscle's relay (Setayesh et al., ICLR 2026; the agents are
``fedpers/algorithms/fedmuscle.py``):
the server holds nothing. Each round it asks every agent for its unit-norm latents of
the round's pilot batch (``query.representations``) and sends each agent, with its
``train`` message, those of M other agents (``fedmuscle-others``, all others if fewer),
drawn from the run's seed, the round and the agent among the agents whose answer
passed.

An answer must be one float32 matrix of the agreed number of pilots (a strict majority
sets it, ``PeerRelay._exchange``) by the latent dimension, every row of norm 1: the
Muscle loss then sees cosines, each similarity bounded by 1 / temperature whatever an
agent sends. Anything else leaves the agent out of the round's relay. After the last
round the agents are aligned and their communication accuracy measured
(``PeerRelay.final_test``), whitened on their training latents as the paper's baselines
are and on the pilots as Sheaf-FRL is.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from fedpers import protocol
from fedpers.algorithms.fedmuscle import FedMuscleSettings
from fedpers.config import RunConfig
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import REPRESENTATIONS
from fedpers.seeding import rng
from fedpers.strategies import screening
from fedpers.strategies.peer_relay import PeerRelay

UNIT = 1e-3  # how far from 1 a row's norm may be (float32 rounding is ~1e-7)


class FedMuscle(PeerRelay):
    """Relay each agent's pilot representations to M others, drawn every round."""

    whitening_modes = (sheaf_family.Whitening.TRAIN, sheaf_family.Whitening.PILOTS)

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.others = run.group(FedMuscleSettings).fedmuscle_others

    def _relay(
        self, server_round: int, config: ConfigRecord, grid: Grid
    ) -> dict[int, dict[str, np.ndarray]]:
        sent = self._ask(
            sheaf_family.QUERY_REPRESENTATIONS,
            server_round,
            config,
            grid,
            self.agents,
            self._representations_spec,
        )
        return {
            n: {
                sheaf_family.from_agent(REPRESENTATIONS, m): sent[m][REPRESENTATIONS]
                for m in self.drawn(server_round, n, sorted(set(sent) - {n}))
            }
            for n in self.agents
        }

    def drawn(self, server_round: int, agent: int, candidates: list[int]) -> list[int]:
        """The M agents (or all candidates, if fewer) whose representations ``agent``
        is sent this round, sorted."""
        if len(candidates) <= self.others:
            return candidates
        chosen = rng(self.run.seed, "fedmuscle-others", server_round, agent).choice(
            len(candidates), self.others, replace=False
        )
        return sorted(candidates[i] for i in chosen)

    def _representations_spec(self, agent: int) -> dict[str, screening.ArraySpec]:
        return {REPRESENTATIONS: ((self.pilot_count, self.dims[agent]), "float32")}

    def _relay_defect(self, reply: Message, expected: dict[str, screening.ArraySpec]) -> str | None:
        """The expected matrix, every row of norm 1."""
        returned = reply.content.array_records.get(protocol.ARRAYS, ArrayRecord())
        if reason := screening.arrays_defect(returned, expected):
            return reason
        values = screening.arrays_of(reply)[REPRESENTATIONS].astype(np.float64)
        norms = np.linalg.norm(values, axis=1)
        if not np.all(np.abs(norms - 1.0) <= UNIT):
            worst = float(norms[np.argmax(np.abs(norms - 1.0))])
            return f"'{REPRESENTATIONS}' has a row of norm {worst:.6g}, not 1"
        return None
