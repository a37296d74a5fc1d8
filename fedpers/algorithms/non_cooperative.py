"""Sheaf-FRL's non-cooperative baseline (Sheaf-FRL, 2026): the same agents trained alone
(lambda = 0), exchanging nothing while training, aligned only after training.

Every agent trains its whole model on its private loss (the sheaf family's ``fit``,
``fedpers.agents_update``); after the last round the agents are aligned on the pilots
and their communication accuracy measured (``strategies/peer_relay.py``'s
``NonCooperative``), whitened on their training latents (the paper's) and on the pilots
(Sheaf-FRL's).
"""

from __future__ import annotations

from fedpers.algorithms import AlgorithmSpec, Family

ROWS = (
    AlgorithmSpec(
        name="non-cooperative",
        family=Family.SHEAF,
        shared=(),
        strategy="fedpers.strategies.peer_relay:NonCooperative",
        paper="Sheaf-FRL's lambda = 0 baseline, aligned after training",
    ),
)
