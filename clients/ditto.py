"""Ditto (Li et al., "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021, Algorithm 1).

The server runs FedAvg on a global model ``w``. Each sampled client also keeps a
personal model ``v`` in ``context.state`` and trains it on its own loss plus
``(lambda / 2) ||v - w^t||^2`` toward the global model it received this round; the
global update itself is plain local SGD. Clients are evaluated with ``v``.
"""

from __future__ import annotations

import torch
from flwr.app import ConfigRecord, RecordDict

from fedpers import protocol
from fedpers.clients.base import PersonalizedClient
from fedpers.clients.common import Arrays, Metrics, config_int
from fedpers.config import RunConfig
from fedpers.families.personalized import DittoSettings
from fedpers.legacy_training import evaluate, train


class DittoClient(PersonalizedClient):
    """FedAvg's local update of ``w``, then the proximal update of the personal ``v``."""

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        # v starts as the seeded initial model, which is also the server's w^0.
        self.personal_model = self.kept_model()
        self.lam = run.group(DittoSettings).ditto_lambda

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """FedAvg's update of the global model, then ``v`` toward the received ``w^t``."""
        anchor = [self.tensor(arrays[name]) for name, _ in self.model.named_parameters()]
        reply, metrics = super().fit(arrays, config)
        v = self.personal_model
        lam = self.lam

        def proximal(_: torch.Generator) -> torch.Tensor:
            terms = [(p - a).pow(2).sum() for p, a in zip(v.parameters(), anchor, strict=True)]
            return 0.5 * lam * torch.stack(terms).sum()

        train(
            v,
            self.tensor(self.data.x_train),
            self.tensor(self.data.y_train),
            parts=protocol.MODEL_PARTS,
            epochs=config_int(config, protocol.EPOCHS),
            settings=self.sgd_settings(config),
            generator=self.generator("personal", config_int(config, protocol.ROUND)),
            augment=self.augment,
            penalty=proximal,
        )
        self.keep(v)
        return reply, metrics

    def evaluate(self, arrays: Arrays, config: ConfigRecord) -> Metrics:
        """Test accuracy of the personal model ``v``."""
        stats = evaluate(
            self.personal_model, self.tensor(self.data.x_test), self.tensor(self.data.y_test)
        )
        return self._metrics(stats)
