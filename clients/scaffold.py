"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", ICML 2020, Algorithm 1 with option II).

The server holds the model ``x`` and a control variate ``c``; each client holds its own
``c_i`` (zero at first) in ``context.state``. A sampled client receives ``x`` and ``c``
(``c`` under the names ``control.<parameter>``), starts from ``y = x`` and takes its
``K`` local steps (``epochs`` passes of the run's mini-batches) with the corrected
gradient ``g_i(y) - c_i + c``; then (option II)

    c_i+ = c_i - c + (x - y) / (K eta_l)

It keeps ``c_i+`` and replies with ``y`` and ``c + (c_i+ - c_i)``, which is
``(x - y) / (K eta_l)``: the server's screening then sees both updates as what came
back less what was sent, and the server (``strategies/scaffold.py``) takes
``x <- x + eta_g mean(y - x)`` and ``c <- c + (|S| / N) mean(c_i+ - c_i)``.
The correction is added to each parameter's gradient by a hook, so the loss the client
reports is its own. The run's optimizer applies (momentum and weight decay, when set,
act on the corrected gradient; ``K eta_l`` stays the paper's plain-SGD scale).
SCAFFOLD+FT (``scaffold-ft``) then fine-tunes every head after the last round, as
FedAvg+FT does.
"""

from __future__ import annotations

import math

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedpers import protocol, records
from fedpers.clients.base import PersonalizedClient
from fedpers.clients.common import Arrays, Metrics, config_float
from fedpers.config import RunConfig
from fedpers.families.personalized import CONTROL, is_control
from fedpers.models import part_arrays

STATE_CONTROL = "fedpers.scaffold.control"  # this client's c_i, in context.state


class ScaffoldClient(PersonalizedClient):
    """FedAvg's local update with SCAFFOLD's corrected gradients and control variate."""

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        model = part_arrays(self.model, self.shared)
        self.control = {name: np.zeros_like(array) for name, array in model.items()}
        stored = state.get(STATE_CONTROL)
        if isinstance(stored, ArrayRecord):
            self.control.update({k: records.values(v) for k, v in stored.items()})

    def initial_arrays(self) -> Arrays:
        """The seeded model and the server's first control variate, zero."""
        model = super().initial_arrays()
        return {**model, **{CONTROL + k: np.zeros_like(v) for k, v in model.items()}}

    def local_steps(self, config: ConfigRecord) -> int:
        """K: the optimizer steps of one local update (every phase's epochs, each a pass
        of ``batch-size`` mini-batches, the last one short)."""
        batches = math.ceil(len(self.data.y_train) / self.run.batch_size)
        return sum(epochs * batches for parts, epochs in self.local_update(config) if parts)

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """The corrected local steps from ``x``; replies ``y`` and ``c + c_i+ - c_i``."""
        model = {k: v for k, v in arrays.items() if not is_control(k)}
        server = {k: arrays[CONTROL + k] for k in model}
        correction = {
            name: self.tensor((server[name] - self.control[name]).astype(np.float32))
            for name in model
        }
        hooks = [
            p.register_hook(lambda grad, d=correction[name]: grad + d)
            for name, p in self.model.named_parameters()
            if name in correction
        ]
        try:
            reply, metrics = super().fit(model, config)
        finally:
            for hook in hooks:
                hook.remove()
        steps = self.local_steps(config)
        if steps == 0:  # no data: nothing moved, c_i stays
            return {**reply, **{CONTROL + k: v for k, v in server.items()}}, metrics
        scale = steps * config_float(config, protocol.LR)
        # (x - y) / (K eta_l), which is c + (c_i+ - c_i): what goes back for the variate
        variate = {name: (model[name].astype(np.float64) - reply[name]) / scale for name in model}
        self.control = {
            name: (self.control[name] - server[name] + variate[name]).astype(np.float32)
            for name in model
        }
        self.state[STATE_CONTROL] = ArrayRecord(
            {k: Array(np.ascontiguousarray(v)) for k, v in self.control.items()}
        )
        return {**reply, **{CONTROL + k: v.astype(np.float32) for k, v in variate.items()}}, metrics

    def evaluate(self, arrays: Arrays, config: ConfigRecord) -> Metrics:
        """The personalized evaluation of the model; control variates, if sent, are not
        part of it."""
        return super().evaluate({k: v for k, v in arrays.items() if not is_control(k)}, config)
