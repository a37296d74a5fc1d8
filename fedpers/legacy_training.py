"""The one-client loop of the clients not yet written for a cohort (temporary; see
fedpers.training for the one training loop).

Was: the one training loop and the one evaluation loop, used by every client.

An algorithm's local update is a sequence of calls to ``train`` that differ only in
which model parts are trainable (FedRep: the head, then the body; FedPer and FedAvg:
both at once). Parts that are not trainable are truly frozen: they are left out of the
optimizer, so neither momentum nor weight decay can move them, and autograd does not
compute their gradients.

The optimizer is ``SGD`` below, not ``torch.optim.SGD``: the same update (on the CPU
the very same tensor operations, so the same bits: tests/fedpers/test_training.py
checks it against torch's), without what a single-device loop does not use. Creating a
``torch.optim`` optimizer imports ``torch._dynamo`` (2 s of processor time on an idle
core here, 4-5 s on a loaded one) in every fresh process: every ClientApp that Flower
starts cold, and every Ray actor of a simulation; and its ``step`` wrapper (profiler
records, grad-mode switches, dynamo graph breaks) cost more than the update itself for
the small models here (0.45 ms against 0.19 ms a step, cProfile of the FedGMM scripts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

from fedpers.seeding import seed_torch
from fedpers.training import EvalStats, SGDSettings, TrainStats


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


class SGD:
    """Heavy-ball SGD with decoupled-from-biases L2 decay: ``torch.optim.SGD`` as
    ``train`` used it (two parameter groups: tensors of 2 or more dimensions with
    ``weight_decay``, the rest without; no dampening, no Nesterov), its single-tensor
    update written out.

    For each parameter ``p`` with a gradient ``g``, in order: ``g = g + wd * p`` (a new
    tensor) when ``wd != 0``; with momentum, ``b = g`` (a copy) at the first step and
    ``b = momentum * b + g`` after, and ``g = b``; then ``p -= lr * g``.
    """

    def __init__(self, params: list[nn.Parameter], settings: SGDSettings) -> None:
        self.params = params
        self.decay = [settings.weight_decay if p.ndim >= 2 else 0.0 for p in params]
        self.lr = settings.lr
        self.momentum = settings.momentum
        self.buffers: list[torch.Tensor | None] = [None] * len(params)

    def zero_grad(self) -> None:
        """Drop every gradient (``set_to_none``)."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        for i, p in enumerate(self.params):
            grad = p.grad
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
            p.add_(grad, alpha=-self.lr)


@contextmanager
def dropout_stream(generator: torch.Generator, device_type: str = "cpu") -> Iterator[None]:
    """Within it, torch's global generator (which dropout draws from) is seeded from
    ``generator``, and it is restored afterwards: a client's update depends on its own
    stream only. Every local update with dropout (``train``, APFL's, Per-FedAvg's) takes
    its seed here, one draw from ``generator`` before any other."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):
        seed_torch(seed, device_type)
        yield


def mini_batches(
    count: int, epochs: int, batch_size: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """The sample indices of every mini-batch of ``epochs`` passes over ``count``
    samples, each pass in a fresh order from ``generator`` (drawn when the pass begins,
    as ``train`` draws it); none without samples."""
    for _ in range(epochs if count else 0):
        order = torch.randperm(count, generator=generator)
        for start in range(0, count, batch_size):
            yield order[start : start + batch_size]


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    parts: tuple[str, ...],
    epochs: int,
    settings: SGDSettings,
    generator: torch.Generator,
    sample_weights: torch.Tensor | None = None,
    augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None,
    penalty: Callable[[torch.Generator], torch.Tensor] | None = None,
    max_grad_norm: float | None = None,
) -> TrainStats:
    """Train the parameters of ``parts`` for ``epochs`` passes over ``(x, y)``.

    Parameters
    ----------
    model : nn.Module
        Model whose parameter names start with a part name (``body.``, ``head.``).
    x, y : torch.Tensor
        Inputs and integer labels, already on the model's device.
    parts : tuple of str
        Model parts to train; every other parameter stays exactly as it is.
    epochs : int
        Passes over the data, each in a fresh random order from ``generator``.
    settings : SGDSettings
        Optimizer settings.
    generator : torch.Generator
        Source of the batch order and of augmentation.
    sample_weights : torch.Tensor, optional
        Per-sample loss weights; the batch loss is ``sum(w * CE) / batch size``
        (FedGMM's and FedEM's responsibility-weighted learner update).
    augment : callable, optional
        Batch transform ``(x_batch, generator) -> x_batch`` applied in training only.
    penalty : callable, optional
        A term added to every step's loss (Sheaf-FRL's gluing penalty on a pilot batch),
        called with ``generator``.
    max_grad_norm : float, optional
        Clip the trainable parameters' gradient norm before each step.
    """
    trainable = [
        (name, p) for name, p in model.named_parameters() if name.split(".", 1)[0] in parts
    ]
    if not trainable or epochs == 0 or len(y) == 0:
        return TrainStats(loss=float("nan"), num_examples=len(y), steps=0)
    trainable_ids = {id(p) for _, p in trainable}
    previous = {id(p): p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable_ids)
    optimizer = SGD([p for _, p in trainable], settings)
    model.train()
    steps = 0
    stream = dropout_stream(generator, x.device.type)
    stream.__enter__()
    try:
        for _ in range(epochs):
            order = torch.randperm(len(y), generator=generator)
            epoch_loss, seen = 0.0, 0
            for start in range(0, len(y), settings.batch_size):
                index = order[start : start + settings.batch_size]
                xb, yb = x[index], y[index]
                if augment is not None:
                    xb = augment(xb, generator)
                losses = F.cross_entropy(model(xb), yb, reduction="none")
                if sample_weights is not None:
                    losses = losses * sample_weights[index]
                loss = losses.mean()
                if penalty is not None:
                    loss = loss + penalty(generator)
                optimizer.zero_grad()
                loss.backward()
                if max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_([p for _, p in trainable], max_grad_norm)
                optimizer.step()
                epoch_loss += loss.item() * len(index)
                seen += len(index)
                steps += 1
    finally:
        stream.__exit__(None, None, None)
        for p in model.parameters():
            p.requires_grad_(previous[id(p)])
    return TrainStats(loss=epoch_loss / max(seen, 1), num_examples=len(y), steps=steps)


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, batch_size: int = 1024
) -> EvalStats:
    """Mean cross-entropy and accuracy of ``model`` on ``(x, y)`` in eval mode."""
    if len(y) == 0:
        return EvalStats(loss=float("nan"), accuracy=float("nan"), num_examples=0)
    model.eval()
    total_loss, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        logits = model(x[start : start + batch_size])
        target = y[start : start + batch_size]
        total_loss += float(F.cross_entropy(logits, target, reduction="sum"))
        correct += int((logits.argmax(dim=1) == target).sum())
    return EvalStats(loss=total_loss / len(y), accuracy=correct / len(y), num_examples=len(y))


def random_crop_flip(
    padding: int = 4,
) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """CIFAR augmentation of the FedRep paper: random crop with zero padding, h-flip."""

    def augment(xb: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        n, _, h, w = xb.shape
        padded = F.pad(xb, (padding, padding, padding, padding))
        dy = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
        dx = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
        rows = (dy[:, None] + torch.arange(h)[None, :])[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w)[None, :])[:, None, None, :]
        batch = torch.arange(n)[:, None, None, None]
        channels = torch.arange(xb.shape[1])[None, :, None, None]
        out = padded[batch, channels, rows, cols]
        flip = torch.rand(n, generator=generator) < 0.5
        out[flip] = out[flip].flip(-1)
        return out

    return augment
