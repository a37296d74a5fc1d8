"""Ditto (Li et al., "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021, Algorithm 1).

The server runs FedAvg on a global model ``w``. Each sampled client also keeps a
personal model ``v`` in ``context.state`` and trains it on its own loss plus
``(lambda / 2) ||v - w^t||^2`` toward the global model it received this round; the
global update itself is plain local SGD. Clients are evaluated with ``v``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedpers import protocol, records
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.families import personalized
from fedpers.protocol import MODEL_PARTS
from fedpers.settings import at_least, setting

if TYPE_CHECKING:
    from fedpers.cohort import Cohort, Reply


@dataclass(frozen=True)
class DittoSettings:
    """The personal model of Ditto (the row `ditto`)."""

    ditto_lambda: float = setting(
        0.1,
        "Ditto: weight of (lambda/2)||v - w||^2 pulling the personal model v toward the "
        "global model w",
    )

    def check(self) -> None:
        at_least("ditto-lambda", self.ditto_lambda, 0.0)


def fit(cohort: Cohort) -> list[Reply]:
    """FedAvg's update of the global model ``w`` (the family's phases), then each
    member's ``v`` toward the ``w^t`` it received; replies ``w``, keeps ``v``."""
    from fedpers import training, update

    local = update.Personalized(cohort)
    received = local.received()
    names = [n for n, _ in local.model.named_parameters()]
    anchors = local.tensors(received, names)
    stack = local.models(received)
    stats = local.train_phases(stack)
    personal = local.kept()
    training.train(
        personal,
        local.train_data(),
        parts=MODEL_PARTS,
        epochs=records.config_int(local.config, protocol.EPOCHS),
        settings=local.sgd(),
        generators=local.generators("personal", local.round),
        objective=update.proximal(cohort.run.group(DittoSettings).ditto_lambda),
        inputs=anchors,
        augment=local.augment,
    )
    local.keep(personal)
    return update.fit_replies(local.shared_arrays(stack), stats)


evaluate = personalized.evaluate_kept  # tested with its v


ROWS = (
    AlgorithmSpec(
        name="ditto",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        personal_state=True,
        settings=(DittoSettings,),
        paper="Li et al., ICML 2021",
    ),
)
