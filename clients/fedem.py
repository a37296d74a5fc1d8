"""FedEM client (Marfoq et al., "Federated Multi-Task Learning under a Mixture of
Distributions", NeurIPS 2021), and the mixture machinery FedGMM extends.

The client holds M2 shared learners and its personal mixture weights ``pi_c`` (in
``context.state``). Each round: an E-step over its training samples (responsibilities
``q_i(m) ~ pi_c(m) P_m(y_i | x_i)``), the M-step ``pi_c = mean_i q_i``, then every
learner trains on the responsibility-weighted loss. It replies with the learners and
``gamma_c = sum_i q_i``. Prediction: ``sum_m p(m | x) softmax(f_m(x))``.

FedGMM adds Gaussian components over an embedding of ``x``: it overrides
``log_densities`` (FedEM: one cell with ``log N = 0``) and ``statistics``.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from torch.nn import functional as F

from fedpers import gmm, protocol, records
from fedpers.clients.base import TorchClient
from fedpers.clients.common import Arrays, Metrics, config_float, config_int
from fedpers.config import RunConfig
from fedpers.data.client import adaptation_split
from fedpers.families import mixture as mixture_family
from fedpers.models import SplitModel, build_model, load_part_arrays, part_arrays
from fedpers.seeding import int_seed
from fedpers.training import train_model as train


class FedEMClient(TorchClient):
    """M2 shared learners mixed by personal weights; no density on ``x``."""

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        # Learners start from different seeds: identical learners would get identical
        # responsibilities and never separate.
        self.learners: list[SplitModel] = [
            build_model(
                run.model_name,
                run.num_classes,
                int_seed(run.seed, "learner", m),
                run.input_shape,
            )
            for m in range(mixture_family.settings(run).mixture_learners)
        ]
        for learner in self.learners:
            learner.to(self.device)
        stored = state.get(protocol.STATE_PERSONAL)
        if stored is not None:
            assert isinstance(stored, ArrayRecord)
            self.weights = records.values(stored[mixture_family.MIXTURE_WEIGHTS])
        else:
            cells = self.components * mixture_family.settings(run).mixture_learners
            self.weights = np.full(
                (self.components, mixture_family.settings(run).mixture_learners), 1.0 / cells
            )

    @property
    def components(self) -> int:
        """Number of Gaussian components M1 (FedEM: one, carrying no density)."""
        return 1

    # ------------------------------------------------------------------ FedGMM hooks
    def log_densities(self, x: np.ndarray, arrays: Arrays) -> np.ndarray:
        """``log N(z; mu_m1, Sigma_m1)`` (n, M1); FedEM has none: zeros (n, 1)."""
        return np.zeros((len(x), 1))

    def statistics(self, x: np.ndarray, responsibilities: np.ndarray, arrays: Arrays) -> Arrays:
        """Arrays to send besides learners and gamma; FedEM sends none."""
        return {}

    # ---------------------------------------------------------------------- pieces
    def initial_arrays(self) -> Arrays:
        """The seeded learners, each under its ``learnerM.`` prefix."""
        return {
            mixture_family.learner_prefix(m) + name: value
            for m, learner in enumerate(self.learners)
            for name, value in part_arrays(learner, protocol.MODEL_PARTS).items()
        }

    def load_learners(self, arrays: Arrays) -> None:
        """Overwrite the learners with the server's; every learner must be there."""
        for m, learner in enumerate(self.learners):
            prefix = mixture_family.learner_prefix(m)
            mine = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
            expected = set(part_arrays(learner, protocol.MODEL_PARTS))
            if set(mine) != expected:
                raise ValueError(
                    f"{self.run.algorithm} client expected learner {m} arrays {sorted(expected)}, "
                    f"received {sorted(mine)}"
                )
            load_part_arrays(learner, mine)

    @torch.no_grad()
    def learner_log_probs(self, x: np.ndarray) -> np.ndarray:
        """``log softmax(f_m(x))`` of every learner, shape (n, M2, K)."""
        inputs = self.tensor(x)
        out = []
        for learner in self.learners:
            learner.eval()
            out.append(F.log_softmax(learner(inputs), dim=1).cpu().numpy())
        return np.stack(out, axis=1).astype(float)

    def mixture_log_weights(self, arrays: Arrays) -> np.ndarray:
        """``log pi`` used in the E-step: personal, or the server's if weights are shared."""
        if (
            mixture_family.settings(self.run).gmm_shared_weights
            and mixture_family.MIXTURE_WEIGHTS in arrays
        ):
            return np.log(arrays[mixture_family.MIXTURE_WEIGHTS])
        return np.log(self.weights)

    # -------------------------------------------------------------------- messages
    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """E-step, M-step for ``pi_c``, then responsibility-weighted learner epochs."""
        self.load_learners(arrays)
        x, y = self.data.x_train, self.data.y_train
        log_probs = self.learner_log_probs(x)
        log_lik = log_probs[np.arange(len(y)), :, y]  # (n, M2)
        log_gauss = self.log_densities(x, arrays)
        responsibilities, log_joint = gmm.e_step(
            self.mixture_log_weights(arrays), log_gauss, log_lik
        )
        self.weights = gmm.update_weights(responsibilities)
        self.state[protocol.STATE_PERSONAL] = ArrayRecord(
            {mixture_family.MIXTURE_WEIGHTS: Array(self.weights.copy())}
        )
        extra = self.statistics(x, responsibilities, arrays)
        learner_weights = self.tensor(responsibilities.sum(axis=1).astype(np.float32))
        server_round = config_int(config, protocol.ROUND)
        settings = self.sgd_settings(config)
        x_t, y_t = self.tensor(x), self.tensor(y)
        for m, learner in enumerate(self.learners):
            generator = self.generator("train", server_round, m)
            train(
                learner,
                x_t,
                y_t,
                parts=protocol.MODEL_PARTS,
                epochs=config_int(config, protocol.EPOCHS),
                settings=settings,
                generator=generator,
                sample_weights=learner_weights[:, m],
            )
        mixture = gmm.predict_proba(np.log(self.weights), log_gauss, np.exp(log_probs))
        loss = float(-np.mean(np.log(np.maximum(mixture[np.arange(len(y)), y], 1e-300))))
        reply = {
            **self.initial_arrays(),
            **extra,
            mixture_family.GAMMA: responsibilities.sum(axis=0),
        }
        return reply, {
            protocol.NUM_EXAMPLES: float(len(y)),
            protocol.LOSS: loss,
            mixture_family.LOG_LIKELIHOOD: float(np.mean(log_joint)),
        }

    def evaluate(self, arrays: Arrays, config: ConfigRecord) -> Metrics:
        """Test accuracy of the client's mixture; unseen clients first adapt ``pi``."""
        self.load_learners(arrays)
        log_weights = self.mixture_log_weights(arrays)
        if config_int(config, protocol.UNSEEN, default=0):
            x_adapt, y_adapt, x, y = adaptation_split(
                self.data,
                config_float(config, protocol.ADAPT_FRACTION),
                self.run.seed,
                self.partition_id,
            )
            start = arrays.get(mixture_family.MIXTURE_WEIGHTS, np.exp(log_weights))
            log_probs = self.learner_log_probs(x_adapt)
            adapted = gmm.adapt_weights(
                self.log_densities(x_adapt, arrays),
                log_probs[np.arange(len(y_adapt)), :, y_adapt],
                start,
            )
            log_weights = np.log(adapted)
        else:
            x, y = self.data.x_test, self.data.y_test
        if len(y) == 0:
            return {protocol.NUM_EXAMPLES: 0.0, protocol.ACCURACY: 0.0, protocol.LOSS: 0.0}
        probs = gmm.predict_proba(
            log_weights, self.log_densities(x, arrays), np.exp(self.learner_log_probs(x))
        )
        chosen = probs[np.arange(len(y)), y]
        return {
            protocol.NUM_EXAMPLES: float(len(y)),
            protocol.ACCURACY: float(np.mean(probs.argmax(axis=1) == y)),
            protocol.LOSS: float(-np.mean(np.log(np.maximum(chosen, 1e-300)))),
        }
