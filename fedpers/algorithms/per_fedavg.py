"""Per-FedAvg (Fallah, Mokhtari and Ozdaglar, "Personalized Federated Learning with
Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020,
Algorithm 1), first-order (FO) and Hessian-free (HF).

The server runs FedAvg on a model ``w`` meant to do well after one gradient step on any
client's data. A sampled client takes, for each local step, independent mini-batches
``D``, ``D'`` (and ``D''`` for HF) of its training data:

    w'  = w - alpha grad f(w; D)
    FO: w <- w - beta grad f(w'; D')
    HF: w <- w - beta (I - alpha H(w; D'')) grad f(w'; D')      (a Hessian-vector product)

``alpha`` is ``per-fedavg-alpha`` (FO) or ``per-fedavg-hf-alpha`` (HF); ``beta`` is the
round's learning rate, applied by the run's optimizer (its momentum and weight decay, as
every other row's local update). The mini-batches come from the run's random order of
each epoch, taken in consecutive groups of two (FO) or three (HF), so an epoch is
``floor(batches / 2)`` or ``floor(batches / 3)`` steps (one step, reusing batches, when
there are fewer).
A client is tested after the paper's one step of adaptation: ``w - alpha grad f(w; D)``
on one mini-batch ``D`` of its training data.

Written for a cohort: every member's meta-step is one computation (each member's
gradients are those of the sum of the members' losses, in which its parameters enter
only its own), its batches and dropout masks drawn from its own generator; a member
whose steps have ended is not moved (``fedpers.training``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fedpers import protocol, records
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.protocol import MODEL_PARTS
from fedpers.settings import at_least, setting

if TYPE_CHECKING:
    import torch

    from fedpers.cohort import Cohort, Metrics, Reply
    from fedpers.training import Batch, ClientStep, CohortData, DropoutMasks, Stack
    from fedpers.update import Personalized

HESSIAN_FREE = "per-fedavg-hf"


@dataclass(frozen=True)
class PerFedAvgSettings:
    """The inner step of Per-FedAvg (the rows `per-fedavg` and `per-fedavg-hf`)."""

    HEADING: ClassVar[str] = "per-fedavg"

    # Chosen on validation (docs/reproducing.md), FedRep's Table 1 setting, seeds 0-2:
    # FO 0.1 of {0.001, 0.01, 0.03, 0.1}; HF 0.03 of {0.01, 0.03, 0.1}.
    per_fedavg_alpha: float = setting(
        0.1,
        "Per-FedAvg (FO, the row `per-fedavg`): the step size alpha of the inner step "
        "w - alpha grad f(w; D), in training and in the one step of adaptation before a "
        "client's test (the outer step beta is the round's lr)",
    )
    per_fedavg_hf_alpha: float = setting(
        0.03, "Per-FedAvg HF (the row `per-fedavg-hf`): its alpha, as per-fedavg-alpha's"
    )

    def check(self) -> None:
        at_least("per-fedavg-alpha", self.per_fedavg_alpha, 0.0)
        at_least("per-fedavg-hf-alpha", self.per_fedavg_hf_alpha, 0.0)

    def alpha(self, hessian_free: bool) -> float:
        """The inner step of the FO or the HF row."""
        return self.per_fedavg_hf_alpha if hessian_free else self.per_fedavg_alpha


def _hessian_free(cohort: Cohort) -> bool:
    return cohort.run.spec.name == HESSIAN_FREE


def fit(cohort: Cohort) -> list[Reply]:
    """Per-FedAvg's local steps of every member from the ``w`` it received; replies
    ``w``, its samples and the mean of its steps' losses ``f(w'; D')``."""
    from fedpers import update

    local = update.Personalized(cohort)
    hessian_free = _hessian_free(cohort)
    alpha = cohort.run.group(PerFedAvgSettings).alpha(hessian_free)
    stack = local.models()
    losses = _train(local, stack, alpha=alpha, per_step=3 if hessian_free else 2)
    replies = []
    for arrays, data, own in zip(local.shared_arrays(stack), local.data, losses, strict=True):
        metrics = {
            protocol.NUM_EXAMPLES: float(len(data.y_train)),
            protocol.LOSS: sum(own) / len(own) if own else float("nan"),
        }
        replies.append((arrays, metrics))
    return replies


def _plan(
    count: int,
    epochs: int,
    batch_size: int,
    generator: torch.Generator,
    *,
    augment: Any,
    per_step: int,
) -> list[list[ClientStep]]:
    """One member's steps: each epoch's mini-batches (drawn from its generator as a loop
    over it alone draws them) in consecutive groups of ``per_step``, at least one group
    an epoch (reusing batches when there are fewer)."""
    from fedpers import training

    steps = []
    for _ in range(epochs if count else 0):
        batches = training.client_steps(count, 1, batch_size, generator, augment=augment)
        for step in range(max(1, len(batches) // per_step)):
            steps.append([batches[(step * per_step + j) % len(batches)] for j in range(per_step)])
    return steps


def _train(local: Personalized, stack: Stack, *, alpha: float, per_step: int) -> list[list[float]]:
    """The meta-steps of every member, in place in ``stack``; each member's losses
    ``f(w'; D')``, one a step."""
    from fedpers import training

    data = local.train_data()
    generators = local.generators("train", local.round)
    settings = local.sgd()
    epochs = records.config_int(local.config, protocol.EPOCHS)
    seeds = [
        training.dropout_seed(g) if n else None
        for g, n in zip(generators, data.counts, strict=True)
    ]
    plans = [
        _plan(n, epochs, settings.batch_size, g, augment=local.augment, per_step=per_step)
        for n, g in zip(data.counts, generators, strict=True)
    ]
    masks = training.DropoutMasks(stack, seeds, data.x[0]) if stack.has_dropout else None
    names = stack.names(MODEL_PARTS)
    params = [stack.tensors[n] for n in names]
    optimizer = training.SGD(params, settings)
    losses: list[list[float]] = [[] for _ in plans]
    for p in params:
        p.requires_grad_(True)
    try:
        with training.training_mode(stack.template, True):
            for s in range(max((len(p) for p in plans), default=0)):
                batches = [
                    _batch(data, [p[s][j] if s < len(p) else None for p in plans], local, masks)
                    for j in range(per_step)
                ]
                grads, loss = _direction(stack, names, batches, alpha=alpha)
                optimizer.step(grads, None if stack.size == 1 else batches[0].active)
                for k, size in enumerate(batches[0].sizes):
                    if size:
                        losses[k].append(float(loss[k]))
    finally:
        for p in params:
            p.requires_grad_(False)
    return losses


def _batch(
    data: CohortData,
    steps: Sequence[ClientStep | None],
    local: Personalized,
    masks: DropoutMasks | None,
) -> Batch:
    """The cohort's batch of one forward pass, with its dropout masks (drawn from each
    member's stream in the order of the passes)."""
    from fedpers import training

    batch = training.assemble(data, steps, augment=local.augment)
    if masks is not None:
        batch.masks = masks.draw(batch.sizes, batch.x.shape[1], batch.x)
    return batch


def _direction(
    stack: Stack, names: list[str], batches: Sequence[Batch], *, alpha: float
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every member's step direction (FO: ``grad f(w'; D')``; HF, with a third batch:
    less ``alpha H(w; D'')`` times it) and its loss ``f(w'; D')`` (K,)."""
    import torch

    from fedpers import update

    tensors = stack.tensors
    inner = _adapted(stack, names, tensors, batches[0], alpha=alpha)
    outer = {**tensors, **{n: inner[n].requires_grad_(True) for n in names}}
    loss = update.mean_losses(stack, outer, batches[1])
    grads = list(torch.autograd.grad(loss.sum(), [outer[n] for n in names]))
    if len(batches) > 2:
        # H(w; D'') v, with v = grad f(w'; D'): the gradient of <grad f(w; D''), v>
        params = [tensors[n] for n in names]
        first = torch.autograd.grad(
            update.mean_losses(stack, tensors, batches[2]).sum(), params, create_graph=True
        )
        dots = _per_member_dot(dict(zip(names, first, strict=True)), grads, size=stack.size)
        hvp = torch.autograd.grad(dots.sum(), params)
        grads = [g - alpha * h for g, h in zip(grads, hvp, strict=True)]
    return grads, loss.detach()


def _adapted(
    stack: Stack,
    names: list[str],
    tensors: dict[str, torch.Tensor],
    batch: Batch,
    *,
    alpha: float,
) -> dict[str, torch.Tensor]:
    """``w - alpha grad f(w; batch)`` of every member (``names``; ``w`` a constant); a
    member without a batch gets ``w``."""
    import torch

    from fedpers import update

    grads = torch.autograd.grad(
        update.mean_losses(stack, tensors, batch).sum(), [tensors[n] for n in names]
    )
    return {
        name: (tensors[name] - alpha * g).detach() for name, g in zip(names, grads, strict=True)
    }


def _per_member_dot(
    first: dict[str, torch.Tensor], vector: list[torch.Tensor], *, size: int
) -> torch.Tensor:
    """Each member's ``<first, vector>`` over all its tensors (K,)."""
    import torch

    from fedpers import training

    def dot(own: dict[str, torch.Tensor], other: list[torch.Tensor]) -> torch.Tensor:
        products = [(g * v).sum() for g, v in zip(own.values(), other, strict=True)]
        return torch.stack(products).sum()

    result: torch.Tensor = training.per_client(dot, first, vector, size=size)
    return result


def evaluate(cohort: Cohort) -> list[Metrics]:
    """Every member's test figures after one step of adaptation, ``w - alpha grad
    f(w; D)`` on one mini-batch ``D`` of its training data (not stored)."""
    import torch

    from fedpers import training, update

    local = update.Personalized(cohort)
    alpha = cohort.run.group(PerFedAvgSettings).alpha(_hessian_free(cohort))
    stack = local.models()
    data = local.train_data()
    generators = local.generators("adapt", local.round)
    steps = [
        training.ClientStep(torch.randperm(n, generator=g)[: local.run.batch_size]) if n else None
        for n, g in zip(data.counts, generators, strict=True)
    ]
    if any(s is not None for s in steps):
        batch = training.assemble(data, steps)
        names = stack.names(MODEL_PARTS)
        params = [stack.tensors[n] for n in names]
        for p in params:
            p.requires_grad_(True)
        try:
            # no dropout draw: the step is the same on every process
            with training.training_mode(stack.template, False):
                adapted = _adapted(stack, names, stack.tensors, batch, alpha=alpha)
        finally:
            for p in params:
                p.requires_grad_(False)
        stack.tensors.update(adapted)
    return [update.test_metrics(s) for s in training.evaluate(stack, local.test_data())]


ROWS = (
    AlgorithmSpec(
        name="per-fedavg",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        settings=(PerFedAvgSettings,),
        paper="Fallah et al., NeurIPS 2020 (first-order)",
    ),
    AlgorithmSpec(
        name=HESSIAN_FREE,
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        settings=(PerFedAvgSettings,),
        paper="Fallah et al., NeurIPS 2020 (Hessian-free)",
    ),
)
