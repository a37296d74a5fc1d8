"""FedBN (Li, Jiang, Zhang, Kamp and Dou, "FedBN: Federated Learning on Non-IID
Features via Local Batch Normalization", ICLR 2021, Algorithm 1).

FedAvg without the BatchNorm layers: each sampled client trains its whole model for
``epochs`` and the server averages every parameter, weighted by samples, except those
of the BatchNorm layers (their scale and shift, and their running statistics), which
each client keeps in ``context.state`` and never sends. A client is tested with its own
BatchNorm layers and the global rest; before its first round it holds the seeded
initial ones. The paper's answer to feature shift: clients whose inputs differ in
scale, contrast or style (``feature-shift``) normalize them with their own statistics.

It needs a model with BatchNorm layers (``mnist1d-mlp-bn``, ``digits-mlp-bn``,
``femnist-mlp-bn``, ``cifar10-cnn-bn``, ``cifar100-cnn-bn`` or a registered one); a
built-in model without them is refused before start. A BatchNorm model trains one
client at a time inside a cohort (batch statistics would mix the padded rows of a
stacked batch) and skips a one-sample last batch (``fedpers.training.train``), for
every row that uses one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedpers import protocol
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.data.registry import BATCH_NORM_MODELS, BUILT_IN_MODELS
from fedpers.protocol import MODEL_PARTS
from fedpers.settings import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from fedpers.cohort import Arrays, Cohort, Metrics, Reply
    from fedpers.config import RunConfig
    from fedpers.update import Personalized


def check(run: RunConfig) -> None:
    """A built-in model without BatchNorm layers leaves FedBN nothing to keep: refused.

    Raises
    ------
    ConfigError
        Naming the model and the models that have BatchNorm layers.
    """
    name = run.model_name
    if name in BUILT_IN_MODELS and name not in BATCH_NORM_MODELS:
        raise ConfigError(
            f"algorithm = 'fedbn' keeps the BatchNorm layers on the device, and model = "
            f"'{name}' has none: choose model = one of {', '.join(sorted(BATCH_NORM_MODELS))} "
            "(or a registered model with BatchNorm layers)"
        )


def local_names(model: nn.Module) -> set[str]:
    """The ``state_dict`` names of the model's BatchNorm layers (weights, biases,
    running statistics and step counts): what a FedBN client keeps.

    Raises
    ------
    ValueError
        If the model has no BatchNorm layer (a registered model the server could not
        check).
    """
    from torch import nn

    names = {
        f"{prefix}.{name}"
        for prefix, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
        for name in module.state_dict()
    }
    if not names:
        raise ValueError(
            f"algorithm 'fedbn' needs a model with BatchNorm layers; {type(model).__name__} "
            f"has none: choose model = one of {', '.join(sorted(BATCH_NORM_MODELS))}"
        )
    return names


def _global_arrays(local: Personalized, keep: set[str]) -> list[Arrays]:
    """Each member's arrays from the server: exactly the model's entries outside
    ``keep``, its BatchNorm layers (``Personalized.received``)."""
    return local.received({n for n in local.model.state_dict() if n not in keep})


def fit(cohort: Cohort) -> list[Reply]:
    """Each member's model (its kept BatchNorm layers, the global rest) trained whole
    for ``epochs``; its BatchNorm layers stored again, the rest replied with its
    samples and loss."""
    from fedpers import update

    local = update.Personalized(cohort)
    keep = local_names(local.model)
    stack = local.models(_global_arrays(local, keep))
    stats = local.train_phases(stack)
    whole = stack.arrays(MODEL_PARTS)
    for member, arrays in zip(local.members, whole, strict=True):
        own = {n: a for n, a in arrays.items() if n in keep}
        member.state[protocol.STATE_PERSONAL] = update.to_record(own)
    shared = [{n: a for n, a in arrays.items() if n not in keep} for arrays in whole]
    return update.fit_replies(shared, stats)


def evaluate(cohort: Cohort) -> list[Metrics]:
    """Each member's test figures with its own BatchNorm layers and the global rest."""
    from fedpers import update

    local = update.Personalized(cohort)
    return local.evaluate(local.models(_global_arrays(local, local_names(local.model))))


def initial_arrays(cohort: Cohort) -> Arrays:
    """The seeded initial model without its BatchNorm layers (the server's round-0
    state)."""
    from fedpers import models, update

    local = update.Personalized(cohort)
    keep = local_names(local.model)
    return {n: a for n, a in models.part_arrays(local.model, MODEL_PARTS).items() if n not in keep}


ROWS = (
    AlgorithmSpec(
        name="fedbn",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        checks=(check,),
        personal_state=True,
        paper="Li et al., ICLR 2021",
    ),
)
