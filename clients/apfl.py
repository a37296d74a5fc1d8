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
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from torch.func import functional_call

from fedpers import protocol, records
from fedpers.clients.base import PersonalizedClient
from fedpers.clients.common import Arrays, Metrics, config_int
from fedpers.config import RunConfig
from fedpers.families.personalized import APFLSettings
from fedpers.legacy_training import SGD, dropout_stream, evaluate, mini_batches
from fedpers.models import part_arrays

STATE_ALPHA = "fedpers.apfl.alpha"  # this client's mixing weight, in context.state
ALPHA = "alpha"


class APFLClient(PersonalizedClient):
    """FedAvg's local update of ``w``, with the personal ``v`` and ``alpha`` trained on
    the same mini-batches through the mixture."""

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        settings = run.group(APFLSettings)
        self.adaptive = settings.apfl_adaptive
        # v starts as the seeded initial model, which is also the server's w^0.
        self.personal_model = self.kept_model()
        self.alpha = settings.apfl_alpha
        kept = state.get(STATE_ALPHA)
        if isinstance(kept, ArrayRecord) and ALPHA in kept:
            self.alpha = float(records.values(kept[ALPHA])[0])

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """The simultaneous steps of ``w``, ``v`` and ``alpha``; replies ``w``."""
        generator, x, y, settings = self.start_round(arrays, config)
        epochs = config_int(config, protocol.EPOCHS)
        w_model, v_model = self.model, self.personal_model
        w_params = list(w_model.parameters())
        v_params = list(v_model.parameters())
        names = [name for name, _ in w_model.named_parameters()]
        w_step, v_step = SGD(w_params, settings), SGD(v_params, settings)
        alpha = torch.tensor(self.alpha, dtype=torch.float32, device=self.device)
        loss_sum, seen = 0.0, 0
        w_model.train()
        v_model.train()
        with dropout_stream(generator, x.device.type):
            for index in mini_batches(len(y), epochs, settings.batch_size, generator):
                xb, yb = x[index], y[index]
                if self.augment is not None:
                    xb = self.augment(xb, generator)
                loss = F.cross_entropy(w_model(xb), yb)
                grad_w = torch.autograd.grad(loss, w_params)
                # The mixture of this step's v and w: w is a constant in it.
                a = alpha.clone().requires_grad_(self.adaptive)
                mixed = {
                    name: a * v + (1 - a) * w.detach()
                    for name, v, w in zip(names, v_params, w_params, strict=True)
                }
                mixed_loss = F.cross_entropy(functional_call(w_model, mixed, (xb,)), yb)
                wanted = [*v_params, a] if self.adaptive else v_params
                grads = torch.autograd.grad(mixed_loss, wanted)
                for p, g in zip(w_params, grad_w, strict=True):
                    p.grad = g
                for p, g in zip(v_params, grads, strict=False):
                    p.grad = g
                w_step.step()
                v_step.step()
                if self.adaptive:
                    with torch.no_grad():
                        alpha = (alpha - settings.lr * grads[-1]).clamp(0.0, 1.0)
                loss_sum += loss.item() * len(index)
                seen += len(index)
        for p in (*w_params, *v_params):
            p.grad = None
        self.alpha = float(alpha)
        self.keep(v_model)
        self.state[STATE_ALPHA] = ArrayRecord({ALPHA: Array(np.array([self.alpha]))})
        metrics = {
            protocol.NUM_EXAMPLES: float(len(y)),
            protocol.LOSS: loss_sum / seen if seen else float("nan"),
        }
        return part_arrays(w_model, self.shared), metrics

    @torch.no_grad()
    def mixture(self) -> torch.nn.Module:
        """The model ``alpha v + (1 - alpha) w``, ``w`` the model last loaded (in the
        precision of training's mixture)."""
        mixed = copy.deepcopy(self.personal_model)
        a = torch.tensor(self.alpha, dtype=torch.float32, device=self.device)
        for p, v, w in zip(
            mixed.parameters(),
            self.personal_model.parameters(),
            self.model.parameters(),
            strict=True,
        ):
            p.copy_(a * v + (1 - a) * w)
        return mixed

    def evaluate(self, arrays: Arrays, config: ConfigRecord) -> Metrics:
        """Test accuracy of the mixture with the global model received."""
        self.load_shared(arrays)
        model = self.mixture()
        stats = evaluate(model, self.tensor(self.data.x_test), self.tensor(self.data.y_test))
        return self._metrics(stats)
