"""The training and evaluation loop fedpers ran before cohorts (one client, one
``nn.Module``, dropout from torch's global generator), kept unchanged as the oracle of
``fedpers.training``: with one client the cohort loop must give its bits."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

from fedpers.training import EvalStats, SGDSettings, TrainStats


class SGD:
    """``torch.optim.SGD`` in the two parameter groups fedpers gave it: tensors of 2 or
    more dimensions with ``weight_decay``, the rest without."""

    def __init__(self, params: list[nn.Parameter], settings: SGDSettings) -> None:
        self.optimizer = torch.optim.SGD(
            [
                {
                    "params": [p for p in params if p.ndim >= 2],
                    "weight_decay": settings.weight_decay,
                },
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
            ],
            lr=settings.lr,
            momentum=settings.momentum,
        )

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.optimizer.step()


@contextmanager
def dropout_stream(generator: torch.Generator) -> Iterator[None]:
    """Torch's global generator seeded from one draw of ``generator``, restored after."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


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
    max_grad_norm: float | None = None,
) -> TrainStats:
    trainable = [
        (name, p) for name, p in model.named_parameters() if name.split(".", 1)[0] in parts
    ]
    if not trainable or epochs == 0 or len(y) == 0:
        return TrainStats(loss=float("nan"), num_examples=len(y), steps=0)
    trainable_ids = {id(p) for _, p in trainable}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable_ids)
    optimizer = SGD([p for _, p in trainable], settings)
    model.train()
    steps = 0
    with dropout_stream(generator):
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
                optimizer.zero_grad()
                loss.backward()
                if max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_([p for _, p in trainable], max_grad_norm)
                optimizer.step()
                epoch_loss += loss.item() * len(index)
                seen += len(index)
                steps += 1
    for p in model.parameters():
        p.requires_grad_(True)
    return TrainStats(loss=epoch_loss / max(seen, 1), num_examples=len(y), steps=steps)


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, batch_size: int = 1024
) -> EvalStats:
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
