"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang and Zhang, "FedProto: Federated Prototype
Learning across Heterogeneous Clients", AAAI 2022, Algorithm 1), between Sheaf-FRL's
agents: encoders of any architecture with one latent dimension ``d``; no model
parameter leaves an agent.

Each round every agent receives the global prototypes ``C_bar^j`` (the mean latent of
class ``j`` over all agents, ``strategies/fedproto.py``; none in round 1) and trains its
whole model for the round's epochs on

    CE(head(z), y) + lambda mean ||z - C_bar^y||^2,    z = body(x),

over each mini-batch (the mean over the batch's samples and the latent's ``d``
entries, as the authors' ``nn.MSELoss``; samples of a class without a global prototype
add nothing). Then it sends its own prototypes ``C_i^j``, the mean eval-mode latent of
its training samples of class ``j``, and how many samples each holds. Steps are the
run's optimizer with Sheaf-FRL's gradient clip, as every agent of the family trains.
Agents are tested with their own head (private accuracy) and, after the last round,
aligned on the pilots as Sheaf-FRL's baselines are (communication accuracy).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, RecordDict

from fedpers import protocol, sheaf
from fedpers.clients.common import Arrays, Metrics, config_int
from fedpers.clients.sheaf import SheafClient
from fedpers.config import RunConfig
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import PROTOTYPE_COUNTS, PROTOTYPES, FedProtoSettings
from fedpers.legacy_training import SGD, dropout_stream, mini_batches


class FedProtoClient(SheafClient):
    """A Sheaf-FRL agent that shares class prototypes instead of pilots."""

    cooperative = False  # no pilots are relayed while training

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        self.fedproto_lambda = run.group(FedProtoSettings).fedproto_lambda

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """Epochs on the loss plus the prototype term; replies this agent's prototypes."""
        generator = self.generator("train", config_int(config, protocol.ROUND))
        x, y = self.tensor(self.data.x_train), self.tensor(self.data.y_train)
        classes, d = self.run.num_classes, self.dims[self.partition_id]
        targets = torch.zeros(classes, d, device=self.device)
        known = torch.zeros(classes, dtype=torch.bool, device=self.device)
        if PROTOTYPES in arrays:
            targets = self.tensor(arrays[PROTOTYPES].astype(np.float32))
            known = self.tensor(arrays[PROTOTYPE_COUNTS]) > 0
        settings = self.sgd_settings(config)
        clip = sheaf_family.settings(self.run).sheaf_clip
        params = list(self.model.parameters())
        optimizer = SGD(params, settings)
        lam = self.fedproto_lambda
        loss_sum, seen = 0.0, 0
        self.model.train()
        with dropout_stream(generator, x.device.type):
            batches = mini_batches(
                len(y), config_int(config, protocol.EPOCHS), settings.batch_size, generator
            )
            for index in batches:
                xb, yb = x[index], y[index]
                z = self.model.body(xb)
                loss = F.cross_entropy(self.model.head(z), yb)
                mask = known[yb]
                if lam > 0 and bool(mask.any()):
                    # nn.MSELoss over the batch: the mean over samples and entries,
                    # samples of a class without a global prototype counted as 0
                    apart = (z - targets[yb]).pow(2).mean(dim=1) * mask
                    loss = loss + lam * apart.mean()
                optimizer.zero_grad()
                loss.backward()
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, clip)
                optimizer.step()
                loss_sum += loss.item() * len(index)
                seen += len(index)
        optimizer.zero_grad()
        self.save()
        prototypes, counts = self.prototypes()
        metrics = {protocol.NUM_EXAMPLES: float(len(self.data.y_train))}
        if seen:
            metrics[protocol.LOSS] = loss_sum / seen
        return {PROTOTYPES: prototypes, PROTOTYPE_COUNTS: counts}, metrics

    def prototypes(self) -> tuple[np.ndarray, np.ndarray]:
        """Mean eval-mode latent of each class's training samples (zeros for a class
        this agent does not hold) and the samples behind each (float64)."""
        means, counts = sheaf.class_means(
            self.raw_latents(self.data.x_train), self.data.y_train, self.run.num_classes
        )
        return means.astype(np.float32), counts
