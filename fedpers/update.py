"""What every torch local update of a cohort starts from (the device side; torch).

``Local`` holds a cohort's device, precision, data, generators and optimizer settings;
``Personalized`` adds the body/head model of the personalized family: the cohort's
models stacked from what each member was sent and what it keeps in ``context.state``,
and their personal parts stored back. The algorithm modules (``fedpers.algorithms``)
import this module inside their update functions, so the server, which imports those
modules for their rows, never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch.nn import functional as F

from fedpers import protocol, records
from fedpers.algorithms import FinalTest
from fedpers.cohort import Arrays, Cohort, Member, Metrics, Reply
from fedpers.data.client import ClientData, adaptation_split, clients_data
from fedpers.models import build_model
from fedpers.seeding import int_seed
from fedpers.training import (
    Augment,
    Batch,
    CohortData,
    EvalStats,
    Objective,
    SGDSettings,
    Stack,
    TrainStats,
    View,
    cross_entropy,
    evaluate,
    random_crop_flip,
    resolve_device,
    step_losses,
    train,
)

AUGMENTED_DATASETS = ("cifar10", "cifar100")


class Local:
    """A cohort's torch side: device, precision, each member's data and generators.

    Parameters
    ----------
    cohort : Cohort
        The members, the run configuration and the round's settings.
    """

    def __init__(self, cohort: Cohort) -> None:
        self.cohort = cohort
        self.run = cohort.run
        self.config = cohort.config
        self.members = cohort.members
        if cohort.threads is not None:
            torch.set_num_threads(cohort.threads)
        self.device = resolve_device(self.run.device)
        self.dtype = torch.float64 if cohort.dtype == "float64" else None

    @property
    def size(self) -> int:
        return len(self.members)

    @cached_property
    def data(self) -> list[ClientData]:
        """Each member's data (``client_data``, cached per process)."""
        return clients_data(self.run, [m.partition for m in self.members])

    @property
    def round(self) -> int:
        """The round the server named in its message (0 if none)."""
        return records.config_int(self.config, protocol.ROUND, default=0)

    @property
    def lr(self) -> float:
        """The learning rate the server sent for this round (its schedule may change it)."""
        return records.config_float(self.config, protocol.LR)

    def sgd(self) -> SGDSettings:
        """The optimizer settings: the round's learning rate, the rest from the run."""
        return SGDSettings(
            lr=self.lr,
            momentum=self.run.momentum,
            weight_decay=self.run.weight_decay,
            batch_size=self.run.batch_size,
        )

    def generators(self, purpose: str, *keys: int) -> list[torch.Generator]:
        """Each member's torch generator for ``purpose``, seeded by the run, the purpose,
        its partition and ``keys``: its own stream, whatever its cohort."""
        return [
            torch.Generator().manual_seed(int_seed(self.run.seed, purpose, m.partition, *keys))
            for m in self.members
        ]

    @cached_property
    def augment(self) -> Augment | None:
        """The data set's training-time augmentation (CIFAR's crop and flip), or None."""
        return random_crop_flip() if self.run.dataset in AUGMENTED_DATASETS else None

    def cohort_data(self, xs: Sequence[np.ndarray], ys: Sequence[np.ndarray]) -> CohortData:
        """Samples of every member, stacked on the device in the cohort's precision."""
        return CohortData.of(xs, ys, device=self.device, dtype=self.dtype)

    def train_data(self) -> CohortData:
        return self.cohort_data([d.x_train for d in self.data], [d.y_train for d in self.data])

    def test_data(self) -> CohortData:
        return self.cohort_data([d.x_test for d in self.data], [d.y_test for d in self.data])

    def adaptation_data(self, fraction: float) -> tuple[CohortData, CohortData]:
        """Unseen clients' samples (FedGMM's Table 4 protocol): to adapt on, to test on."""
        splits = [
            adaptation_split(d, fraction, self.run.seed, m.partition)
            for d, m in zip(self.data, self.members, strict=True)
        ]
        adapt = self.cohort_data([s[0] for s in splits], [s[1] for s in splits])
        test = self.cohort_data([s[2] for s in splits], [s[3] for s in splits])
        return adapt, test

    def stack(self, model: torch.nn.Module, arrays: Sequence[Arrays]) -> Stack:
        """``model`` for every member, member ``k``'s values from ``arrays[k]``."""
        return Stack.of(model, arrays, device=self.device, dtype=self.dtype)

    def tensors(self, arrays: Sequence[Arrays], names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Every member's arrays ``names`` stacked (K, ...) on the device, in the
        cohort's precision, in the order of ``names``."""
        out = {}
        for name in names:
            stacked = torch.as_tensor(np.stack([a[name] for a in arrays]))
            if self.dtype is not None and stacked.is_floating_point():
                stacked = stacked.to(self.dtype)
            out[name] = stacked.to(self.device)
        return out


class Personalized(Local):
    """A cohort of the personalized family: a ``body``/``head`` model, the parts the
    row shares received from the server, the others kept on the device."""

    def __init__(self, cohort: Cohort) -> None:
        super().__init__(cohort)
        self.spec = self.run.spec
        self.shared = self.spec.shared
        self.personal = self.spec.personal

    @cached_property
    def model(self) -> torch.nn.Module:
        """The seeded initial model every process builds (so a client that never trained
        holds the server's initial personal parts)."""
        run = self.run
        return build_model(
            run.model_name, run.num_classes, int_seed(run.seed, "model"), run.input_shape
        )

    def received(self, expected: set[str] | None = None) -> list[Arrays]:
        """Each member's shared arrays; exactly ``expected`` must be there (by default
        the row's shared parts).

        Raises
        ------
        ValueError
            Naming the arrays expected and those received.
        """
        if expected is None:
            expected = {n for n in self.model.state_dict() if n.split(".", 1)[0] in self.shared}
        for member in self.members:
            if set(member.arrays) != expected:
                raise ValueError(
                    f"{self.spec.name} client expected shared arrays {sorted(expected)}, "
                    f"received {sorted(member.arrays)}"
                )
        return [m.arrays for m in self.members]

    def models(self, received: Sequence[Arrays] | None = None) -> Stack:
        """Every member's model: what it keeps in ``context.state``, overwritten by the
        shared arrays it received (``received``, by default ``received()``)."""
        shared = self.received() if received is None else received
        return self.stack(
            self.model,
            [{**kept(m), **arrays} for m, arrays in zip(self.members, shared, strict=True)],
        )

    def kept(self) -> Stack:
        """Every member's whole personal model (Ditto's and APFL's v, L2GD's x_i, ...):
        what it stored last (``keep``), else the seeded initial model."""
        return self.stack(self.model, [kept(m) for m in self.members])

    def keep(self, stack: Stack, parts: Sequence[str] = protocol.MODEL_PARTS) -> None:
        """Store every member's ``parts`` of ``stack`` in its ``context.state``."""
        for member, arrays in zip(self.members, stack.arrays(parts), strict=True):
            member.state[protocol.STATE_PERSONAL] = to_record(arrays)

    def train_kept(
        self, *, objective: Objective = cross_entropy, inputs: Any = None
    ) -> list[Reply]:
        """Every member's kept whole model (``kept``) trained for the round's epochs on
        ``objective``, stored again, and replied whole, with its size and, where it took a
        step, the loss of its last epoch: Fed-MTL's and FedAMP's ``w_i``."""
        stack = self.kept()
        stats = train(
            stack,
            self.train_data(),
            parts=protocol.MODEL_PARTS,
            epochs=records.config_int(self.config, protocol.EPOCHS),
            settings=self.sgd(),
            generators=self.generators("train", self.round),
            objective=objective,
            inputs=inputs,
            augment=self.augment,
        )
        self.keep(stack)
        replies = []
        for arrays, s in zip(stack.arrays(protocol.MODEL_PARTS), stats, strict=True):
            metrics = {protocol.NUM_EXAMPLES: float(s.num_examples)}
            if s.steps:
                metrics[protocol.LOSS] = s.loss
            replies.append((arrays, metrics))
        return replies

    def keep_personal(self, stack: Stack) -> None:
        """Store the personal parts of every member's model (none for a row that shares
        all)."""
        if self.personal:
            self.keep(stack, self.personal)

    def shared_arrays(self, stack: Stack) -> list[Arrays]:
        """Every member's shared parts, to send back."""
        return stack.arrays(self.shared)

    def train_phases(
        self,
        stack: Stack,
        *,
        objective: Objective = cross_entropy,
        inputs: Any = None,
        correction: Mapping[str, torch.Tensor] | None = None,
    ) -> list[TrainStats]:
        """The row's local update (``phases``: which parts train, for the epochs the
        server sent, in order) through the one training loop, every phase from the same
        generators; per member, the loss of its last phase that took a step and the
        steps of all phases."""
        generators = self.generators("train", self.round)
        data = self.train_data()
        last = [TrainStats(float("nan"), n, 0) for n in data.counts]
        for phase in self.spec.phases:
            stats = train(
                stack,
                data,
                parts=phase.parts,
                epochs=records.config_int(self.config, phase.epochs),
                settings=self.sgd(),
                generators=generators,
                augment=self.augment,
                objective=objective,
                inputs=inputs,
                correction=correction,
            )
            last = [
                TrainStats(
                    s.loss if s.steps else before.loss, s.num_examples, before.steps + s.steps
                )
                for s, before in zip(stats, last, strict=True)
            ]
        return last

    def evaluate(self, stack: Stack) -> list[Metrics]:
        """Every member's test figures with ``stack``: an unseen client (config
        ``unseen``) on the part of its data the mixtures do not adapt on, without
        adapting; with ``finetune-epochs`` > 0 after that many epochs of training on its
        training data (not stored): of the head (the +FT rows), or of the whole model
        where the row says so (``FinalTest.FINETUNE_ALL``: FedBABU)."""
        if records.config_int(self.config, protocol.UNSEEN, default=0):
            fraction = records.config_float(self.config, protocol.ADAPT_FRACTION)
            return [test_metrics(s) for s in evaluate(stack, self.adaptation_data(fraction)[1])]
        epochs = records.config_int(self.config, protocol.FINETUNE_EPOCHS, default=0)
        if epochs > 0:
            whole = self.run.spec.final_test is FinalTest.FINETUNE_ALL
            train(
                stack,
                self.train_data(),
                parts=protocol.MODEL_PARTS if whole else (protocol.HEAD,),
                epochs=epochs,
                settings=self.sgd(),
                generators=self.generators("finetune", self.round),
                augment=self.augment,
            )
        return [test_metrics(s) for s in evaluate(stack, self.test_data())]


def proximal(weight: float) -> Objective:
    """The cross-entropy plus ``(weight / 2) ||w - anchor||^2``: ``inputs`` holds the
    anchor's tensors (by the model's names, in its order) toward which the model is
    pulled (FedProx's received w^t, Ditto's w)."""

    def objective(model: View, batch: tuple[Any, ...], inputs: Any) -> torch.Tensor:

        loss = cross_entropy(model, batch, None)
        terms = [(model[name] - value).pow(2).sum() for name, value in inputs.items()]

        return loss + 0.5 * weight * torch.stack(terms).sum()

    return objective


def mean_losses(stack: Stack, tensors: Mapping[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    """Every member's mean cross-entropy on its batch of ``batch`` (K,), its model
    ``stack``'s architecture with ``tensors`` (a step's own values: Per-FedAvg's adapted
    ``w'``, pFedMe's ``theta``), its dropout masks replayed: the plain mean
    (``F.cross_entropy``) where every member has a batch of the same size, so that a
    member alone does its loop's operations, else the mean of its real rows."""
    full = batch.full

    def objective(model: View, batch: tuple[Any, ...], inputs: Any) -> torch.Tensor:
        x, y, weight, count, _ = batch
        if full:
            return F.cross_entropy(model(x), y)
        return (F.cross_entropy(model(x), y, reduction="none") * weight).sum() / count

    return step_losses(Stack(stack.template, dict(tensors), stack.stored), objective, batch, None)


def fit_replies(stack_arrays: Sequence[Arrays], stats: Sequence[TrainStats]) -> list[Reply]:
    """Training replies: each member's arrays, its samples and its loss."""
    return [
        (arrays, {protocol.NUM_EXAMPLES: float(s.num_examples), protocol.LOSS: s.loss})
        for arrays, s in zip(stack_arrays, stats, strict=True)
    ]


def kept(member: Member, key: str = protocol.STATE_PERSONAL) -> Arrays:
    """What a member stored under ``key`` (nothing before it first stored it)."""
    stored = member.state.get(key)
    if not isinstance(stored, ArrayRecord):
        return {}
    return {k: records.values(v) for k, v in stored.items()}


def to_record(arrays: Arrays) -> ArrayRecord:
    """Arrays as an ``ArrayRecord`` for ``context.state``: contiguous copies of their own
    shapes (BatchNorm's 0-d step counts stay 0-d)."""
    return ArrayRecord({name: Array(np.array(a, order="C")) for name, a in arrays.items()})


def test_metrics(stats: EvalStats) -> Metrics:
    """What an evaluation reply carries: samples, accuracy, loss."""
    return {
        protocol.NUM_EXAMPLES: float(stats.num_examples),
        protocol.ACCURACY: stats.accuracy,
        protocol.LOSS: stats.loss,
    }
