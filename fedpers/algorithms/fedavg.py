"""FedAvg (McMahan, Moore, Ramage, Hampson and Aguera y Arcas, "Communication-Efficient
Learning of Deep Networks from Decentralized Data", AISTATS 2017), and FedAvg+FT.

The server averages the whole model, weighted by the clients' samples; each sampled
client trains it for ``epochs``. FedAvg+FT (``fedavg-ft``, FedRep's Table 1) trains
alike and, after the last round, every client fine-tunes its head for
``finetune-epochs`` before its test (``FinalTest.FINETUNE``). The update is the
personalized family's.
"""

from __future__ import annotations

from fedpers.algorithms import AlgorithmSpec, Family, FinalTest
from fedpers.protocol import MODEL_PARTS

ROWS = (
    AlgorithmSpec(
        name="fedavg",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        unseen=True,
        paper="McMahan et al., AISTATS 2017",
    ),
    AlgorithmSpec(
        name="fedavg-ft",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        final_test=FinalTest.FINETUNE,
        paper="FedAvg, then head fine-tuning (FedRep's Table 1)",
    ),
)
