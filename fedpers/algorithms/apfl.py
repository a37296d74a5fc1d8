"""APFL (Deng, Kamani and Mahdavi, "Adaptive Personalized Federated Learning", 2020,
arXiv 2003.13461, Algorithm 1 with the adaptive mixing weight of its Section 3.2).

The server runs FedAvg on a global model ``w``. Each client also keeps, in
``context.state``, a personal model ``v`` and a mixing weight ``alpha`` (the run's
``apfl-alpha`` at first), and predicts with the mixture ``v_bar = alpha v +
(1 - alpha) w``. A sampled client takes, on every mini-batch ``xi`` of its local update
(``epochs`` passes, as FedAvg's), from the values before the step:

    w     <- w - eta grad f(w; xi)
    v     <- v - eta grad_v f(v_bar; xi)              = v - eta alpha grad f(v_bar; xi)
    alpha <- clip(alpha - eta <v - w, grad f(v_bar; xi)>, 0, 1)     (``apfl-adaptive``)

and sends ``w`` back. ``w`` and ``v`` step with the run's optimizer (its momentum and
weight decay, as every other row's local update); ``alpha`` with plain SGD at the same
step size, clipped to [0, 1] as the paper does. Clients are tested with ``v_bar``,
mixing their own ``v`` with the global ``w`` they received.

The steps are a loop of their own over the cohort's mini-batches (``client_steps``,
``assemble``: each member's batches from its own generator), two training forward
passes a step (``w``'s, then the mixture's, each with its own dropout masks), and the
loss of every step is torch's mean cross-entropy of the batch's real rows, so that a
client alone gets the bits its loop had before cohorts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from flwr.app import Array, ArrayRecord

from fedpers import protocol, records
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.protocol import MODEL_PARTS
from fedpers.settings import setting, within

if TYPE_CHECKING:
    import torch

    from fedpers.cohort import Cohort, Metrics, Reply
    from fedpers.training import SGD, Batch, Stack, View
    from fedpers.update import Personalized

STATE_ALPHA = "fedpers.apfl.alpha"  # a client's mixing weight, in context.state
ALPHA = "alpha"
IGNORE = -100  # the label torch's cross-entropy leaves out (a batch's padding)


@dataclass(frozen=True)
class APFLSettings:
    """The personal mixture of APFL (the row `apfl`)."""

    HEADING: ClassVar[str] = "apfl"

    # Chosen on validation (docs/reproducing.md): 1 of {0.25, 0.5, 0.75, 0.9, 1}, the end
    # of its range (Deng et al. try 0.25-0.75; 0.75, the FedRep authors' fixed value, was
    # the first grid's edge), FedRep's Table 1 setting, seeds 0-2: 73.7 / 77.2 / 78.7 %
    # at 0.75 / 0.9 / 1. Each client's alpha adapts from it.
    apfl_alpha: float = setting(
        1.0,
        "APFL: the weight alpha of the personal model v in the prediction "
        "alpha v + (1 - alpha) w (with apfl-adaptive, where each client's alpha starts)",
    )
    apfl_adaptive: bool = setting(
        True,
        "APFL: each client learns its alpha by gradient steps on its mixture's loss "
        "(Deng et al., Section 3.2); false keeps apfl-alpha fixed",
    )

    def check(self) -> None:
        within("apfl-alpha", self.apfl_alpha, "[0, 1]")


def fit(cohort: Cohort) -> list[Reply]:
    """The simultaneous steps of every member's ``w``, ``v`` and ``alpha``; replies
    ``w``, keeps ``v`` and ``alpha``."""
    from fedpers import update

    local = update.Personalized(cohort)
    w, v = local.models(), local.kept()
    loop = _Steps(local, w, v)
    losses = loop.run()
    local.keep(v)
    for member, alpha in zip(local.members, loop.alpha.tolist(), strict=True):
        member.state[STATE_ALPHA] = ArrayRecord({ALPHA: Array(np.array([alpha]))})
    return [
        (arrays, {protocol.NUM_EXAMPLES: float(n), protocol.LOSS: loss})
        for arrays, n, loss in zip(local.shared_arrays(w), loop.data.counts, losses, strict=True)
    ]


def evaluate(cohort: Cohort) -> list[Metrics]:
    """Each member's test figures with its mixture ``alpha v + (1 - alpha) w``, ``w``
    the global model it received."""
    from fedpers import training, update

    local = update.Personalized(cohort)
    w, v = local.models(), local.kept()
    mixed = _mixture(w, v, _alphas(local))
    return [update.test_metrics(s) for s in training.evaluate(mixed, local.test_data())]


def _alphas(local: Personalized) -> torch.Tensor:
    """Every member's ``alpha`` (K,): what it stored, else ``apfl-alpha``; in the
    cohort's precision (the models' float32, or float64)."""
    import torch

    values = []
    for member in local.members:
        value = local.run.group(APFLSettings).apfl_alpha
        kept = member.state.get(STATE_ALPHA)
        if isinstance(kept, ArrayRecord) and ALPHA in kept:
            value = float(records.values(kept[ALPHA])[0])
        values.append(value)
    return torch.tensor(values, dtype=local.dtype or torch.float32, device=local.device)


def _mixture(w: Stack, v: Stack, alpha: torch.Tensor) -> Stack:
    """The stack of ``alpha v + (1 - alpha) w`` (the parameters; the buffers ``v``'s)."""
    from fedpers import training

    tensors = dict(v.tensors)
    for name in v.parameter_names:
        a = alpha.view(-1, *([1] * (v.tensors[name].ndim - 1)))
        tensors[name] = a * v.tensors[name] + (1 - a) * w.tensors[name]
    return training.Stack(v.template, tensors, v.stored)


def _cross_entropy(model: View, batch: tuple[Any, ...], inputs: Any) -> torch.Tensor:
    """torch's mean cross-entropy of the batch's real rows (the padding's labels
    ignored): for a full batch, the bits of ``F.cross_entropy(model(x), y)``."""
    import torch
    from torch.nn import functional as F

    x, y, weight, count, _ = batch
    labels = torch.where(weight > 0, y, IGNORE)
    return F.cross_entropy(model(x), labels, reduction="sum") / count


class _Steps:
    """APFL's local update of a cohort: each member's mini-batches (its own generator's
    order, augmentation and dropout masks), and on each the steps of ``w``, ``v`` and
    ``alpha`` from the values before it.

    Parameters
    ----------
    local : Personalized
        The cohort.
    w, v : Stack
        The global models received and the personal ones kept (trained in place).
    """

    def __init__(self, local: Personalized, w: Stack, v: Stack) -> None:
        from fedpers import training

        self.w, self.v = w, v
        self.adaptive = local.run.group(APFLSettings).apfl_adaptive
        self.alpha = _alphas(local)
        self.sgd = local.sgd()
        self.data = local.train_data()
        self.augment = local.augment
        self.names = w.names(MODEL_PARTS)
        generators = local.generators("train", local.round)
        counts = self.data.counts
        seeds = [
            training.dropout_seed(g) if n else None for g, n in zip(generators, counts, strict=True)
        ]
        epochs = records.config_int(local.config, protocol.EPOCHS)
        self.plans = [
            training.client_steps(n, epochs, self.sgd.batch_size, g, augment=local.augment)
            for n, g in zip(counts, generators, strict=True)
        ]
        self.masks = training.DropoutMasks(w, seeds, self.data.x[0]) if w.has_dropout else None

    def run(self) -> list[float]:
        """Every step; each member's mean loss of ``w`` over all its steps' samples (NaN
        without a step)."""
        from fedpers import training

        trained = [s.tensors[n] for s in (self.w, self.v) for n in self.names]
        half = len(self.names)
        steps = training.SGD(trained[:half], self.sgd), training.SGD(trained[half:], self.sgd)
        sums, seen = [0.0] * self.w.size, [0] * self.w.size
        for t in trained:
            t.requires_grad_(True)
        try:
            with training.training_mode(self.w.template, True):
                for s in range(max((len(p) for p in self.plans), default=0)):
                    here = [p[s] if s < len(p) else None for p in self.plans]
                    batch = training.assemble(self.data, here, augment=self.augment)
                    values = self.step(batch, *steps).detach().cpu()
                    for k, size in enumerate(batch.sizes):
                        if size:
                            sums[k] += float(values[k]) * size
                            seen[k] += size
        finally:
            for t in trained:
                t.requires_grad_(False)
        return [total / n if n else math.nan for total, n in zip(sums, seen, strict=True)]

    def step(self, batch: Batch, w_step: SGD, v_step: SGD) -> torch.Tensor:
        """One step of every member with a batch: ``w`` on its loss, ``v`` and
        ``alpha`` on the mixture's; the members' losses of ``w`` (K,)."""
        import torch

        from fedpers import training

        active = None if batch.full or self.w.size == 1 else batch.active
        batch.masks = self._masks(batch)
        loss = training.step_losses(self.w, _cross_entropy, batch, None)
        grad_w = torch.autograd.grad(loss.sum(), w_step.params)
        batch.masks = self._masks(batch)
        a = self.alpha.clone().requires_grad_(self.adaptive)
        mixed = self._mixture_losses(a, batch)
        wanted = [*v_step.params, a] if self.adaptive else v_step.params
        grads = torch.autograd.grad(mixed.sum(), wanted)
        w_step.step(list(grad_w), active)
        v_step.step(list(grads[: len(v_step.params)]), active)
        if self.adaptive:
            with torch.no_grad():
                moved = (self.alpha - self.sgd.lr * grads[-1]).clamp(0.0, 1.0)
                self.alpha = moved if active is None else torch.where(active, moved, self.alpha)
        return loss

    def _masks(self, batch: Batch) -> list[torch.Tensor]:
        """The dropout masks of one training forward pass of every member."""
        if self.masks is None:
            return []
        return self.masks.draw(batch.sizes, batch.x.shape[1], batch.x)

    def _mixture_losses(self, a: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Every member's loss of its mixture ``a v + (1 - a) w`` (K,), ``w`` a constant
        in it."""
        from fedpers import training

        template = self.w.template

        def one(
            v: dict[str, torch.Tensor],
            w: dict[str, torch.Tensor],
            alpha: torch.Tensor,
            x: torch.Tensor,
            y: torch.Tensor,
            weight: torch.Tensor,
            count: torch.Tensor,
            masks: list[torch.Tensor],
        ) -> torch.Tensor:
            mixed = {n: alpha * v[n] + (1 - alpha) * t if n in v else t for n, t in w.items()}
            with training.replay(masks):
                view = training.View(template, mixed)
                return _cross_entropy(view, (x, y, weight, count, None), None)

        return training.per_client(
            one,
            {n: self.v.tensors[n] for n in self.names},
            {n: t.detach() for n, t in self.w.tensors.items()},
            a,
            batch.x,
            batch.y,
            batch.weight,
            batch.count,
            batch.masks,
            size=self.w.size,
        )


ROWS = (
    AlgorithmSpec(
        name="apfl",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        personal_state=True,  # v and alpha
        settings=(APFLSettings,),
        paper="Deng et al., 2020 (arXiv 2003.13461)",
    ),
)
