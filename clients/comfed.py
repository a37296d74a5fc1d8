"""CoMFed (Badi, Ben Issaid and Bennis, "Communication-Efficient and Robust Multi-Modal
Federated Learning via Latent-Space Consensus", IEEE WCL 2026, arXiv 2603.19067),
between Sheaf-FRL's agents of any architecture and latent dimension ``d_i``.

Agent ``i`` keeps a projection ``P_i`` (``d x d_i``, ``d`` = ``comfed-dim``,
Xavier-uniform from the run's seed) into a shared latent space. Each round it sends its
projected class prototypes ``u_im = P_i v_bar_im`` (the mean eval-mode latent of its
training samples of class ``m``; zeros and count 0 for a class it does not hold) to its
neighbours, and receives theirs. It then trains, over each mini-batch,

    CE(head(z), y) + lambda mean_m ||P_i v_bar_m(batch) - c_im||^2,   z = body(x),

the mean over the batch's classes that some neighbour holds, ``v_bar_m(batch)`` the
batch's mean latent of class ``m`` and ``c_im`` the mean of the neighbours' ``u_jm``
(held fixed), with one step of the run's optimizer on the model and one on ``P_i``
from the same gradient, each clipped at ``sheaf-clip``. This is the paper's objective
(eq. 7) with the concurrent steps (8)-(9) as the Sheaf-FRL authors' baseline takes
them; the paper's geometric-median (robust) consensus is not implemented: the mean is
the variant the Sheaf-FRL paper compares against. Neighbours' prototypes come from the
start of the round (one exchange a round).

Agents are tested with their own head on ``z`` (private accuracy). A receiver ``j``
decodes a sender's latents through the learned maps, ``pinv(P_j) P_i z``, with no
post-hoc alignment (whitening mode ``projection``, the paper's), and also aligned on
the pilots as the other baselines are.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedpers import protocol, records, sheaf
from fedpers.clients.common import Arrays, Metrics, config_int
from fedpers.clients.sheaf import SheafClient
from fedpers.config import RunConfig
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import PROTOTYPE_COUNTS, PROTOTYPES, ComFedSettings, Whitening
from fedpers.legacy_training import SGD, dropout_stream, mini_batches
from fedpers.seeding import rng

STATE_PROJECTION = "comfed.projection"


class ComFedClient(SheafClient):
    """A Sheaf-FRL agent with a learned projection into a shared latent space."""

    cooperative = False  # no pilots are relayed while training

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        self.comfed = run.group(ComFedSettings)
        self.neighbours = sheaf.neighbours(sheaf_family.run_graph(run), partition_id)
        self.projection = torch.nn.Parameter(self.tensor(self._stored_projection()))

    def _stored_projection(self) -> np.ndarray:
        record = self.state.get(STATE_PROJECTION)
        if isinstance(record, ArrayRecord):
            return records.values(record[STATE_PROJECTION]).copy()
        d, own = sheaf_family.comfed_dim(self.run), self.dims[self.partition_id]
        bound = np.sqrt(6.0 / (d + own))  # Xavier-uniform, as the Sheaf-FRL authors'
        generator = rng(self.run.seed, "comfed-projection", self.partition_id)
        return generator.uniform(-bound, bound, size=(d, own)).astype(np.float32)

    def save(self) -> None:
        super().save()
        self.state[STATE_PROJECTION] = ArrayRecord(
            {STATE_PROJECTION: Array(self.projection.detach().cpu().numpy().copy())}
        )

    # -------------------------------------------------------------- exchanges
    def prototypes_message(self, config: ConfigRecord) -> Arrays:
        """``P_i v_bar_m`` for every class (float32, zeros where not held) and the
        training samples behind each (float64)."""
        means, counts = sheaf.class_means(
            self.raw_latents(self.data.x_train), self.data.y_train, self.run.num_classes
        )
        projected = means @ self.projection.detach().cpu().numpy().astype(np.float64).T
        self.save()
        return {PROTOTYPES: projected.astype(np.float32), PROTOTYPE_COUNTS: counts}

    def targets(self, arrays: Arrays) -> tuple[torch.Tensor, torch.Tensor]:
        """``c_im``: per class, the mean of the neighbours' projected prototypes over
        those that hold the class; and which classes have one."""
        classes, d = self.run.num_classes, sheaf_family.comfed_dim(self.run)
        total, held = np.zeros((classes, d)), np.zeros(classes)
        for j in self.neighbours:
            name = sheaf_family.from_agent(PROTOTYPES, j)
            if name not in arrays:
                continue
            has = arrays[sheaf_family.from_agent(PROTOTYPE_COUNTS, j)] > 0
            total[has] += arrays[name][has].astype(np.float64)
            held += has
        means = total / np.maximum(held, 1.0)[:, None]
        return self.tensor(means.astype(np.float32)), self.tensor(held > 0)

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """Epochs on CE + lambda x the consensus term; one step on the model and one on
        ``P_i`` per mini-batch."""
        generator = self.generator("train", config_int(config, protocol.ROUND))
        x, y = self.tensor(self.data.x_train), self.tensor(self.data.y_train)
        targets, known = self.targets(arrays)
        settings = self.sgd_settings(config)
        clip = sheaf_family.settings(self.run).sheaf_clip
        params = list(self.model.parameters())
        model_step, map_step = SGD(params, settings), SGD([self.projection], settings)
        lam = self.comfed.comfed_lambda
        loss_sum, consensus_sum, seen = 0.0, 0.0, 0
        self.model.train()
        with dropout_stream(generator, x.device.type):
            batches = mini_batches(
                len(y), config_int(config, protocol.EPOCHS), settings.batch_size, generator
            )
            for index in batches:
                xb, yb = x[index], y[index]
                z = self.model.body(xb)
                loss = F.cross_entropy(self.model.head(z), yb)
                consensus = self.consensus(z, yb, targets, known)
                if lam > 0 and consensus is not None:
                    loss = loss + lam * consensus
                    consensus_sum += float(consensus.detach()) * len(index)
                model_step.zero_grad()
                map_step.zero_grad()
                loss.backward()
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, clip)
                    torch.nn.utils.clip_grad_norm_([self.projection], clip)
                model_step.step()
                map_step.step()
                loss_sum += loss.item() * len(index)
                seen += len(index)
        model_step.zero_grad()
        map_step.zero_grad()
        self.save()
        metrics: Metrics = {protocol.NUM_EXAMPLES: float(len(self.data.y_train))}
        if seen:
            metrics[protocol.LOSS] = loss_sum / seen
            metrics[sheaf_family.PENALTY] = consensus_sum / seen
        return {}, metrics

    def consensus(
        self, z: torch.Tensor, y: torch.Tensor, targets: torch.Tensor, known: torch.Tensor
    ) -> torch.Tensor | None:
        """The mean over the batch's classes with a target of ``||P v_bar_m - c_m||^2``,
        or None without any."""
        terms = []
        for m in torch.unique(y).tolist():
            if bool(known[m]):
                prototype = self.projection @ z[y == m].mean(dim=0)
                terms.append(((prototype - targets[m]) ** 2).sum())
        return torch.stack(terms).mean() if terms else None

    # ------------------------------------------------------------------ tests
    def latents_message(self, config: ConfigRecord) -> Arrays:
        """With whitening ``projection``: pilots and test latents through ``P_i``
        (the paper's); otherwise as every agent of the family."""
        if str(config.get(sheaf_family.WHITENING, "")) != Whitening.PROJECTION:
            return super().latents_message(config)
        projection = self.projection.detach().cpu().numpy().astype(np.float64)
        return {
            sheaf_family.PILOTS: self.raw_latents(self.pilots_x) @ projection.T,
            sheaf_family.LATENTS: self.raw_latents(self.data.x_test) @ projection.T,
            sheaf_family.LABELS: self.data.y_test.astype(np.int64),
        }

    def evaluate(self, arrays: Arrays, config: ConfigRecord) -> Metrics:
        """With whitening ``projection`` and ``communication = 1``: decode each
        neighbour's ``P_j z`` as ``pinv(P_i) P_j z`` with this agent's head."""
        mode = str(config.get(sheaf_family.WHITENING, ""))
        if not config_int(config, sheaf_family.COMMUNICATION, default=0) or mode != (
            Whitening.PROJECTION
        ):
            return super().evaluate(arrays, config)
        inverse = np.linalg.pinv(self.projection.detach().cpu().numpy().astype(np.float64))
        metrics: Metrics = {protocol.NUM_EXAMPLES: 1.0}
        accuracies = []
        for name in sorted(arrays):
            kind, sender = sheaf_family.agent_of(name)
            if kind != sheaf_family.LATENTS:
                continue
            labels = arrays[sheaf_family.from_agent(sheaf_family.LABELS, sender)]
            if len(labels) == 0:
                continue
            received = arrays[name] @ inverse.T
            with torch.no_grad():
                self.model.eval()
                logits = self.model.head(self.tensor(received.astype(np.float32)))
            accuracy = float(np.mean(logits.argmax(dim=1).cpu().numpy() == labels))
            metrics[sheaf_family.edge_metric(sender)] = accuracy
            accuracies.append(accuracy)
        metrics[protocol.ACCURACY] = float(np.mean(accuracies)) if accuracies else float("nan")
        return metrics
