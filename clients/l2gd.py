"""L2GD (Hanzely and Richtarik, "Federated Learning of a Mixture of Global and Local
Models", 2020, arXiv 2002.05516, Algorithm 1), on the rounds of a federation.

Every client ``i`` keeps a personal model ``x_i`` (in ``context.state``; it starts as
the seeded initial model) for the objective

    min  (1/n) sum_i f_i(x_i)  +  (lambda / 2n) sum_i ||x_i - mean_j x_j||^2.

Each round the server flips a seeded coin (``strategies/l2gd.py``): with probability
``p`` an aggregation step, in which each sampled client moves ``x_i`` toward the mean
``x_bar`` the server sent,

    x_i <- x_i - theta (x_i - x_bar),    theta = lr lambda (1 - p) / p,

(the paper's aggregation step ``eta lambda / (n p)`` in units of its local step ``eta /
(n (1 - p))``, which is the round's ``lr``); otherwise a local step, in which ``x_i``
trains on the client's data for the round's epochs, as every other row's local update.
The client replies ``x_bar + (x_i^new - x_i^old)``, so that the server can keep
``x_bar`` the mean of all ``n`` personal models, not only of the sampled ones. Clients
are tested with ``x_i``.
"""

from __future__ import annotations

import math

from flwr.app import ConfigRecord, RecordDict

from fedpers import protocol
from fedpers.clients.base import PersonalizedClient
from fedpers.clients.common import Arrays, Metrics, config_int
from fedpers.config import RunConfig
from fedpers.families.personalized import AGGREGATE, L2GDSettings
from fedpers.models import load_part_arrays, part_arrays
from fedpers.training import evaluate_model as evaluate
from fedpers.training import train_model as train


class L2GDClient(PersonalizedClient):
    """A personal model ``x_i``: trained in local rounds, pulled toward the mean of all
    personal models in aggregation rounds."""

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        self.personal_model = self.kept_model()
        self.settings = run.group(L2GDSettings)

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """The round's step of ``x_i``; replies the server's mean moved by the change of
        ``x_i``."""
        generator, x, y, settings = self.start_round(arrays, config)
        model = self.personal_model
        before = part_arrays(model, protocol.MODEL_PARTS)
        loss = float("nan")
        if config_int(config, AGGREGATE):
            theta = self.settings.pull(settings.lr)
            after = {
                name: (old - theta * (old - arrays[name])).astype(old.dtype)
                for name, old in before.items()
            }
            load_part_arrays(model, after)
        else:
            stats = train(
                model,
                x,
                y,
                parts=protocol.MODEL_PARTS,
                epochs=config_int(config, protocol.EPOCHS),
                settings=settings,
                generator=generator,
                augment=self.augment,
            )
            loss = stats.loss if stats.steps else loss
            after = part_arrays(model, protocol.MODEL_PARTS)
        self.keep(model)
        reply = {
            name: (arrays[name] + (after[name] - before[name])).astype(arrays[name].dtype)
            for name in arrays
        }
        metrics = {protocol.NUM_EXAMPLES: float(len(y))}
        if not math.isnan(loss):  # an aggregation step trains nothing: no loss
            metrics[protocol.LOSS] = loss
        return reply, metrics

    def evaluate(self, arrays: Arrays, config: ConfigRecord) -> Metrics:
        """Test accuracy of the personal model ``x_i``."""
        stats = evaluate(
            self.personal_model, self.tensor(self.data.x_test), self.tensor(self.data.y_test)
        )
        return self._metrics(stats)
