"""The one training loop and the one evaluation loop, for a cohort of clients.

A cohort is K clients of one model architecture trained together: their models are one
``Stack`` (every parameter and buffer stacked along a first axis of length K), their
data one ``CohortData`` (padded to the longest), and every step of ``train`` is one
computation for all of them. An algorithm writes its local update once, for a cohort;
a device runs it with K = 1, a simulation with whole cohorts (``fedpers.cohort``).

What keeps a client's result its own, whatever cohort it trains in:

- **Its own random streams.** Each client passes its own ``torch.Generator``; its
  mini-batch order, augmentation and any per-step draws are taken from it in the order a
  loop over that client alone would take them (``client_steps``), and the masks of its
  dropout layers from a generator seeded by one draw from it (``DropoutMasks``). Nothing
  draws from torch's global generator.
- **Its own steps.** Clients with fewer samples take fewer and shorter steps: a step's
  missing rows are masked out of the loss (``Batch.weight``), and a client without a
  batch in a step is not moved by it (``SGD.step``'s ``active``), neither by weight decay
  nor by momentum.
- **Its own gradient.** The cohort's loss is the sum of the clients' losses, and each
  client's parameters enter only its own loss, so the gradient of the sum is each
  client's own gradient; clipping (``max_grad_norm``) is per client.

With K = 1 every function below does the operations a loop over that one client does
(no padding, no vmap: ``per_client`` calls the client's function directly), so a
device's update is the same bits as the loop fedpers ran before cohorts
(tests/fedpers/reference_loop.py keeps that loop as the oracle of
tests/fedpers/test_training.py). With K > 1 the model is mapped over the clients with
``torch.func.vmap``, and results agree with K = 1 up to floating-point reassociation
(the cohort tests compare them to 1e-10, relative, in float64).

Parts that are not trainable are truly frozen: autograd computes no gradient for them
and the optimizer never sees them, so neither momentum nor weight decay can move them.

The optimizer is ``SGD`` below, not ``torch.optim.SGD``: the same update (on the CPU the
very same tensor operations, so the same bits: the tests check it against torch's),
over stacked tensors. Creating a ``torch.optim`` optimizer imports ``torch._dynamo``
(2-5 s of processor time) in every fresh process, and its ``step`` wrapper cost more
than the update itself for the small models here.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.func import vmap
from torch.nn import functional as F
from torch.utils import _pytree as pytree


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when a GPU is visible, else the CPU; ``cpu`` or ``cuda`` as asked.

    Raises
    ------
    ValueError
        For ``cuda`` on a machine without a visible GPU.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "run-config key 'device' = 'cuda' but no GPU is visible; use 'auto' or 'cpu'"
        )
    return torch.device(name)


@dataclass(frozen=True)
class SGDSettings:
    """Local optimizer settings (a fresh SGD optimizer per ``train`` call).

    Parameters
    ----------
    lr : float
        Learning rate.
    momentum : float
        Heavy-ball momentum.
    weight_decay : float
        L2 penalty on weights (tensors with 2 or more dimensions), not on biases.
    batch_size : int
        Mini-batch size.
    """

    lr: float
    momentum: float
    weight_decay: float
    batch_size: int


# ----------------------------------------------------------------------------- models
class ReplayDropout(nn.Module):
    """``nn.Dropout`` whose masks are given, not drawn: in training mode it multiplies
    by the next mask of the current ``replay`` (drawn by ``DropoutMasks`` from the
    client's own generator) divided by ``1 - p``, the operations and bits of torch's
    dropout on the CPU (the mask divided first: ``x * mask * (1 / (1 - p))`` differs
    from it in the last bit for some ``p``, 0.15 among the Sheaf-FRL agents'); in
    evaluation mode it is the identity."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        masks = _MASKS.get()
        if masks is None:
            raise RuntimeError(
                "a dropout layer ran in training mode outside fedpers.training.replay: a "
                "cohort's forward passes take their masks from DropoutMasks"
            )
        if masks.recording is not None:
            masks.recording.append((self.p, tuple(x.shape[1:])))
            return x
        return x * next(masks.queue).div(1.0 - self.p)


@dataclass
class _Replay:
    queue: Iterator[torch.Tensor]
    recording: list[tuple[float, tuple[int, ...]]] | None = None


_MASKS: contextvars.ContextVar[_Replay | None] = contextvars.ContextVar("masks", default=None)


@contextlib.contextmanager
def replay(masks: Sequence[torch.Tensor]) -> Iterator[None]:
    """Within it, the dropout layers of a forward pass take ``masks``, in order."""
    token = _MASKS.set(_Replay(iter(masks)))
    try:
        yield
    finally:
        _MASKS.reset(token)


def _template(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every ``nn.Dropout`` replaced by a ``ReplayDropout``: the
    module a cohort's stacked tensors are called through."""
    template = copy.deepcopy(model)
    for parent in list(template.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                setattr(parent, name, ReplayDropout(child.p))
    return template


class Stack:
    """K models of one architecture: a template module and every parameter and buffer
    stacked along a first axis of length K (``tensors``, named as in ``state_dict``).

    Parameters
    ----------
    template : nn.Module
        The architecture (its own values are never used); see ``Stack.of``.
    tensors : dict of str to torch.Tensor
        Every entry of the template's ``state_dict``, with a leading axis K.
    """

    def __init__(
        self,
        template: nn.Module,
        tensors: dict[str, torch.Tensor],
        stored: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        self.template = template
        self.tensors = tensors
        self.size = len(next(iter(tensors.values()))) if tensors else 0
        self.parameter_names = [name for name, _ in template.named_parameters()]
        # the dtypes values leave in (``arrays``): the model's own, whatever the
        # precision of the computation
        self.stored = (
            dict(stored) if stored is not None else {n: t.dtype for n, t in tensors.items()}
        )

    @classmethod
    def of(
        cls,
        model: nn.Module,
        arrays: Sequence[Mapping[str, np.ndarray]],
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> Stack:
        """K copies of ``model``, client ``k``'s values overwritten by ``arrays[k]`` (any
        subset of the model's names; the others keep ``model``'s values). ``dtype``
        casts the floating-point tensors (float64 for the cohort tests)."""
        state = model.state_dict()
        for k, given in enumerate(arrays):
            unknown = sorted(set(given) - set(state))
            if unknown:
                raise KeyError(f"client {k}: the model has no parameter {unknown[:3]}")
        tensors = {}
        for name, value in state.items():
            rows = []
            for given in arrays:
                if name in given:
                    row = torch.tensor(given[name])  # a copy: the arrays may be read-only
                    if tuple(row.shape) != tuple(value.shape):
                        raise ValueError(
                            f"parameter '{name}' has shape {tuple(value.shape)}, "
                            f"received {tuple(row.shape)}"
                        )
                    rows.append(row.to(value.dtype))
                else:
                    rows.append(value.detach())
            stacked = torch.stack(rows) if rows else value.detach()[None][:0]
            if dtype is not None and stacked.is_floating_point():
                stacked = stacked.to(dtype)
            tensors[name] = stacked.to(device) if device is not None else stacked
        template = _template(model)
        if dtype is not None:
            template = template.to(dtype)
        if device is not None:
            template = template.to(device)
        return cls(template, tensors, {n: v.dtype for n, v in state.items()})

    def names(self, parts: Sequence[str]) -> list[str]:
        """The parameters (not buffers) whose first name component is one of ``parts``."""
        return [n for n in self.parameter_names if n.split(".", 1)[0] in parts]

    def arrays(self, parts: Sequence[str]) -> list[dict[str, np.ndarray]]:
        """Every client's entries of ``parts`` (parameters and buffers) as numpy arrays,
        in the model's own dtypes (whatever the precision of the computation)."""
        chosen = [n for n in self.tensors if n.split(".", 1)[0] in parts]
        host = {n: self.tensors[n].detach().to(self.stored[n]).cpu().numpy() for n in chosen}
        return [{n: host[n][k].copy() for n in chosen} for k in range(self.size)]

    def load(self, k: int, model: nn.Module) -> None:
        """Copy client ``k``'s values into ``model`` (a module of the same architecture)."""
        state = model.state_dict()
        with torch.no_grad():
            for name, value in self.tensors.items():
                state[name].copy_(value[k])

    def copy(self) -> Stack:
        """A stack of the same architecture with copies of the tensors."""
        tensors = {n: t.detach().clone() for n, t in self.tensors.items()}
        return Stack(self.template, tensors, self.stored)

    def select(self, index: torch.Tensor) -> Stack:
        """The clients ``index`` (copies), in that order."""
        return Stack(self.template, {n: t[index] for n, t in self.tensors.items()}, self.stored)

    @property
    def has_dropout(self) -> bool:
        return any(isinstance(m, ReplayDropout) and m.p > 0 for m in self.template.modules())

    @property
    def has_batch_statistics(self) -> bool:
        """Whether a training step normalizes by its batch's statistics (BatchNorm):
        then a client's padded rows would enter them, so a cohort trains one client at a
        time (``train``)."""
        return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.template.modules())


class View:
    """One client's model inside a cohort computation: called as the model, or one of
    its parts (``part("body", x)``), with that client's tensors (under ``vmap``, the
    tensors of every client at once)."""

    def __init__(self, template: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
        self.template = template
        self.tensors = tensors

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return call_with(self.template, self.tensors, x)

    def part(self, part: str, x: torch.Tensor) -> torch.Tensor:
        prefix = part + "."
        own = {k[len(prefix) :]: v for k, v in self.tensors.items() if k.startswith(prefix)}
        return call_with(getattr(self.template, part), own, x)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


_SLOTS: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[dict[str, Any], str]]] = (
    weakref.WeakKeyDictionary()
)


def call_with(module: nn.Module, tensors: Mapping[str, torch.Tensor], x: torch.Tensor) -> Any:
    """``module(x)`` with its parameters and buffers ``tensors`` (by ``state_dict``
    name; the others keep the module's own): ``torch.func.functional_call`` without its
    per-call search for tied weights (a stack has none: every name has its own stacked
    tensor) and module walk, which cost more than a small model's forward pass. Each
    name's slot (the submodule's ``_parameters`` or ``_buffers`` entry) is found once per
    module and the tensors are put there for the call, the module's own restored after,
    as ``functional_call`` does."""
    slots = _SLOTS.get(module)
    if slots is None:
        slots = {}
        for prefix, sub in module.named_modules(remove_duplicate=False):
            for table in (sub._parameters, sub._buffers):
                for name in table:
                    slots[f"{prefix}.{name}" if prefix else name] = (table, name)
        _SLOTS[module] = slots
    saved = []
    try:
        for name, tensor in tensors.items():
            if name not in slots:
                raise KeyError(f"the model has no parameter or buffer '{name}'")
            table, key = slots[name]
            saved.append((table, key, table[key]))
            table[key] = tensor
        return module(x)
    finally:
        for table, key, own in reversed(saved):
            table[key] = own


def per_client(
    fn: Callable[..., Any], tensors: Mapping[str, torch.Tensor], *args: Any, size: int
) -> Any:
    """``fn(client_tensors, *client_args)`` for every client, stacked: the arguments'
    leaves are tensors with a leading axis ``size`` (any nesting of lists, tuples and
    dicts). ``torch.func.vmap`` over the clients when ``size > 1``; for one client a
    plain call on its slice, the operations a loop over that client does. ``fn``
    returns a tensor or a tuple of tensors; the results have the leading axis."""
    if size == 1:
        own = {name: value.squeeze(0) for name, value in tensors.items()}
        result = fn(own, *(_first(a) for a in args))
        if isinstance(result, torch.Tensor):
            return result.unsqueeze(0)
        return pytree.tree_map(lambda r: r.unsqueeze(0), result)
    in_dims = (0, *(None if a is None else 0 for a in args))
    return vmap(fn, in_dims=in_dims, randomness="error")(dict(tensors), *args)


def _first(tree: Any) -> Any:
    """The one client's slice of every leaf of ``tree`` (a view: its backward is a
    view too, not the copy into zeros that indexing's is)."""
    if tree is None:
        return None
    if isinstance(tree, torch.Tensor):
        return tree.squeeze(0)
    if type(tree) in (list, tuple):
        return type(tree)(_first(leaf) for leaf in tree)
    return pytree.tree_map(
        lambda leaf: (
            leaf.squeeze(0) if isinstance(leaf, torch.Tensor) else None if leaf is None else leaf[0]
        ),
        tree,
    )


# --------------------------------------------------------------------------- dropout
class DropoutMasks:
    """Each client's dropout masks, from its own generator, in the order and shapes
    torch's global generator would give them to a model trained alone: every training
    forward pass draws one mask per dropout layer, in the order the layers run, of the
    shape of that layer's input (the batch's rows, then the layer's own shape)."""

    def __init__(self, stack: Stack, seeds: Sequence[int | None], sample: torch.Tensor) -> None:
        self.generators = [
            None if seed is None else torch.Generator().manual_seed(seed) for seed in seeds
        ]
        self.layers: list[tuple[float, tuple[int, ...]]] = []
        if stack.has_dropout:
            recording: list[tuple[float, tuple[int, ...]]] = []
            token = _MASKS.set(_Replay(iter(()), recording))
            try:
                with torch.no_grad(), training_mode(stack.template, True):
                    # copies: a training-mode pass moves BatchNorm's running statistics
                    first = {n: t[0].clone() for n, t in stack.tensors.items()}

                    call_with(stack.template, first, sample[:1])
            finally:
                _MASKS.reset(token)
            self.layers = recording

    def draw(self, sizes: Sequence[int], width: int, like: torch.Tensor) -> list[torch.Tensor]:
        """The masks of one training forward pass of every client: client ``k`` draws
        ``sizes[k]`` rows (none for 0), padded with zeros to ``width`` rows."""
        masks = []
        for p, shape in self.layers:
            rows = []
            for generator, size in zip(self.generators, sizes, strict=True):
                mask = torch.zeros((width, *shape), dtype=like.dtype)
                if size and generator is not None:
                    mask[:size] = torch.empty((size, *shape), dtype=like.dtype).bernoulli_(
                        1 - p, generator=generator
                    )
                rows.append(mask)
            masks.append(torch.stack(rows).to(like.device))
        return masks


@contextlib.contextmanager
def training_mode(module: nn.Module, mode: bool) -> Iterator[None]:
    """Within it, ``module`` (and every submodule) is in training mode ``mode``; each
    module's own mode is restored after."""
    before = [(m, m.training) for m in module.modules()]
    module.train(mode)
    try:
        yield
    finally:
        for m, was in before:
            m.training = was


def dropout_seed(generator: torch.Generator) -> int:
    """The seed of a client's dropout masks: one draw from its training generator,
    before any other (as every loop fedpers ran took it)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))


# ------------------------------------------------------------------------------ data
@dataclass
class CohortData:
    """K clients' samples on one device, padded to the longest: ``x`` (K, N, ...),
    ``y`` (K, N) and the real counts."""

    x: torch.Tensor
    y: torch.Tensor
    counts: list[int]

    @classmethod
    def of(
        cls,
        xs: Sequence[np.ndarray | torch.Tensor],
        ys: Sequence[np.ndarray | torch.Tensor],
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> CohortData:
        """Stack the clients' arrays, zero-padded (the counts say which rows are real)."""
        counts = [len(y) for y in ys]
        width = max(counts, default=0)
        inputs = [torch.as_tensor(x) for x in xs]
        labels = [torch.as_tensor(y) for y in ys]
        if all(c == width for c in counts):
            x, y = torch.stack(inputs), torch.stack(labels)
        else:
            x = torch.zeros((len(inputs), width, *inputs[0].shape[1:]), dtype=inputs[0].dtype)
            y = torch.zeros((len(labels), width), dtype=labels[0].dtype)
            for k, (xk, yk) in enumerate(zip(inputs, labels, strict=True)):
                x[k, : len(yk)] = xk
                y[k, : len(yk)] = yk
        if dtype is not None and x.is_floating_point():
            x = x.to(dtype)
        if device is not None:
            x, y = x.to(device), y.to(device)
        return cls(x, y, counts)

    @property
    def size(self) -> int:
        return len(self.counts)


class Augment(Protocol):
    """A training-time transform of a batch: its random parameters are drawn per
    client from the client's generator (``draw``), then applied to the cohort's batch
    (``apply``, rows of padding included)."""

    def draw(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        """The parameters of ``n`` samples."""
        ...

    def apply(self, xb: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``xb`` (K, B, ...) transformed by ``params`` (each (K, B))."""
        ...


@dataclass(frozen=True)
class RandomCropFlip:
    """CIFAR augmentation of the FedRep paper: random crop with zero padding, h-flip."""

    padding: int = 4

    def draw(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        dy = torch.randint(0, 2 * self.padding + 1, (n,), generator=generator)
        dx = torch.randint(0, 2 * self.padding + 1, (n,), generator=generator)
        flip = torch.rand(n, generator=generator) < 0.5
        return dy, dx, flip

    def apply(self, xb: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
        shape = xb.shape
        flat = xb.reshape(-1, *shape[2:])
        dy, dx, flip = (p.reshape(-1).to(xb.device) for p in params)
        n, channels, h, w = flat.shape
        pad = self.padding
        padded = F.pad(flat, (pad, pad, pad, pad))
        rows = (dy[:, None] + torch.arange(h, device=xb.device)[None, :])[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w, device=xb.device)[None, :])[:, None, None, :]
        batch = torch.arange(n, device=xb.device)[:, None, None, None]
        chans = torch.arange(channels, device=xb.device)[None, :, None, None]
        out = padded[batch, chans, rows, cols]
        out[flip] = out[flip].flip(-1)
        return out.reshape(shape)

    def __call__(self, xb: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One client's batch (B, ...) augmented with draws from ``generator``."""
        params = self.draw(len(xb), generator)
        return self.apply(xb[None], tuple(p[None] for p in params))[0]


def random_crop_flip(padding: int = 4) -> RandomCropFlip:
    """CIFAR augmentation of the FedRep paper: random crop with zero padding, h-flip."""
    return RandomCropFlip(padding)


# --------------------------------------------------------------------------- batches
@dataclass
class ClientStep:
    """One client's mini-batch of one step: its sample indices, its augmentation's and
    its objective's draws, and whether it is in the client's last epoch."""

    index: torch.Tensor
    augment: tuple[torch.Tensor, ...] | None = None
    extra: Any = None
    last_epoch: bool = True


def client_steps(
    count: int,
    epochs: int,
    batch_size: int,
    generator: torch.Generator,
    *,
    augment: Augment | None = None,
    extra: Callable[[torch.Generator], Any] | None = None,
) -> list[ClientStep]:
    """One client's mini-batches of ``epochs`` passes over ``count`` samples, drawn from
    its generator in the order a loop over it alone draws them: each pass's order when
    the pass begins, then for each batch its augmentation, then ``extra`` (an
    objective's own draw, e.g. a batch of pilots). None without samples."""
    steps = []
    for epoch in range(epochs if count else 0):
        order = torch.randperm(count, generator=generator)
        for start in range(0, count, batch_size):
            index = order[start : start + batch_size]
            drawn = augment.draw(len(index), generator) if augment is not None else None
            more = extra(generator) if extra is not None else None
            steps.append(ClientStep(index, drawn, more, epoch == epochs - 1))
    return steps


@dataclass
class Batch:
    """One step of a cohort: every client's mini-batch (K, B, ...), padded.

    ``weight`` is 1 on a client's real rows and 0 on padding (times the samples'
    weights where the loss weighs them); ``count`` the client's real rows (at least 1,
    so that a client without a batch has a loss of 0, not NaN); ``active`` which clients
    have a batch; ``sizes`` their batch sizes (0: none).
    """

    x: torch.Tensor
    y: torch.Tensor
    weight: torch.Tensor
    count: torch.Tensor
    active: torch.Tensor
    sizes: list[int]
    index: torch.Tensor
    extra: Any = None
    last_epoch: list[bool] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)

    @property
    def full(self) -> bool:
        """Whether every client has a batch of the same size (nothing to mask)."""
        return len(set(self.sizes)) == 1 and self.sizes[0] > 0


class Plan:
    """Every client's mini-batches of a local update, stacked by step: ``index`` (S, K,
    B) sample indices (zero-padded), ``sizes`` (S, K) batch sizes (0: no batch for that
    client in that step), ``last`` (S, K) whether the step is in the client's last
    epoch, and the augmentation's and objective's draws stacked alike. Built once per
    local update from each client's steps (``client_steps``), so that a step of the
    cohort indexes tensors instead of walking its clients.

    Parameters
    ----------
    steps : sequence of sequences of ClientStep
        Each client's steps, in order.
    """

    def __init__(self, steps: Sequence[Sequence[ClientStep]]) -> None:
        clients = len(steps)
        self.length = max((len(own) for own in steps), default=0)
        width = max((len(step.index) for own in steps for step in own), default=0)
        self.index = torch.zeros((self.length, clients, width), dtype=torch.long)
        self.sizes = torch.zeros((self.length, clients), dtype=torch.long)
        self.last = torch.zeros((self.length, clients), dtype=torch.bool)
        for k, own in enumerate(steps):
            if not own:
                continue
            self.sizes[: len(own), k] = torch.tensor([len(step.index) for step in own])
            self.last[: len(own), k] = torch.tensor([step.last_epoch for step in own])
            rows = torch.nn.utils.rnn.pad_sequence([step.index for step in own], batch_first=True)
            self.index[: len(own), k, : rows.shape[1]] = rows
        self.augment = _stacked_draws(steps, "augment", self.length, width)
        self.extra = _stacked_draws(steps, "extra", self.length, width)
        self._sizes: list[int] | None = None  # a cohort of one's, as Python numbers
        self._last: list[bool] | None = None

    @classmethod
    def draw(
        cls,
        counts: Sequence[int],
        epochs: int,
        batch_size: int,
        generators: Sequence[torch.Generator],
        *,
        augment: Augment | None = None,
        extra: Callable[[torch.Generator], Any] | None = None,
    ) -> Plan:
        """Each client's mini-batches of ``epochs`` passes (``client_steps``), drawn
        from its own generator; without augmentation or an objective's draws, only each
        epoch's order is drawn, the same draws, laid out without a step object each."""
        if augment is not None or extra is not None:
            return cls(
                [
                    client_steps(n, epochs, batch_size, g, augment=augment, extra=extra)
                    for n, g in zip(counts, generators, strict=True)
                ]
            )
        plan = cls([])
        width = min(batch_size, max(counts, default=0))
        batches = [math.ceil(n / batch_size) for n in counts]
        plan.length = epochs * max(batches, default=0)
        plan.index = torch.zeros((plan.length, len(counts), width), dtype=torch.long)
        plan.sizes = torch.zeros((plan.length, len(counts)), dtype=torch.long)
        plan.last = torch.zeros((plan.length, len(counts)), dtype=torch.bool)
        for k, (n, g) in enumerate(zip(counts, generators, strict=True)):
            if n == 0 or epochs == 0:
                continue
            orders = torch.stack([torch.randperm(n, generator=g) for _ in range(epochs)])
            steps = epochs * batches[k]
            rows = F.pad(orders, (0, batches[k] * batch_size - n)).view(steps, batch_size)
            plan.index[:steps, k] = rows[:, :width]
            sizes = torch.full((batches[k],), batch_size)
            sizes[-1] = n - (batches[k] - 1) * batch_size
            plan.sizes[:steps, k] = sizes.repeat(epochs)
            plan.last[(epochs - 1) * batches[k] : steps, k] = True
        return plan

    def __len__(self) -> int:
        return self.length

    def steps(self, k: int) -> int:
        """The steps client ``k`` takes."""
        return int((self.sizes[:, k] > 0).sum())

    def batch(
        self,
        s: int,
        data: CohortData,
        *,
        sample_weights: torch.Tensor | None = None,
        augment: Augment | None = None,
    ) -> Batch:
        """The cohort's batch of step ``s``: every client's rows of its own data."""
        if data.size == 1:
            return self._own_batch(s, data, sample_weights, augment)
        sizes = self.sizes[s].tolist()
        width = max(sizes, default=0)
        device = data.x.device
        index = self.index[s, :, :width].to(device)
        real = (torch.arange(width)[None, :] < self.sizes[s][:, None]).to(device)
        rows = torch.arange(data.size, device=device)[:, None]
        xb, yb = data.x[rows, index], data.y[rows, index]
        if augment is not None and self.augment is not None:
            xb = augment.apply(xb, tuple(p[s, :, :width] for p in self.augment))
        weight = real.to(xb.dtype if xb.is_floating_point() else torch.float32)
        if sample_weights is not None:
            weight = weight * sample_weights[rows, index]
        count = self.sizes[s].clamp(min=1).to(weight.dtype).to(device)
        extra = None if self.extra is None else pytree.tree_map(lambda t: t[s], self.extra)
        active = (self.sizes[s] > 0).to(device)
        last = self.last[s].tolist()
        return Batch(xb, yb, weight, count, active, sizes, index, extra, last)

    def _own_batch(
        self,
        s: int,
        data: CohortData,
        sample_weights: torch.Tensor | None,
        augment: Augment | None,
    ) -> Batch:
        """``batch`` for a cohort of one: the client's rows gathered as a loop over it
        gathers them, and the same tensors ``batch`` makes, without its padding masks."""
        if self._sizes is None or self._last is None:
            self._sizes = self.sizes[:, 0].tolist()
            self._last = self.last[:, 0].tolist()
        size, last = self._sizes[s], self._last[s]
        device = data.x.device
        index = self.index[s, :, :size].to(device)
        xb, yb = data.x[0][index[0]][None], data.y[0][index[0]][None]
        if augment is not None and self.augment is not None:
            xb = augment.apply(xb, tuple(p[s, :, :size] for p in self.augment))
        dtype = xb.dtype if xb.is_floating_point() else torch.float32
        weight = torch.ones((1, size), dtype=dtype, device=device)
        if sample_weights is not None:
            weight = weight * sample_weights[0][index[0]][None]
        count = torch.full((1,), max(size, 1), dtype=dtype, device=device)
        extra = None if self.extra is None else pytree.tree_map(lambda t: t[s], self.extra)
        active = torch.full((1,), size > 0, device=device)
        return Batch(xb, yb, weight, count, active, [size], index, extra, [last])


def _stacked_draws(
    steps: Sequence[Sequence[ClientStep]], name: str, length: int, width: int
) -> Any:
    """Every client's draws ``name`` of its steps (``augment``: per-sample tensors,
    padded to ``width``; ``extra``: an objective's, of equal shapes) stacked (S, K, ...);
    zeros where a client has no step; None where nobody drew."""
    drawn = [[getattr(step, name) for step in own] for own in steps]
    first = next((d for own in drawn for d in own if d is not None), None)
    if first is None:
        return None
    per_sample = name == "augment"

    def blank(leaf: torch.Tensor) -> torch.Tensor:
        shape = (length, len(steps), width) if per_sample else (length, len(steps), *leaf.shape)
        return torch.zeros(shape, dtype=leaf.dtype)

    stacked = pytree.tree_map(blank, first)
    targets = pytree.tree_leaves(stacked)
    for k, own in enumerate(drawn):
        for s, draws in enumerate(own):
            for target, leaf in zip(targets, pytree.tree_leaves(draws), strict=True):
                if per_sample:
                    target[s, k, : len(leaf)] = leaf
                else:
                    target[s, k] = leaf
    return stacked


def assemble(
    data: CohortData,
    steps: Sequence[ClientStep | None],
    *,
    sample_weights: torch.Tensor | None = None,
    augment: Augment | None = None,
) -> Batch:
    """The cohort's batch of one step from every client's ``ClientStep`` (None: no
    batch for that client)."""
    plan = Plan([[] if step is None else [step] for step in steps])
    return plan.batch(0, data, sample_weights=sample_weights, augment=augment)


# ------------------------------------------------------------------------- optimizer
class SGD:
    """Heavy-ball SGD with L2 decay on weights (not biases), over stacked tensors:
    ``torch.optim.SGD`` as fedpers used it (two parameter groups: tensors of 2 or more
    dimensions per client with ``weight_decay``, the rest without; no dampening, no
    Nesterov), its single-tensor update written out.

    For each tensor ``p`` with a gradient ``g``, in order: ``g = g + wd * p`` (a new
    tensor) when ``wd != 0``; with momentum, ``b = g`` (a copy) at the first step and
    ``b = momentum * b + g`` after, and ``g = b``; then ``p -= lr * g``. A client not
    ``active`` in a step keeps its values (its steps have ended).

    Parameters
    ----------
    params : list of torch.Tensor
        The stacked tensors it updates (leading axis K).
    settings : SGDSettings
        Learning rate, momentum and weight decay.
    stacked : bool
        Whether the tensors have the clients' axis (False: plain tensors, one client).
    """

    def __init__(
        self, params: Sequence[torch.Tensor], settings: SGDSettings, *, stacked: bool = True
    ) -> None:
        self.params = list(params)
        lead = 1 if stacked else 0
        self.decay = [settings.weight_decay if p.ndim - lead >= 2 else 0.0 for p in self.params]
        self.lr = settings.lr
        self.momentum = settings.momentum
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(
        self, grads: Sequence[torch.Tensor | None], active: torch.Tensor | None = None
    ) -> None:
        """One update of every tensor that has a gradient; with ``active`` (K bools), only
        the active clients' slices move."""
        for i, (p, grad) in enumerate(zip(self.params, grads, strict=True)):
            if grad is None:
                continue
            if self.decay[i] != 0:
                grad = grad.add(p, alpha=self.decay[i])
            if self.momentum != 0:
                buffer = self.buffers[i]
                if buffer is None:
                    buffer = self.buffers[i] = grad.detach().clone()
                else:
                    buffer.mul_(self.momentum).add_(grad, alpha=1)
                grad = buffer
            if active is None or bool(active.all()):
                p.add_(grad, alpha=-self.lr)
            else:
                where = active.view(-1, *([1] * (p.ndim - 1)))
                p.copy_(torch.where(where, p.add(grad, alpha=-self.lr), p))


def clip_per_client(grads: Sequence[torch.Tensor], max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_`` for each client (in place): a client's
    gradients are scaled by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` their joint
    2-norm."""
    if not grads:
        return
    size = len(grads[0])
    if size == 1:
        own = [g[0] for g in grads]
        own_norms = torch._foreach_norm(own, 2)
        total = torch.linalg.vector_norm(torch.stack(list(own_norms)), 2)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(own, coefficient)
        return
    norms = torch.stack([torch.linalg.vector_norm(g.reshape(size, -1), dim=1) for g in grads], 1)
    total = torch.linalg.vector_norm(norms, dim=1)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.view(-1, *([1] * (g.ndim - 1))))


# ----------------------------------------------------------------------------- train
@dataclass(frozen=True)
class TrainStats:
    """What one ``train`` call did for one client: mean loss of its last epoch, its
    samples, its steps."""

    loss: float
    num_examples: int
    steps: int


@dataclass(frozen=True)
class EvalStats:
    """Mean loss, accuracy and number of test samples."""

    loss: float
    accuracy: float
    num_examples: int


class Objective(Protocol):
    """One client's loss of one step: ``objective(model, batch, inputs)``, with
    ``model`` the client's ``View``, ``batch`` its ``(x, y, weight, count, extra)`` and
    ``inputs`` its slice of the per-client inputs given to ``train``. Written for one
    client; ``per_client`` maps it over the cohort."""

    def __call__(self, model: View, batch: tuple[Any, ...], inputs: Any) -> torch.Tensor: ...


def cross_entropy(model: View, batch: tuple[Any, ...], inputs: Any) -> torch.Tensor:
    """The mean cross-entropy of the batch's real rows (weighted by ``weight``)."""
    x, y, weight, count, _ = batch
    losses = F.cross_entropy(model(x), y, reduction="none")
    return (losses * weight).sum() / count


def train(
    stack: Stack,
    data: CohortData,
    *,
    parts: Sequence[str],
    epochs: int,
    settings: SGDSettings,
    generators: Sequence[torch.Generator],
    objective: Objective = cross_entropy,
    inputs: Any = None,
    sample_weights: torch.Tensor | None = None,
    augment: Augment | None = None,
    extra: Callable[[torch.Generator], Any] | None = None,
    max_grad_norm: float | None = None,
    clip_groups: Sequence[Sequence[str]] | None = None,
    correction: Mapping[str, torch.Tensor] | None = None,
) -> list[TrainStats]:
    """Train every client's parameters of ``parts`` for ``epochs`` passes over its own
    data, in place in ``stack``.

    Parameters
    ----------
    stack : Stack
        The cohort's models; names start with a part (``body.``, ``head.``).
    data : CohortData
        The clients' training samples, on the stack's device.
    parts : sequence of str
        Model parts to train; every other tensor stays exactly as it is.
    epochs : int
        Passes over each client's data, each in a fresh random order.
    settings : SGDSettings
        Optimizer settings (a fresh optimizer per call, as for a client alone).
    generators : sequence of torch.Generator
        Each client's stream: its batch order, augmentation, ``extra`` draws, and the
        seed of its dropout masks.
    objective : Objective (default: the weighted mean cross-entropy)
        One client's loss of a step (e.g. plus a proximal or gluing penalty).
    inputs : pytree of tensors with a leading axis K, optional
        Per-client constants the objective reads (an anchor model, targets).
    sample_weights : torch.Tensor (K, N), optional
        Per-sample loss weights (FedGMM's and FedEM's responsibilities).
    augment : Augment, optional
        A training-time batch transform.
    extra : callable, optional
        ``extra(generator)``: a client's own draw for each step (taken after the
        step's augmentation), given to the objective as ``batch[4]``.
    max_grad_norm : float, optional
        Clip each client's gradient norm before each step (per group of
        ``clip_groups``, by default all trained tensors together).
    clip_groups : sequence of sequences of names, optional
        Tensors clipped together.
    correction : dict of str to torch.Tensor (K, ...), optional
        Added to each named tensor's gradient before the step (SCAFFOLD's c - c_i).
    """
    names = stack.names(parts)
    if not names or epochs == 0:
        return [TrainStats(float("nan"), n, 0) for n in data.counts]
    if stack.size > 1 and stack.has_batch_statistics:
        return _one_at_a_time(stack, data, generators, sample_weights, inputs, correction, locals())
    seeds = [dropout_seed(g) if n else None for g, n in zip(generators, data.counts, strict=True)]
    plan = Plan.draw(
        data.counts, epochs, settings.batch_size, generators, augment=augment, extra=extra
    )
    normalized = stack.has_batch_statistics
    if normalized:
        plan.sizes[plan.sizes == 1] = 0  # BatchNorm cannot normalize one sample: skipped
    masks = DropoutMasks(stack, seeds, data.x[0]) if stack.has_dropout else None
    descent = Descent(stack, names, settings, correction, max_grad_norm, clip_groups)
    record = LastEpochLoss(stack.size)
    try:
        with training_mode(stack.template, True):
            for s in range(len(plan)):
                if normalized and not plan.sizes[s].any():
                    continue  # a step no client takes (a BatchNorm model's one-sample batch)
                batch = plan.batch(s, data, sample_weights=sample_weights, augment=augment)
                if masks is not None:
                    batch.masks = masks.draw(batch.sizes, batch.x.shape[1], batch.x)
                loss = step_losses(stack, objective, batch, inputs)
                descent.step(loss, batch)
                record.add(loss, batch)
    finally:
        descent.release()
    return record.stats(data.counts, [plan.steps(k) for k in range(stack.size)])


def _one_at_a_time(
    stack: Stack,
    data: CohortData,
    generators: Sequence[torch.Generator],
    sample_weights: torch.Tensor | None,
    inputs: Any,
    correction: Mapping[str, torch.Tensor] | None,
    options: Mapping[str, Any],
) -> list[TrainStats]:
    """``train`` for each client of ``stack`` alone (a model with batch statistics),
    written back into the stack; ``options`` are the call's other arguments."""
    keep = (
        "parts",
        "epochs",
        "settings",
        "objective",
        "augment",
        "extra",
        "max_grad_norm",
        "clip_groups",
    )
    stats = []
    for k in range(stack.size):
        own = stack.select(torch.tensor([k]))
        mine = CohortData(
            data.x[k : k + 1, : data.counts[k]],
            data.y[k : k + 1, : data.counts[k]],
            [data.counts[k]],
        )
        stats += train(
            own,
            mine,
            generators=[generators[k]],
            sample_weights=None
            if sample_weights is None
            else sample_weights[k : k + 1, : data.counts[k]],
            inputs=None if inputs is None else pytree.tree_map(lambda t, k=k: t[k : k + 1], inputs),
            correction=None
            if correction is None
            else {n: c[k : k + 1] for n, c in correction.items()},
            **{name: options[name] for name in keep},
        )
        for name, tensor in own.tensors.items():
            stack.tensors[name][k] = tensor[0]
    return stats


class Descent:
    """The gradient steps of one ``train`` call: the trainable tensors of ``names``
    (gradients on, the others frozen), SCAFFOLD's ``correction``, per-client clipping
    and the optimizer."""

    def __init__(
        self,
        stack: Stack,
        names: list[str],
        settings: SGDSettings,
        correction: Mapping[str, torch.Tensor] | None = None,
        max_grad_norm: float | None = None,
        clip_groups: Sequence[Sequence[str]] | None = None,
    ) -> None:
        self.names = names
        self.trainable = [stack.tensors[n] for n in names]
        for t in self.trainable:
            t.requires_grad_(True)
        self.optimizer = SGD(self.trainable, settings)
        self.correction = correction
        self.max_grad_norm = max_grad_norm
        self.groups = [list(g) for g in clip_groups] if clip_groups else [names]
        self.size = stack.size

    def step(self, loss: torch.Tensor, batch: Batch) -> None:
        """One step of every client with a batch, on the gradient of its own loss."""
        grads = list(torch.autograd.grad(loss.sum(), self.trainable))
        if self.correction is not None:
            grads = [
                g + self.correction[n] if n in self.correction else g
                for n, g in zip(self.names, grads, strict=True)
            ]
        if self.max_grad_norm is not None:
            for group in self.groups:
                clip_per_client([grads[self.names.index(n)] for n in group], self.max_grad_norm)
        self.optimizer.step(grads, None if batch.full or self.size == 1 else batch.active)

    def release(self) -> None:
        """Gradients off again."""
        for t in self.trainable:
            t.requires_grad_(False)


class LastEpochLoss:
    """Each client's mean loss over its last epoch's samples (in float64, as a loop over
    one client sums ``loss.item() * len(batch)``)."""

    def __init__(self, size: int) -> None:
        self.losses = torch.zeros(size, dtype=torch.float64)
        self.seen = torch.zeros(size, dtype=torch.long)
        self.own_loss, self.own_seen = 0.0, 0

    def add(self, loss: torch.Tensor, batch: Batch) -> None:
        if len(batch.sizes) == 1:  # a cohort of one: the same float64 sums, in Python
            if batch.last_epoch[0]:
                self.own_loss += float(loss.detach()) * batch.sizes[0]
                self.own_seen += batch.sizes[0]
            return
        last = torch.tensor(batch.last_epoch)
        sizes = torch.tensor(batch.sizes)
        values = loss.detach().to(torch.float64).cpu()
        self.losses += torch.where(last, values * sizes, 0.0)
        self.seen += torch.where(last, sizes, 0)

    def stats(self, counts: Sequence[int], steps: Sequence[int]) -> list[TrainStats]:
        if len(counts) == 1:
            self.losses[0] += self.own_loss
            self.seen[0] += self.own_seen
        return [
            TrainStats(float(self.losses[k]) / max(int(self.seen[k]), 1), counts[k], steps[k])
            if steps[k]
            else TrainStats(float("nan"), counts[k], 0)
            for k in range(len(counts))
        ]


def step_losses(stack: Stack, objective: Objective, batch: Batch, inputs: Any) -> torch.Tensor:
    """Every client's loss of one step (K,): ``objective`` on the client's model and
    batch, with the step's dropout masks replayed. The default objective's
    cross-entropy is taken outside the map over the clients, on all their logits at once
    (the same operations, fewer of them)."""
    if objective is cross_entropy and stack.size > 1:
        logits = per_client(
            _replayed_forward(stack), stack.tensors, batch.x, batch.masks, size=stack.size
        )
        losses = F.cross_entropy(logits.flatten(0, 1), batch.y.flatten(), reduction="none")
        return (losses.view_as(batch.weight) * batch.weight).sum(dim=1) / batch.count

    def one(
        tensors: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        weight: torch.Tensor,
        count: torch.Tensor,
        extra: Any,
        masks: list[torch.Tensor],
        own_inputs: Any,
    ) -> torch.Tensor:

        view = View(stack.template, tensors)
        if not masks:
            return objective(view, (x, y, weight, count, extra), own_inputs)
        with replay(masks):
            return objective(view, (x, y, weight, count, extra), own_inputs)

    return per_client(
        one,
        stack.tensors,
        batch.x,
        batch.y,
        batch.weight,
        batch.count,
        batch.extra,
        batch.masks,
        inputs,
        size=stack.size,
    )


# -------------------------------------------------------------------------- evaluate
@torch.no_grad()
def logits(
    stack: Stack, x: torch.Tensor, counts: Sequence[int], *, batch_size: int = 1024
) -> torch.Tensor:
    """Every client's model on its own inputs ``x`` (K, N, ...) in evaluation mode:
    (K, N, classes), in chunks of ``batch_size`` rows."""
    outputs = []
    with training_mode(stack.template, False):
        for start in range(0, x.shape[1], batch_size):
            chunk = x[:, start : start + batch_size]
            outputs.append(per_client(_forward(stack), stack.tensors, chunk, size=stack.size))
    if not outputs:
        return torch.zeros((stack.size, 0, 0))
    return torch.cat(outputs, dim=1)


def _replayed_forward(stack: Stack) -> Callable[..., torch.Tensor]:
    def forward(
        tensors: dict[str, torch.Tensor], x: torch.Tensor, masks: list[torch.Tensor]
    ) -> torch.Tensor:
        with replay(masks):
            return View(stack.template, tensors)(x)

    return forward


def _forward(stack: Stack) -> Callable[..., torch.Tensor]:
    def forward(tensors: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return View(stack.template, tensors)(x)

    return forward


@torch.no_grad()
def evaluate(stack: Stack, data: CohortData, *, batch_size: int = 1024) -> list[EvalStats]:
    """Every client's mean cross-entropy and accuracy on its own samples, in
    evaluation mode."""
    size = stack.size
    if size == 1:  # the loop a client alone runs, chunk by chunk
        n = data.counts[0]
        if n == 0:
            return [EvalStats(float("nan"), float("nan"), 0)]
        total_loss, correct = 0.0, 0
        with training_mode(stack.template, False):
            model = View(stack.template, {k: v[0] for k, v in stack.tensors.items()})
            for start in range(0, n, batch_size):
                out = model(data.x[0, start : min(start + batch_size, n)])
                target = data.y[0, start : min(start + batch_size, n)]
                total_loss += float(F.cross_entropy(out, target, reduction="sum"))
                correct += int((out.argmax(dim=1) == target).sum())
        return [EvalStats(total_loss / n, correct / n, n)]
    totals = torch.zeros(size, dtype=torch.float64)
    corrects = torch.zeros(size, dtype=torch.long)
    width = max(data.counts, default=0)
    real = (
        torch.arange(width, device=data.x.device)[None, :]
        < torch.tensor(data.counts, device=data.x.device)[:, None]
    )
    with training_mode(stack.template, False):
        for start in range(0, width, batch_size):
            chunk = slice(start, start + batch_size)
            out = per_client(_forward(stack), stack.tensors, data.x[:, chunk], size=size)
            target = data.y[:, chunk]
            mask = real[:, chunk]
            ce = F.cross_entropy(out.flatten(0, 1), target.flatten(), reduction="none").view(
                target.shape
            )
            totals += (ce * mask).sum(dim=1).double().cpu()
            corrects += ((out.argmax(dim=2) == target) & mask).sum(dim=1).cpu()
    return [
        EvalStats(float(totals[k]) / n, int(corrects[k]) / n, n)
        if n
        else EvalStats(float("nan"), float("nan"), 0)
        for k, n in enumerate(data.counts)
    ]


# ------------------------------------------------------------- one model (migration)
def train_model(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    parts: tuple[str, ...],
    epochs: int,
    settings: SGDSettings,
    generator: torch.Generator,
    sample_weights: torch.Tensor | None = None,
    augment: Augment | None = None,
    max_grad_norm: float | None = None,
) -> TrainStats:
    """``train`` for one ``model`` (a cohort of one), written back into it."""
    stack = Stack.of(model, [{}])
    stats = train(
        stack,
        CohortData(x[None], y[None], [len(y)]),
        parts=parts,
        epochs=epochs,
        settings=settings,
        generators=[generator],
        sample_weights=None if sample_weights is None else sample_weights[None],
        augment=augment,
        max_grad_norm=max_grad_norm,
    )
    stack.load(0, model)
    return stats[0]


def evaluate_model(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> EvalStats:
    """``evaluate`` for one ``model``."""
    return evaluate(Stack.of(model, [{}]), CohortData(x[None], y[None], [len(y)]))[0]
