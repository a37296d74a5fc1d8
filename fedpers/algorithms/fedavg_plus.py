"""FedAvg+ (Jiang, Konecny, Rush and Kannan, "Improving Federated Learning
Personalization via Model Agnostic Meta Learning", 2019, arXiv 1909.12488), as FedEM's
code runs it for FedGMM's and FedEM's tables (``--locally_tune_clients``): FedAvg's
training, and before every test each client adapts a copy of the global model, all of
it, for the run's local ``epochs`` on its own training data at the run's ``lr``; the
copy is tested and dropped, so the next round's test adapts from the next global model.

It is not FedAvg+FT: that tunes the head alone, for ``finetune-epochs``, once, after
the last round. An unseen client (``unseen-fraction``) adapts on the part of its data
that FedGMM's Table 4 protocol gives it to adapt on, and is tested on the rest.

The training is the personalized family's (FedAvg's); only the evaluation is this
module's, written for a cohort through the one training loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedpers import protocol, records
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.protocol import MODEL_PARTS

if TYPE_CHECKING:
    from fedpers.cohort import Cohort, Metrics
    from fedpers.training import CohortData, Stack
    from fedpers.update import Personalized


def evaluate(cohort: Cohort) -> list[Metrics]:
    """Every member's test figures with the global model after ``epochs`` of local
    training (an unseen member: on its adaptation split, tested on the rest)."""
    from fedpers import training, update

    local = update.Personalized(cohort)
    if records.config_int(local.config, protocol.UNSEEN, default=0):
        fraction = records.config_float(local.config, protocol.ADAPT_FRACTION)
        adapt, test = local.adaptation_data(fraction)
    else:
        adapt, test = local.train_data(), local.test_data()
    stack = adapted(local, adapt)
    return [update.test_metrics(s) for s in training.evaluate(stack, test)]


def adapted(local: Personalized, data: CohortData) -> Stack:
    """Every member's copy of the model it received after the run's ``epochs`` on
    ``data``, at the round's lr, its batch order drawn from the round (``adapt``); what
    the members keep is unchanged."""
    from fedpers import training

    stack = local.models()
    training.train(
        stack,
        data,
        parts=MODEL_PARTS,
        epochs=local.run.epochs,
        settings=local.sgd(),
        generators=local.generators("adapt", local.round),
        augment=local.augment,
    )
    return stack


ROWS = (
    AlgorithmSpec(
        name="fedavg-plus",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        unseen=True,
        paper="Jiang et al., 2019 (arXiv 1909.12488), as FedEM's code tunes locally",
    ),
)
