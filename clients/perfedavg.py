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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, RecordDict
from torch.func import functional_call

from fedpers import protocol
from fedpers.clients.base import PersonalizedClient
from fedpers.clients.common import Arrays, Metrics, config_int
from fedpers.config import RunConfig
from fedpers.families.personalized import PerFedAvgSettings
from fedpers.legacy_training import SGD, dropout_stream, evaluate
from fedpers.models import part_arrays


class PerFedAvgClient(PersonalizedClient):
    """Per-FedAvg's first-order local update (FO)."""

    hessian_free = False

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        self.alpha = run.group(PerFedAvgSettings).alpha(self.hessian_free)

    @property
    def batches_per_step(self) -> int:
        """``D`` and ``D'``; HF adds ``D''``."""
        return 3 if self.hessian_free else 2

    def loss(
        self, params: dict[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Mean cross-entropy of the model with ``params`` on ``batch``."""
        xb, yb = batch
        return F.cross_entropy(functional_call(self.model, params, (xb,)), yb)

    def adapted(
        self, params: dict[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``w - alpha grad f(w; batch)``, with ``w`` a constant."""
        grads = torch.autograd.grad(self.loss(params, batch), list(params.values()))
        return {
            name: (p - self.alpha * g).detach()
            for (name, p), g in zip(params.items(), grads, strict=True)
        }

    def direction(
        self, params: dict[str, torch.Tensor], batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], float]:
        """The step's direction (FO: ``grad f(w'; D')``; HF: less ``alpha H(w; D'')``
        times it) and the loss ``f(w'; D')``."""
        inner = self.adapted(params, batches[0])
        outer = {k: v.requires_grad_(True) for k, v in inner.items()}
        loss = self.loss(outer, batches[1])
        grads = list(torch.autograd.grad(loss, list(outer.values())))
        if self.hessian_free:
            # H(w; D'') v, with v = grad f(w'; D'): the gradient of <grad f(w; D''), v>
            first = torch.autograd.grad(
                self.loss(params, batches[2]), list(params.values()), create_graph=True
            )
            dot = torch.stack([(g * v).sum() for g, v in zip(first, grads, strict=True)]).sum()
            hvp = torch.autograd.grad(dot, list(params.values()))
            grads = [g - self.alpha * h for g, h in zip(grads, hvp, strict=True)]
        return grads, float(loss.detach())

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """Per-FedAvg's local steps from the received ``w``; replies ``w``."""
        generator, x, y, settings = self.start_round(arrays, config)
        epochs = config_int(config, protocol.EPOCHS)
        named: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        optimizer = SGD(list(self.model.parameters()), settings)
        k = self.batches_per_step
        losses: list[float] = []
        self.model.train()
        with dropout_stream(generator, x.device.type):
            for _ in range(epochs if len(y) else 0):
                order = torch.randperm(len(y), generator=generator)
                batches = []
                for start in range(0, len(y), settings.batch_size):
                    index = order[start : start + settings.batch_size]
                    xb = x[index] if self.augment is None else self.augment(x[index], generator)
                    batches.append((xb, y[index]))
                for step in range(max(1, len(batches) // k)):
                    group = [batches[(step * k + j) % len(batches)] for j in range(k)]
                    grads, loss = self.direction(named, group)
                    for p, g in zip(named.values(), grads, strict=True):
                        p.grad = g
                    optimizer.step()
                    losses.append(loss)
        for p in named.values():
            p.grad = None
        metrics = {
            protocol.NUM_EXAMPLES: float(len(y)),
            protocol.LOSS: sum(losses) / len(losses) if losses else float("nan"),
        }
        return part_arrays(self.model, self.shared), metrics

    def evaluate(self, arrays: Arrays, config: ConfigRecord) -> Metrics:
        """Test accuracy after one step of adaptation, ``w - alpha grad f(w; D)`` on one
        mini-batch ``D`` of the training data (not stored)."""
        self.load_shared(arrays)
        x, y = self.tensor(self.data.x_train), self.tensor(self.data.y_train)
        if len(y):
            generator = self.generator("adapt", config_int(config, protocol.ROUND))
            index = torch.randperm(len(y), generator=generator)[: self.run.batch_size]
            self.model.eval()  # no dropout draw: the step is the same on every process
            params: dict[str, torch.Tensor] = dict(self.model.named_parameters())
            adapted = self.adapted(params, (x[index], y[index]))
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(adapted[name])
        stats = evaluate(self.model, self.tensor(self.data.x_test), self.tensor(self.data.y_test))
        return self._metrics(stats)


class PerFedAvgHFClient(PerFedAvgClient):
    """Per-FedAvg's Hessian-free local update (HF)."""

    hessian_free = True
