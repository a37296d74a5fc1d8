"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar and Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020, Algorithm 2), and FedProx+FT.

The server runs FedAvg. Each sampled client starts from the round's global model ``w^t``
and minimizes its own loss plus the proximal term ``(mu / 2) ||w - w^t||^2`` with the
same local SGD as FedAvg (``epochs`` passes, the run's mini-batches), which keeps the
local model near the global one on heterogeneous data. ``mu = 0`` is FedAvg's update, to
the bit. FedProx+FT (``fedprox-ft``) is the same training, then ``finetune-epochs`` of
head training on every client before its test, as FedAvg+FT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fedpers.algorithms import AlgorithmSpec, Family, FinalTest
from fedpers.families import personalized
from fedpers.protocol import MODEL_PARTS
from fedpers.settings import at_least, setting

if TYPE_CHECKING:
    from fedpers.cohort import Cohort, Reply


@dataclass(frozen=True)
class FedProxSettings:
    """The proximal term of FedProx (the rows `fedprox` and `fedprox-ft`)."""

    HEADING: ClassVar[str] = "fedprox"

    # Chosen on validation (docs/reproducing.md): 0.001 of the FedProx paper's grid
    # {0.001, 0.01, 0.1, 1}, FedRep's Table 1 setting, seeds 0-2.
    fedprox_mu: float = setting(
        0.001,
        "FedProx: weight of (mu/2)||w - w^t||^2 added to every local step's loss, pulling "
        "the local model w toward the round's global model w^t (0: FedAvg's update)",
    )

    def check(self) -> None:
        at_least("fedprox-mu", self.fedprox_mu, 0.0)


def fit(cohort: Cohort) -> list[Reply]:
    """FedAvg's local update with the proximal term toward each member's received
    ``w^t``."""
    from fedpers import update

    mu = cohort.run.group(FedProxSettings).fedprox_mu

    def anchors(local: Any) -> Any:
        received = local.received()
        names = [n for n, _ in local.model.named_parameters() if n in received[0]]
        return local.tensors(received, names)

    return personalized.fit(cohort, objective=update.proximal(mu), inputs=anchors)


ROWS = (
    AlgorithmSpec(
        name="fedprox",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        settings=(FedProxSettings,),
        unseen=True,
        paper="Li et al., MLSys 2020",
    ),
    AlgorithmSpec(
        name="fedprox-ft",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        settings=(FedProxSettings,),
        final_test=FinalTest.FINETUNE,
        paper="FedProx, then head fine-tuning (FedRep's Table 1)",
    ),
)
