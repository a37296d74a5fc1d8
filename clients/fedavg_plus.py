"""FedAvg+ (Jiang, Konecny, Rush and Kannan, "Improving Federated Learning
Personalization via Model Agnostic Meta Learning", 2019, arXiv 1909.12488), as FedEM's
code runs it for FedGMM's and FedEM's tables (``--locally_tune_clients``): FedAvg's
training, and before every test each client adapts a copy of the global model, all of
it, for the run's local ``epochs`` on its own training data at the run's ``lr``; the
copy is tested and dropped, so the next round's test adapts from the next global model.

It is not FedAvg+FT: that tunes the head alone, for ``finetune-epochs``, once, after
the last round. An unseen client (``unseen-fraction``) adapts on the part of its data
that FedGMM's Table 4 protocol gives it to adapt on, and is tested on the rest.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from flwr.app import ConfigRecord

from fedpers import protocol
from fedpers.clients.base import PersonalizedClient
from fedpers.clients.common import Arrays, Metrics, config_float, config_int
from fedpers.data.client import adaptation_split
from fedpers.training import evaluate_model as evaluate
from fedpers.training import train_model as train


class FedAvgPlusClient(PersonalizedClient):
    """FedAvg's client, tested after adapting the whole model locally."""

    def evaluate(self, arrays: Arrays, config: ConfigRecord) -> Metrics:
        """Test accuracy of the global model after ``epochs`` of local training."""
        self.load_shared(arrays)
        data = self.data
        x_adapt, y_adapt, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
        if config_int(config, protocol.UNSEEN, default=0):
            x_adapt, y_adapt, x_test, y_test = adaptation_split(
                data,
                config_float(config, protocol.ADAPT_FRACTION),
                self.run.seed,
                self.partition_id,
            )
        model = self.adapted(x_adapt, y_adapt, config)
        return self._metrics(evaluate(model, self.tensor(x_test), self.tensor(y_test)))

    def adapted(self, x: np.ndarray, y: np.ndarray, config: ConfigRecord) -> torch.nn.Module:
        """A copy of the loaded model after the run's ``epochs`` on ``(x, y)``, at the
        round's lr, its batch order drawn from the round (the model itself unchanged)."""
        model = copy.deepcopy(self.model)
        train(
            model,
            self.tensor(x),
            self.tensor(y),
            parts=protocol.MODEL_PARTS,
            epochs=self.run.epochs,
            settings=self.sgd_settings(config),
            generator=self.generator("adapt", config_int(config, protocol.ROUND, default=0)),
            augment=self.augment,
        )
        return model
