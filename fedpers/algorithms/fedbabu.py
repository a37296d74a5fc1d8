"""FedBABU (Oh, Kim and Yun, "FedBABU: Toward Enhanced Representation for Federated Image
Classification", ICLR 2022).

The head stays frozen at the shared initial head during training; the server averages
the body, which each sampled client trains for ``epochs``. After the last round every
client fine-tunes its whole model, body and head, for ``finetune-epochs`` before its
test (``FinalTest.FINETUNE_ALL``), as the paper's experiments personalize (and Flower's
FedBABU baseline does: every parameter in the fine-tuning optimizer); the head alone
was fine-tuned before issue 42, the +FT protocol of FedRep's table. The update is the
personalized family's with one phase, the body.
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
        final_test=FinalTest.FINETUNE_ALL,
        paper="Oh et al., ICLR 2022",
    ),
)
