"""SCAFFOLD's server (Karimireddy et al., ICML 2020, Algorithm 1): the global model
``x`` and control variate ``c`` are one state, the model's arrays and the same arrays
under ``control.`` (``fedpers.algorithms.scaffold.CONTROL``), so that the round loop
sends both, screens both, and checkpoints both (an exact resume needs the clients'
``c_i`` too: ``client-state-dir``). Each round, over the replies ``S`` kept,

    x <- x + eta_g mean_S(y_i - x)        c <- c + (|S| / N) mean_S(c_i+ - c_i)

with the paper's unweighted means (the run's ``aggregation`` of the replies with equal
weights), ``eta_g`` = ``scaffold-server-lr`` and ``N`` the clients that train. A client
replies ``c + (c_i+ - c_i)`` for the variate (``fedpers/algorithms/scaffold.py``), so the mean of
what came back less ``c`` is the mean of the ``c_i+ - c_i``.
"""

from __future__ import annotations

import math

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedpers import protocol, records
from fedpers.algorithms.scaffold import CONTROL, ScaffoldSettings, is_control, variate_scale
from fedpers.strategies import screening
from fedpers.strategies.base import FedpersStrategy, step_toward

# A returned variate may differ from (x - y) / (K eta_l) computed here by this much,
# relative to its largest value: the client computes the same float64 quotient and
# rounds it to float32, so the two agree to the last bit; the margin is for safety.
VARIATE_RTOL = 1e-5


class Scaffold(FedpersStrategy):
    """FedAvg's rounds with SCAFFOLD's server step and its control variate."""

    def combine(
        self,
        arrays: list[dict[str, np.ndarray]],
        weights: list[float],
        reference: dict[str, np.ndarray],
    ) -> dict[str, np.ndarray]:
        """``x + eta_g (mean y - x)`` and ``c + (|S| / N) (mean returned - c)``, the
        means unweighted."""
        mean = super().combine(arrays, [1.0] * len(arrays), reference)
        eta = self.run.group(ScaffoldSettings).scaffold_server_lr
        share = len(arrays) / len(self.seen)
        return step_toward(reference, mean, lambda name: share if is_control(name) else eta)

    def train_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> dict[int, RecordDict]:
        """The base's, remembering the round's step size and epochs for the check of the
        returned variates (``variate_defect``)."""
        contents = super().train_contents(server_round, arrays, config, grid)
        self.sent_step = (
            records.number(config[protocol.LR], protocol.LR),
            records.config_int(config, protocol.EPOCHS),
        )
        return contents

    def checks(self) -> list[screening.Check]:
        """The base's, then: the returned variate is the one the reply's model implies."""
        return [*super().checks(), self.variate_defect]

    def variate_defect(self, reply: Message) -> str | None:
        """Why a reply's control variate is not ``(x - y) / (K eta)``, or None.

        An honest client returns exactly that (option II; ``fedpers/algorithms/
        scaffold.py``): ``x`` what was sent, ``y`` its model, ``eta`` the step size of
        the round's ``eta_l`` under the run's momentum (``variate_scale``) and ``K`` its
        steps, ``epochs x ceil(n / batch-size)`` for its ``n`` examples. So the variate
        is a function of the model the reply returns, which the update cap bounds
        against the round's other replies, and the server's ``c``,
        the mean of such variates, is bounded by them: a variate scaled on its own (x50,
        every round) used to pass each round's cap while ``c`` grew to 3.9e8 in five
        rounds, against norms it had itself inflated.
        """
        lr, epochs = self.sent_step
        arrays = screening.arrays_of(reply)
        n = int(screening.num_examples(reply))
        scale = variate_scale(lr, epochs * math.ceil(n / self.run.batch_size), self.run.momentum)
        for name, sent in self.current_shared.items():
            if is_control(name):
                continue
            returned = arrays[CONTROL + name].astype(np.float64)
            if scale == 0:  # no step: the client returns c as it came
                expected = self.current_shared[CONTROL + name].astype(np.float64)
            else:
                expected = ((sent.astype(np.float64) - arrays[name]) / scale).astype(np.float32)
            tolerance = VARIATE_RTOL * max(float(np.max(np.abs(expected), initial=0.0)), 1e-30)
            if not np.all(np.abs(returned - expected) <= tolerance):
                return (
                    f"control variate '{CONTROL}{name}' is not (x - y) / (K lr / (1 - momentum)) "
                    f"of the model it returned (K = {epochs} x ceil({n} / {self.run.batch_size}), "
                    f"momentum {self.run.momentum:g})"
                )
        return None

    def evaluate_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> dict[int, RecordDict]:
        """The model alone: evaluation needs no control variate."""
        model = ArrayRecord({k: v for k, v in arrays.items() if not is_control(k)})
        return super().evaluate_contents(server_round, model, config)
