"""FedRep (Collins, Hassani, Mokhtari and Shakkottai, "Exploiting Shared Representations
for Personalized Federated Learning", ICML 2021, Algorithm 1).

The server averages the representation (the model's ``body``); each client keeps its
head, trains it for ``head-epochs`` with the body frozen, then the body for ``epochs``
with the head frozen (the paper's many head steps, then few body steps), and sends its
body back. The update is the personalized family's with these phases
(``fedpers.families.personalized.fit``).

On the linear tasks (``dataset = "linear"``, the paper's Section 4) the row runs its
linear variant: each client solves its head exactly by least squares and takes one
gradient step on ``B`` (the linear family's update, ``fedpers.families.linear``); the
server averages, then orthonormalizes (``strategies/fedrep.py``).
"""

from __future__ import annotations

from fedpers.algorithms import AlgorithmSpec, Family, LinearVariant, Phase
from fedpers.protocol import BODY, EPOCHS, HEAD, HEAD_EPOCHS

LINEAR = LinearVariant("fedpers.strategies.fedrep:FedRepLinear", "fedpers.families.linear")

ROWS = (
    AlgorithmSpec(
        name="fedrep",
        family=Family.PERSONALIZED,
        shared=(BODY,),
        phases=(Phase((HEAD,), HEAD_EPOCHS), Phase((BODY,), EPOCHS)),
        linear=LINEAR,
        paper="Collins et al., ICML 2021",
    ),
)
