"""What one client's training step costs: a plain torch loop, a cohort of one, a cohort.

    python -m simulations.step_cost [--model digits-mlp] [--samples 130] [--epochs 5]
                                    [--batch-size 10] [--cohort 100] [--reps 30]

A device's ClientApp, every ClientApp call on Flower's engine and most tests train one
client as a cohort of one (``fedpers.training.train`` with K = 1); the batched engine
trains whole cohorts. This benchmark times one client's local update three ways, on
the same model, sample count, epochs and batch size, interleaved rep by rep (this
machine's speed drifts by tens of percent within minutes; interleaving keeps the
comparison fair):

- ``torch loop``: the loop fedpers ran before cohorts, written out here: an
  ``nn.Module``, ``torch.optim.SGD`` in two parameter groups (decay on weights), the
  mean cross-entropy, ``backward``, ``step``, ``loss.item()`` per batch;
- ``cohort of 1``: ``fedpers.training.train`` on a stack of one client (the same bits
  as the loop, tests/fedpers/test_training.py);
- ``cohort of K``: the same call for ``--cohort`` clients at once, divided by K (each
  client with its own data and generator).

It prints each one's median and fastest update and its cost per step, and the cohort
of one's median against the loop's. The samples are random (the time does not depend on
their values); one thread (``--threads``), as a simulation's Ray actor or a small
device has.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from fedpers import training
from fedpers.models import MODELS, build_model

SETTINGS = {"lr": 0.05, "momentum": 0.5, "weight_decay": 1e-4}


def torch_loop(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    settings: training.SGDSettings,
    generator: torch.Generator,
) -> float:
    """The loop before cohorts: one module, torch's SGD; returns the last batch's loss."""
    params = list(model.parameters())
    optimizer = torch.optim.SGD(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": settings.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=settings.lr,
        momentum=settings.momentum,
    )
    model.train()
    loss_value = float("nan")
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), settings.batch_size):
            index = order[start : start + settings.batch_size]
            loss = F.cross_entropy(model(x[index]), y[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_value = loss.item()
    return loss_value


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    shape = tuple(int(d) for d in args.input_shape.split(",")) if args.input_shape else None
    shape = shape or _input_shape(args.model)
    torch.set_num_threads(args.threads)
    _run(args, shape)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default="digits-mlp", choices=sorted(MODELS))
    parser.add_argument("--input-shape", default="", help="e.g. 3,32,32; default: the model's")
    parser.add_argument("--samples", type=int, default=130, help="samples per client")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--cohort", type=int, default=100, help="K of the cohort timed")
    parser.add_argument("--reps", type=int, default=30, help="updates timed per way")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    for flag in ("samples", "epochs", "batch_size", "cohort", "reps", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def _run(args: argparse.Namespace, shape: tuple[int, ...]) -> None:
    """Time the three ways and print them."""
    prototype = build_model(args.model, num_classes=10, seed=0, input_shape=shape)
    settings = training.SGDSettings(batch_size=args.batch_size, **SETTINGS)
    generator = torch.Generator().manual_seed(0)
    xs = torch.randn(args.cohort, args.samples, *shape, generator=generator)
    ys = torch.randint(0, 10, (args.cohort, args.samples), generator=generator)
    parts = ("body", "head")

    def loop(rep: int) -> None:
        model = _copy(prototype)
        torch_loop(model, xs[0], ys[0], args.epochs, settings, torch.Generator().manual_seed(rep))

    def one(rep: int) -> None:
        training.train_model(
            _copy(prototype),
            xs[0],
            ys[0],
            parts=parts,
            epochs=args.epochs,
            settings=settings,
            generator=torch.Generator().manual_seed(rep),
        )

    def cohort(rep: int) -> None:
        stack = training.Stack.of(prototype, [{}] * args.cohort)
        data = training.CohortData.of(list(xs), list(ys))
        training.train(
            stack,
            data,
            parts=parts,
            epochs=args.epochs,
            settings=settings,
            generators=[
                torch.Generator().manual_seed(rep * 100_003 + k) for k in range(args.cohort)
            ],
        )

    ways: dict[str, tuple[Callable[[int], None], int]] = {
        "torch loop": (loop, 1),
        "cohort of 1": (one, 1),
        f"cohort of {args.cohort}": (cohort, args.cohort),
    }
    times = _time(ways, args.reps)
    _report(args, times)


def _time(ways: dict[str, tuple[Callable[[int], None], int]], reps: int) -> dict[str, list[float]]:
    """Each way's seconds per client, rep by rep, the ways interleaved."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(reps + 1):  # the first rep warms up, untimed
        for name, (run, clients) in ways.items():
            start = time.perf_counter()
            run(rep)
            if rep:
                times[name].append((time.perf_counter() - start) / clients)
        if rep and (rep % 10 == 0 or rep == reps):
            print(f"rep {rep}/{reps}", file=sys.stderr, flush=True)
    return times


def _report(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    steps = args.epochs * -(-args.samples // args.batch_size)
    print(
        f"{args.model}, {args.samples} samples, {args.epochs} epochs of batches of "
        f"{args.batch_size} ({steps} steps), {args.threads} thread(s), {args.reps} reps"
    )
    print(f"{'way':<16} {'median ms':>10} {'fastest ms':>11} {'us/step':>8}  (per client)")
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"{name:<16} {median * 1e3:>10.2f} {min(values) * 1e3:>11.2f} "
            f"{median / steps * 1e6:>8.0f}"
        )
    ratio = statistics.median(times["cohort of 1"]) / statistics.median(times["torch loop"])
    print(f"cohort of 1 / torch loop: {ratio:.2f}")


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def _input_shape(name: str) -> tuple[int, ...]:
    return {"mnist1d-mlp": (40,), "digits-mlp": (64,), "femnist-mlp": (784,)}.get(
        name, (3, 32, 32) if name.startswith("cifar") else (64,)
    )


if __name__ == "__main__":
    main()
