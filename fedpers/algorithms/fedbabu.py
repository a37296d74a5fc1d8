"""FedBABU (Oh, Kim and Yun, "FedBABU: Toward Enhanced Representation for Federated Image
Classification", ICLR 2022).

The head stays frozen at the shared initial head during training; the server averages
the body, which each sampled client trains for ``epochs``. After the last round every
client fine-tunes its head for ``finetune-epochs`` before its test
(``FinalTest.FINETUNE``). The update is the personalized family's with one phase, the
body.
"""

from __future__ import annotations

from fedpers.algorithms import AlgorithmSpec, Family, FinalTest, Phase
from fedpers.protocol import BODY

ROWS = (
    AlgorithmSpec(
        name="fedbabu",
        family=Family.PERSONALIZED,
        shared=(BODY,),
        phases=(Phase((BODY,)),),
        final_test=FinalTest.FINETUNE,
        paper="Oh et al., ICLR 2022",
    ),
)
