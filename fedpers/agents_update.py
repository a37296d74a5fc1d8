"""The sheaf family's agents, for a cohort (the device side; torch).

An agent keeps its whole model in ``context.state`` (``sheaf.model``): an encoder and a
head of its own architecture (``fedpers.sheaf.AgentSpec``, ``fedpers.models.agents``).
A ``training.Stack`` holds models of one architecture, so a cohort's members are
grouped by their agent's spec, each group one stack; a group of one is a device's path
(the operations an agent alone does). Agents with BatchNorm (MNIST's) train one at a
time: a cohort's padded rows would enter their batch statistics; they are evaluated
together (evaluation reads their running statistics, not the batch's).

``Agents.train`` is the family's training loop, made of ``fedpers.training``'s steps
(each member's batch order, draws and dropout masks from its own generator, padding
masked, a member that has finished not moved), for objectives that also return a
penalty per step (recorded), a draw per step that only some members take (Sheaf-FRL's
pilot batch, for the agents with edges), and tensors beyond the model stepped by an
optimizer and clipped on their own (CoMFed's projection). What an update writes into
its members' states is written at its end (``Agents.commit``): an update that raises
for a cohort leaves every member as it was, for ``clients.client_app`` to run each one
alone.

The sheaf family names this module as its update (``FamilySpec.update``) and the rows'
modules import it inside their update functions: the ClientApp imports it on the
device, so the server never imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn
from torch.nn import functional as F

from fedpers import protocol, records, sheaf, training, update
from fedpers.cohort import Arrays, Cohort, Metrics, Reply
from fedpers.data.client import pilot_data
from fedpers.families import sheaf as sheaf_family
from fedpers.models.agents import build_agent, pilot_whitening
from fedpers.protocol import MODEL_PARTS
from fedpers.seeding import int_seed
from fedpers.training import Batch, EvalStats, Stack, View, per_client, training_mode
from fedpers.update import Local

IGNORE = -100  # the label of a padded row, which F.cross_entropy leaves out
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
Objective = Callable[[View, tuple[Any, ...], Any], tuple[torch.Tensor, torch.Tensor]]
"""One member's ``(loss, penalty)`` of a step: ``training.Objective``'s arguments, and a
second value recorded per step (Sheaf-FRL's gluing penalty, CoMFed's consensus)."""


@dataclass
class Steps:
    """What one member's epochs did: its steps, the samples and the loss (times each
    step's samples) summed over all of them and over its last epoch's, and each step's
    penalty (also summed times the step's samples). Sums are Python floats, as a loop
    over the agent alone added ``loss.item() * len(batch)``."""

    steps: int = 0
    seen: int = 0
    total: float = 0.0
    last_seen: int = 0
    last_total: float = 0.0
    penalties: list[float] = field(default_factory=list)
    penalty_total: float = 0.0

    def add(self, loss: float, penalty: float, size: int, last: bool) -> None:
        self.steps += 1
        self.seen += size
        self.total += loss * size
        self.penalties.append(penalty)
        self.penalty_total += penalty * size
        if last:
            self.last_seen += size
            self.last_total += loss * size

    @property
    def last_loss(self) -> float:
        """The mean loss of its last epoch (NaN without a step): ``training.train``'s."""
        return self.last_total / max(self.last_seen, 1) if self.steps else math.nan

    @property
    def mean_penalty(self) -> float:
        """The mean of its steps' penalties (0 without a step)."""
        return float(np.mean(self.penalties)) if self.penalties else 0.0


@dataclass(frozen=True)
class Trained:
    """Tensors of a stack that one optimizer steps and ``sheaf-clip`` clips together;
    ``active(batch)`` (K bools), where given, the members whose loss reaches them in a
    step: the others are not moved by it (as torch's optimizer skips a tensor without
    a gradient)."""

    names: tuple[str, ...]
    active: Callable[[Batch], torch.Tensor] | None = None


class MaskedSGD(training.SGD):
    """``training.SGD`` for tensors that some members' steps do not reach: a member left
    out of a step keeps its values and its momentum, and one that has never been
    reached starts its momentum at its first step."""

    def step(
        self, grads: Sequence[torch.Tensor | None], active: torch.Tensor | None = None
    ) -> None:
        if active is None or bool(active.all()):
            super().step(grads)
            return
        if not bool(active.any()):
            return
        with torch.no_grad():
            for i, (p, grad) in enumerate(zip(self.params, grads, strict=True)):
                if grad is None:
                    continue
                where = active.view(-1, *([1] * (p.ndim - 1)))
                if self.decay[i] != 0:
                    grad = grad.add(p, alpha=self.decay[i])
                if self.momentum != 0:
                    buffer = self.buffers[i]
                    before = torch.zeros_like(grad) if buffer is None else buffer
                    moved = grad if buffer is None else buffer * self.momentum + grad
                    grad = self.buffers[i] = torch.where(where, moved, before)
                p.copy_(torch.where(where, p.add(grad, alpha=-self.lr), p))


class _Descent:
    """The steps of one ``Agents.train`` call: each ``Trained`` group's gradients (on,
    for the call), clipped per member, and its optimizer."""

    def __init__(
        self, stack: Stack, groups: Sequence[Trained], settings: training.SGDSettings, clip: float
    ) -> None:
        self.groups = []
        for group in groups:
            tensors = [stack.tensors[n] for n in group.names]
            optimizer = (MaskedSGD if group.active else training.SGD)(tensors, settings)
            self.groups.append((group, tensors, optimizer))
        self.tensors = [t for _, tensors, _ in self.groups for t in tensors]
        for t in self.tensors:
            t.requires_grad_(True)
        self.clip = clip
        self.size = stack.size

    def step(self, loss: torch.Tensor, batch: Batch) -> None:
        grads = list(torch.autograd.grad(loss.sum(), self.tensors))
        start = 0
        for group, tensors, optimizer in self.groups:
            own = grads[start : start + len(tensors)]
            start += len(tensors)
            if self.clip > 0:
                training.clip_per_client(own, self.clip)
            active = None if batch.full or self.size == 1 else batch.active
            if group.active is not None:
                active = group.active(batch) & batch.active
            optimizer.step(own, active)

    def release(self) -> None:
        for t in self.tensors:
            t.requires_grad_(False)


class Agents(Local):
    """A cohort of the sheaf family's agents: each member's model (its agent's
    architecture; what it keeps in ``context.state``), the pilots every agent holds,
    the groups of members of one architecture, and what to write into the members'
    states at the end (``writes``, ``commit``).

    Parameters
    ----------
    cohort : Cohort
        The members, the run configuration and the round's settings.
    """

    def __init__(self, cohort: Cohort) -> None:
        super().__init__(cohort)
        self.specs = sheaf_family.run_agent_specs(self.run)
        self.dims = [spec.latent for spec in self.specs]
        self.clip = sheaf_family.settings(self.run).sheaf_clip
        self.writes: list[dict[str, ArrayRecord]] = [{} for _ in self.members]

    def spec(self, k: int) -> sheaf.AgentSpec:
        """Member ``k``'s architecture."""
        return self.specs[self.members[k].partition]

    def agent(self, k: int) -> nn.Module:
        """Member ``k``'s seeded initial agent, as every process builds it."""
        run = self.run
        seed = int_seed(run.seed, "agent", self.members[k].partition)
        return build_agent(self.spec(k), run.dataset, run.num_classes, seed)

    @cached_property
    def pilots(self) -> tuple[np.ndarray, np.ndarray]:
        """The pilots every agent holds: inputs and labels."""
        return pilot_data(self.run)

    @cached_property
    def batch_norm(self) -> bool:
        """Whether the run's agents have BatchNorm layers (MNIST's)."""
        return any(isinstance(m, BATCH_NORMS) for m in self.agent(0).modules())

    @cached_property
    def train_generators(self) -> list[torch.Generator]:
        """Each member's generator of the round's training (``train``, the round)."""
        return self.generators("train", self.round)

    def groups(self, *, training: bool = False) -> list[list[int]]:
        """The members of each architecture (indices, in cohort order); for training,
        BatchNorm agents one at a time (padded rows would enter batch statistics)."""
        alone = training and self.batch_norm
        found: dict[Any, list[int]] = {}
        for k in range(self.size):
            found.setdefault((self.spec(k), k if alone else None), []).append(k)
        return list(found.values())

    def models(self, group: Sequence[int], extra: Callable[[int], Arrays] | None = None) -> Stack:
        """The group's agents: what each keeps in ``context.state``, else its seeded
        initial model; ``extra(k)``, where given, member ``k``'s tensors beyond the
        model (by name, trained beside it: CoMFed's projection)."""
        template = self.agent(group[0])
        arrays = []
        for i, k in enumerate(group):
            own = update.kept(self.members[k], sheaf_family.STATE_MODEL)
            if not own and i > 0:
                own = {n: v.numpy() for n, v in self.agent(k).state_dict().items()}
            arrays.append({**own, **(extra(k) if extra else {})})
        for name, value in (extra(group[0]) if extra else {}).items():
            template.register_parameter(name, nn.Parameter(torch.as_tensor(value).clone()))
        return self.stack(template, arrays)

    def each(
        self,
        function: Callable[[list[int], Stack], Sequence[Any]],
        *,
        training: bool = False,
        extra: Callable[[int], Arrays] | None = None,
    ) -> list[Any]:
        """``function(group, stack)`` for every group of one architecture (its models,
        ``models``), its results (one per member of the group) in cohort order."""
        out: list[Any] = [None] * self.size
        for group in self.groups(training=training):
            for k, result in zip(group, function(group, self.models(group, extra)), strict=True):
                out[k] = result
        return out

    def keep(self, group: Sequence[int], stack: Stack) -> None:
        """Each member's model, to be written into its state (``commit``)."""
        for k, arrays in zip(group, stack.arrays(MODEL_PARTS), strict=True):
            self.writes[k][sheaf_family.STATE_MODEL] = update.to_record(arrays)

    def commit(self) -> None:
        """Write what the update keeps into every member's ``context.state``."""
        for member, writes in zip(self.members, self.writes, strict=True):
            for key, record in writes.items():
                member.state[key] = record

    def floats(self, values: Sequence[Any]) -> torch.Tensor:
        """Every member's array stacked (K, ...) on the device, in the cohort's precision
        (the models' float32 by default)."""
        stacked = torch.as_tensor(np.stack(values))
        return stacked.to(self.device, self.dtype or torch.float32)

    # --------------------------------------------------------------------- training
    def train(
        self,
        group: Sequence[int],
        stack: Stack,
        objective: Objective,
        *,
        inputs: Any = None,
        draws: Sequence[Callable[[torch.Generator], Any] | None] | None = None,
        trained: Sequence[Trained] | None = None,
    ) -> list[Steps]:
        """The group's epochs of the round on ``objective`` (one member's ``(loss,
        penalty)``; ``inputs``: the per-member tensors it reads), in place in ``stack``,
        from each member's training generator. ``draws[i]``, where given, is member
        ``i``'s own draw for each step (after its batch order); ``trained``: the tensors
        stepped (by default the whole model), each group clipped at ``sheaf-clip``."""
        data = self.cohort_data(
            [self.data[k].x_train for k in group], [self.data[k].y_train for k in group]
        )
        generators = [self.train_generators[k] for k in group]
        epochs = records.config_int(self.config, protocol.EPOCHS)
        settings = self.sgd()
        steps = [Steps() for _ in group]
        if epochs == 0:
            return steps
        seeds = [
            training.dropout_seed(g) if n else None
            for g, n in zip(generators, data.counts, strict=True)
        ]
        plans = [
            training.client_steps(n, epochs, settings.batch_size, g, extra=draw)
            for n, g, draw in zip(
                data.counts, generators, draws or [None] * len(group), strict=True
            )
        ]
        length = max((len(p) for p in plans), default=0)
        if length == 0:
            return steps
        # recorded on a copy: a training-mode pass moves BatchNorm's running statistics
        masks = training.DropoutMasks(stack, seeds, data.x[0]) if stack.has_dropout else None
        descent = _Descent(
            stack, trained or [Trained(tuple(stack.names(MODEL_PARTS)))], settings, self.clip
        )
        try:
            with training_mode(stack.template, True):
                for s in range(length):
                    batch = training.assemble(data, [p[s] if s < len(p) else None for p in plans])
                    if masks is not None:
                        batch.masks = masks.draw(batch.sizes, batch.x.shape[1], batch.x)
                    loss, penalty = training.step_losses(stack, objective, batch, inputs)  # type: ignore[arg-type]
                    descent.step(loss, batch)
                    _record(steps, loss, penalty, batch)
        finally:
            descent.release()
        return steps

    def train_private(self, group: Sequence[int], stack: Stack) -> list[Metrics]:
        """The group's epochs on its private loss (the cross-entropy); each member's
        metrics: its samples, its last epoch's loss and a penalty of 0."""
        steps = self.train(group, stack, private)
        return [
            {
                protocol.NUM_EXAMPLES: float(len(self.data[k].y_train)),
                protocol.LOSS: s.last_loss,
                sheaf_family.PENALTY: 0.0,
            }
            for k, s in zip(group, steps, strict=True)
        ]

    # ------------------------------------------------------------------- latents
    @torch.no_grad()
    def latents(self, stack: Stack, xs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Each member's encoder outputs (evaluation mode) of its inputs ``xs[i]`` (by
        default the pilots), in float64."""
        if xs is None:
            inputs, counts = self.pilot_inputs(stack.size), [len(self.pilots[1])] * stack.size
        else:
            data = self.cohort_data(list(xs), [np.zeros(len(x), dtype=np.int64) for x in xs])
            inputs, counts = data.x, data.counts

        def body(tensors: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return View(stack.template, tensors).part(protocol.BODY, x)

        with training_mode(stack.template, False):
            z = per_client(body, stack.tensors, inputs, size=stack.size)
        return [z[i, :n].cpu().numpy().astype(float) for i, n in enumerate(counts)]

    @cached_property
    def pilot_tensor(self) -> torch.Tensor:
        """The pilots' inputs on the device, in the cohort's precision."""
        return torch.as_tensor(self.pilots[0]).to(self.device, self.dtype or torch.float32)

    def pilot_inputs(self, size: int) -> torch.Tensor:
        """The pilots' inputs for every member (K, P, ...; one copy, expanded)."""
        return self.pilot_tensor.expand(size, *self.pilot_tensor.shape)

    @torch.no_grad()
    def own_pilots(self, stack: Stack) -> list[np.ndarray]:
        """Each member's pilot latents whitened by their own statistics (evaluation
        mode, float64): what Sheaf-FRL's maps are fitted on."""

        def whitened(tensors: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return pilot_whitening(View(stack.template, tensors).part(protocol.BODY, x))[0]

        with training_mode(stack.template, False):
            w = per_client(whitened, stack.tensors, self.pilot_inputs(stack.size), size=stack.size)
        return [w[i].cpu().numpy().astype(float) for i in range(stack.size)]

    @torch.no_grad()
    def predict(self, stack: Stack, i: int, latents: np.ndarray) -> np.ndarray:
        """The classes member ``i``'s head gives raw latents (evaluation mode)."""
        model = View(stack.template, {n: t[i] for n, t in stack.tensors.items()})
        z = torch.as_tensor(latents).to(self.device, self.dtype or torch.float32)
        with training_mode(stack.template, False):
            return model.part(protocol.HEAD, z).argmax(dim=1).cpu().numpy()

    def whitening(self, stack: Stack, group: Sequence[int], mode: str) -> list[sheaf.Whitening]:
        """Each member's whitening statistics, fitted on its pilots' latents (``mode``
        ``pilots``) or else its training data's."""
        if mode == sheaf_family.Whitening.PILOTS:
            sources = self.latents(stack)
        else:
            sources = self.latents(stack, [self.data[k].x_train for k in group])
        return [sheaf.Whitening.fit(z) for z in sources]

    # --------------------------------------------------------------- parameters
    def parameter_vectors(self, stack: Stack) -> list[np.ndarray]:
        """Each member's trainable parameters as one vector, in ``model.parameters()``
        order (Sheaf-FMTL's theta)."""
        with torch.no_grad():
            flat = torch.cat(
                [stack.tensors[n].reshape(stack.size, -1) for n in stack.parameter_names], dim=1
            )
        return [row.cpu().numpy() for row in flat]

    def set_parameters(self, stack: Stack, i: int, theta: np.ndarray) -> None:
        """Member ``i``'s parameters from one vector (``parameter_vectors``' order),
        rounded to the stack's precision."""
        values = torch.as_tensor(theta)
        start = 0
        with torch.no_grad():
            for name in stack.parameter_names:
                target = stack.tensors[name][i]
                target.copy_(values[start : start + target.numel()].view_as(target))
                start += target.numel()


def _record(steps: list[Steps], loss: torch.Tensor, penalty: torch.Tensor, batch: Batch) -> None:
    losses = loss.detach().to(torch.float64).cpu()
    penalties = penalty.detach().to(torch.float64).cpu()
    for k, size in enumerate(batch.sizes):
        if size:
            steps[k].add(float(losses[k]), float(penalties[k]), size, batch.last_epoch[k])


def private(model: View, batch: tuple[Any, ...], inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The private loss: the mean cross-entropy of the batch's real rows (the
    operations of the loop an agent alone ran); no penalty."""
    loss = training.cross_entropy(model, batch, None)
    return loss, torch.zeros_like(loss)


def mean_cross_entropy(
    logits: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """The mean cross-entropy of a batch's real rows (``weight`` > 0; ``count`` of
    them): on a batch without padding the bits of ``F.cross_entropy(logits, y)``, which
    FedProto's and CoMFed's loops took."""
    labels = torch.where(weight > 0, y, torch.full_like(y, IGNORE))
    return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum") / count


# ------------------------------------------------------------- the family's update
def fit(cohort: Cohort) -> list[Reply]:
    """Every agent's epochs on its private loss; its model kept in its state."""
    local = Agents(cohort)

    def one(group: list[int], stack: Stack) -> list[Reply]:
        metrics = local.train_private(group, stack)
        local.keep(group, stack)
        return [({}, m) for m in metrics]

    replies = local.each(one, training=True)
    local.commit()
    return replies


def private_metrics(stats: EvalStats) -> Metrics:
    """A private test's reply: weight 1 (the paper averages accuracies over agents, not
    over samples), the accuracy and the test samples behind it."""
    return {
        protocol.NUM_EXAMPLES: 1.0,
        protocol.ACCURACY: stats.accuracy,
        sheaf_family.TEST_EXAMPLES: float(stats.num_examples),
    }


def evaluate(cohort: Cohort) -> list[Metrics]:
    """Private accuracy, or (config ``communication = 1``) the accuracy of decoding each
    neighbour's transported test latents with the agent's head."""
    local = Agents(cohort)
    if records.config_int(local.config, sheaf_family.COMMUNICATION, default=0):
        return local.each(communication(local))

    def one(group: list[int], stack: Stack) -> list[Metrics]:
        data = local.cohort_data(
            [local.data[k].x_test for k in group], [local.data[k].y_test for k in group]
        )
        return [private_metrics(s) for s in training.evaluate(stack, data)]

    return local.each(one)


def communication(local: Agents) -> Callable[[list[int], Stack], list[Metrics]]:
    """The communication test of a group: each member fits its whitening (the config's
    ``whitening``) and decodes each neighbour's test latents (``decoder``)."""
    mode = str(local.config.get(sheaf_family.WHITENING, sheaf_family.Whitening.PILOTS))

    def one(group: list[int], stack: Stack) -> list[Metrics]:
        whitenings = local.whitening(stack, group, mode)
        pilots = local.latents(stack)
        return [
            decoding_metrics(
                local.members[k].arrays,
                sheaf_family.PILOTS,
                decoder(local, k, whitenings[i], whitenings[i].whiten(pilots[i])),
                head(local, stack, i),
            )
            for i, k in enumerate(group)
        ]

    return one


def decoder(
    local: Agents, k: int, whitening: sheaf.Whitening, own: np.ndarray
) -> Callable[[int], np.ndarray]:
    """Member ``k``'s decoding of a sender's test latents into its raw latents: the
    edge's map fitted on the sender's pilots and its own (``own``, whitened), the
    latents brought into its frame and coloured by its statistics."""
    agent, arrays = local.members[k].partition, local.members[k].arrays

    def decode(sender: int) -> np.ndarray:
        theirs = arrays[sheaf_family.from_agent(sheaf_family.PILOTS, sender)]
        latents = arrays[sheaf_family.from_agent(sheaf_family.LATENTS, sender)]
        edge = sheaf_family.restriction(agent, sender, own, theirs, local.dims)
        return whitening.colour(
            sheaf_family.from_neighbour(agent, sender, latents, edge, local.dims)
        )

    return decode


def head(local: Agents, stack: Stack, i: int) -> Callable[[np.ndarray], np.ndarray]:
    """Member ``i``'s head on raw latents: the classes it predicts."""
    return lambda latents: local.predict(stack, i, latents)


def decoding_metrics(
    arrays: Arrays,
    kind: str,
    decode: Callable[[int], np.ndarray],
    predict: Callable[[np.ndarray], np.ndarray],
) -> Metrics:
    """A communication test's reply: for each sender of an array ``kind.<sender>`` (in
    the order of their names) with test labels, the accuracy of the head on its
    decoded latents (``edge.<sender>``), and their mean (NaN without any)."""
    metrics: Metrics = {protocol.NUM_EXAMPLES: 1.0}
    accuracies = []
    for name in sorted(arrays):
        found, sender = sheaf_family.agent_of(name)
        if found != kind:
            continue
        labels = arrays[sheaf_family.from_agent(sheaf_family.LABELS, sender)]
        if len(labels) == 0:
            continue
        accuracy = float(np.mean(predict(decode(sender)) == labels))
        metrics[sheaf_family.edge_metric(sender)] = accuracy
        accuracies.append(accuracy)
    metrics[protocol.ACCURACY] = float(np.mean(accuracies)) if accuracies else float("nan")
    return metrics


def pilots_message(cohort: Cohort) -> list[Reply]:
    """Each agent's current pilot latents, whitened by their own statistics; its model
    kept (the seeded one, before its first round)."""
    local = Agents(cohort)

    def one(group: list[int], stack: Stack) -> list[Reply]:
        local.keep(group, stack)
        return [({sheaf_family.PILOTS: own}, {}) for own in local.own_pilots(stack)]

    replies = local.each(one)
    local.commit()
    return replies


def latents_message(cohort: Cohort) -> list[Reply]:
    """Each agent's pilots and test latents, whitened as the config's ``whitening``
    says, and its test labels: for its neighbours' communication accuracy."""
    local = Agents(cohort)
    mode = str(local.config.get(sheaf_family.WHITENING, sheaf_family.Whitening.PILOTS))

    def one(group: list[int], stack: Stack) -> list[Reply]:
        whitenings = local.whitening(stack, group, mode)
        pilots = local.latents(stack)
        tests = local.latents(stack, [local.data[k].x_test for k in group])
        return [
            (
                {
                    sheaf_family.PILOTS: w.whiten(p),
                    sheaf_family.LATENTS: w.whiten(t),
                    sheaf_family.LABELS: local.data[k].y_test.astype(np.int64),
                },
                {},
            )
            for w, p, t, k in zip(whitenings, pilots, tests, group, strict=True)
        ]

    return local.each(one)
