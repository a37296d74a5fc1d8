"""pFedMe (T Dinh, Tran and Nguyen, "Personalized Federated Learning with Moreau
Envelopes", NeurIPS 2020, Algorithm 1).

Each client's personal model ``theta_i`` approximately minimizes its loss plus
``(lambda / 2) ||theta - w_i||^2`` around a local model ``w_i``, the Moreau envelope's
inner problem. A sampled client starts ``w_i`` and ``theta`` at the global ``w`` it
received and, for each mini-batch ``D`` of its local update (the run's ``epochs``
passes in the run's random order: the paper's ``R`` local rounds),

    K times:  theta <- theta - personal_lr (grad f(theta; D) + lambda (theta - w_i))
    then:     w_i   <- w_i - lr lambda (w_i - theta)

(``theta`` carries over from one mini-batch to the next, as in the authors' code), and
replies ``w_i``; the server steps ``w <- (1 - beta) w + beta mean_S(w_i)``
(``strategies/pfedme.py``). The steps are the paper's plain ones: the run's momentum
and weight decay do not apply. The last ``theta`` is the client's personal model, kept
in ``context.state`` and tested; a client not yet sampled holds the initial model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, RecordDict

from fedpers import protocol
from fedpers.clients.base import PersonalizedClient
from fedpers.clients.common import Arrays, Metrics, config_int
from fedpers.config import RunConfig
from fedpers.families.personalized import PFedMeSettings
from fedpers.legacy_training import dropout_stream, evaluate, mini_batches
from fedpers.models import load_part_arrays, part_arrays


class PFedMeClient(PersonalizedClient):
    """pFedMe's local rounds: K steps on the inner problem, then a step of ``w_i``."""

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        self.personal_model = self.kept_model()
        self.settings = run.group(PFedMeSettings)

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """Algorithm 1's local rounds from the received ``w``; replies ``w_i``."""
        generator, x, y, settings = self.start_round(arrays, config)
        lam, k, personal_lr = (
            self.settings.pfedme_lambda,
            self.settings.pfedme_k,
            self.settings.pfedme_personal_lr,
        )
        theta_model = self.personal_model
        load_part_arrays(theta_model, part_arrays(self.model, protocol.MODEL_PARTS))
        w = [p.detach().clone() for p in self.model.parameters()]
        theta = list(theta_model.parameters())
        epochs = config_int(config, protocol.EPOCHS)
        loss_sum, seen = 0.0, 0
        theta_model.train()
        with dropout_stream(generator, x.device.type):
            for index in mini_batches(len(y), epochs, settings.batch_size, generator):
                xb, yb = x[index], y[index]
                if self.augment is not None:
                    xb = self.augment(xb, generator)
                for _ in range(k):
                    loss = F.cross_entropy(theta_model(xb), yb)
                    grads = torch.autograd.grad(loss, theta)
                    with torch.no_grad():
                        for t, g, wi in zip(theta, grads, w, strict=True):
                            t.sub_(personal_lr * (g + lam * (t - wi)))
                with torch.no_grad():
                    for wi, t in zip(w, theta, strict=True):
                        wi.sub_(settings.lr * lam * (wi - t))
                loss_sum += loss.item() * len(index)
                seen += len(index)
        with torch.no_grad():
            for p, wi in zip(self.model.parameters(), w, strict=True):
                p.copy_(wi)
        self.keep(theta_model)
        metrics = {protocol.NUM_EXAMPLES: float(len(y))}
        if seen:
            metrics[protocol.LOSS] = loss_sum / seen  # of theta, on the last inner step
        return part_arrays(self.model, self.shared), metrics

    def evaluate(self, arrays: Arrays, config: ConfigRecord) -> Metrics:
        """Test accuracy of the personal model ``theta``."""
        stats = evaluate(
            self.personal_model, self.tensor(self.data.x_test), self.tensor(self.data.y_test)
        )
        return self._metrics(stats)
