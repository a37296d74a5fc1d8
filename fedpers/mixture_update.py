"""The mixture family's local update of a cohort (the device side; torch): FedEM's and
FedGMM's E-step, M-step of the personal weights, learner epochs and prediction.

A cohort of K clients, each training the M2 shared learners, is K x M2 independent
models: one ``training.Stack`` with client ``k``'s learner ``m`` at ``k * M2 + m``, each
trained on its client's samples weighted by that learner's responsibilities, from its
own generator (``train``, the round, ``m``: the seeds a client alone used). The E-step
needs every learner's log-probabilities on its client's samples: one batched forward
(``training.logits``), then the numpy E-step (``fedpers.gmm``) client by client, as a
client alone computes it. The family names this module as its update
(``FamilySpec.update``): the ClientApp imports it on the device, so the server never
imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch.nn import functional as F

from fedpers import gmm, protocol, records
from fedpers.cohort import Arrays, Cohort, Member, Metrics, Reply
from fedpers.data.client import adaptation_split
from fedpers.families import mixture
from fedpers.models import build_model, part_arrays
from fedpers.protocol import MODEL_PARTS
from fedpers.seeding import int_seed
from fedpers.training import CohortData, Stack, logits, train
from fedpers.update import Local


@dataclass
class EStep:
    """One member's E-step and M-step of ``pi_c``, before its learners train."""

    log_probs: np.ndarray  # every learner's log P(. | x_i): (n, M2, classes)
    log_gauss: np.ndarray  # the components' log-densities: (n, M1)
    responsibilities: np.ndarray  # q_i(m1, m2): (n, M1, M2)
    log_joint: np.ndarray  # log P_c(x_i, y_i): (n,)
    weights: np.ndarray  # the new pi_c: (M1, M2)
    extra: Arrays  # the densities' statistics to send


class Mixture(Local):
    """A cohort of the mixture family: each member's M2 learners (received from the
    server) and its personal mixture weights ``pi_c`` (in its ``context.state``).

    Parameters
    ----------
    cohort : Cohort
        The members, the run configuration and the round's settings.
    densities : mixture.Densities
        What the row models of the inputs (FedEM: nothing; FedGMM: Gaussians).
    """

    def __init__(self, cohort: Cohort, densities: mixture.Densities) -> None:
        super().__init__(cohort)
        self.densities = densities
        self.settings = mixture.settings(self.run)
        self.learners = self.settings.mixture_learners
        self.components = densities.components(self.run)

    @cached_property
    def seeded(self) -> list[torch.nn.Module]:
        """The seeded learners every process builds; they start from different seeds:
        identical learners would get identical responsibilities and never separate."""
        run = self.run
        return [
            build_model(
                run.model_name, run.num_classes, int_seed(run.seed, "learner", m), run.input_shape
            )
            for m in range(self.learners)
        ]

    def initial_arrays(self) -> Arrays:
        """The seeded learners, each under its ``learnerM.`` prefix."""
        return {
            mixture.learner_prefix(m) + name: value
            for m, learner in enumerate(self.seeded)
            for name, value in part_arrays(learner, MODEL_PARTS).items()
        }

    def received(self, member: Member) -> list[Arrays]:
        """The member's learners as the server sent them, each by the model's names.

        Raises
        ------
        ValueError
            If a learner's arrays are not exactly the model's.
        """
        expected = {n for n in self.seeded[0].state_dict() if n.split(".", 1)[0] in MODEL_PARTS}
        learners = []
        for m in range(self.learners):
            prefix = mixture.learner_prefix(m)
            mine = {k[len(prefix) :]: v for k, v in member.arrays.items() if k.startswith(prefix)}
            if set(mine) != expected:
                raise ValueError(
                    f"{self.run.algorithm} client expected learner {m} arrays "
                    f"{sorted(expected)}, received {sorted(mine)}"
                )
            learners.append(mine)
        return learners

    def stacked(self) -> Stack:
        """Every member's learners: member ``k``'s learner ``m`` at ``k * M2 + m``."""
        arrays = [learner for member in self.members for learner in self.received(member)]
        return self.stack(self.seeded[0], arrays)

    def repeated(self, data: CohortData) -> CohortData:
        """Each member's samples once for each of its learners (the stack's layout)."""
        m2 = self.learners
        return CohortData(
            data.x.repeat_interleave(m2, dim=0),
            data.y.repeat_interleave(m2, dim=0),
            [n for n in data.counts for _ in range(m2)],
        )

    def log_probs(self, stack: Stack, data: CohortData) -> list[np.ndarray]:
        """``log softmax(f_m(x))`` of every member's learners on its samples of
        ``data``: one (n, M2, classes) array per member."""
        m2 = self.learners
        every = self.repeated(data)
        out = F.log_softmax(logits(stack, every.x, every.counts), dim=-1).cpu().numpy()
        return [
            np.stack([out[k * m2 + m, :n] for m in range(m2)], axis=1).astype(float)
            for k, n in enumerate(data.counts)
        ]

    def weights(self, member: Member) -> np.ndarray:
        """The member's ``pi_c``: what it stored last, else uniform over the cells."""
        stored = member.state.get(protocol.STATE_PERSONAL)
        if stored is not None:
            assert isinstance(stored, ArrayRecord)
            return records.values(stored[mixture.MIXTURE_WEIGHTS])
        cells = self.components * self.learners
        return np.full((self.components, self.learners), 1.0 / cells)

    def log_weights(self, member: Member) -> np.ndarray:
        """``log pi`` of the E-step: personal, or the server's if weights are shared."""
        if self.settings.gmm_shared_weights and mixture.MIXTURE_WEIGHTS in member.arrays:
            return np.log(member.arrays[mixture.MIXTURE_WEIGHTS])
        return np.log(self.weights(member))

    # ------------------------------------------------------------------- training
    def e_step(self, member: Member, log_probs: np.ndarray, x: np.ndarray, y: np.ndarray) -> EStep:
        """The member's responsibilities over its samples ``(x, y)``, its new ``pi_c``
        (``pi_c = mean_i q_i``) and the densities' statistics."""
        log_lik = log_probs[np.arange(len(y)), :, y]  # (n, M2)
        log_gauss = self.densities.log_densities(self.run, x, member.arrays)
        responsibilities, log_joint = gmm.e_step(self.log_weights(member), log_gauss, log_lik)
        weights = gmm.update_weights(responsibilities)
        extra = self.densities.statistics(self.run, x, responsibilities, member.arrays)
        return EStep(log_probs, log_gauss, responsibilities, log_joint, weights, extra)

    def train_learners(self, stack: Stack, data: CohortData, steps: Sequence[EStep]) -> None:
        """Every learner's epochs on its member's samples, each sample weighted by the
        learner's responsibility ``sum_m1 q_i(m1, m)``, from its own generator."""
        m2 = self.learners
        every = self.repeated(data)
        weights = torch.zeros((len(every.counts), every.x.shape[1]), dtype=torch.float32)
        for k, step in enumerate(steps):
            summed = torch.from_numpy(step.responsibilities.sum(axis=1).astype(np.float32))
            for m in range(m2):
                weights[k * m2 + m, : len(summed)] = summed[:, m]
        generators = [self.generators("train", self.round, m) for m in range(m2)]
        train(
            stack,
            every,
            parts=MODEL_PARTS,
            epochs=records.config_int(self.config, protocol.EPOCHS),
            settings=self.sgd(),
            generators=[generators[m][k] for k in range(self.size) for m in range(m2)],
            sample_weights=weights.to(self.device),
        )

    def fit(self) -> list[Reply]:
        """Each member's E-step and M-step of ``pi_c``, then the responsibility-weighted
        epochs of every learner; replies the learners, ``gamma_c = sum_i q_i`` and the
        densities' statistics, and keeps ``pi_c``."""
        stack = self.stacked()
        data = self.train_data()
        every = self.log_probs(stack, data)
        steps = [
            self.e_step(member, log_probs, d.x_train, d.y_train)
            for member, log_probs, d in zip(self.members, every, self.data, strict=True)
        ]
        self.train_learners(stack, data, steps)
        trained = stack.arrays(MODEL_PARTS)
        m2 = self.learners
        replies = []
        for k, (member, step, d) in enumerate(zip(self.members, steps, self.data, strict=True)):
            member.state[protocol.STATE_PERSONAL] = ArrayRecord(
                {mixture.MIXTURE_WEIGHTS: Array(step.weights.copy())}
            )
            learners = {
                mixture.learner_prefix(m) + name: value
                for m in range(m2)
                for name, value in trained[k * m2 + m].items()
            }
            replies.append(_fit_reply(learners, step, d.y_train))
        return replies

    # ----------------------------------------------------------------- evaluation
    def evaluate(self) -> list[Metrics]:
        """Each member's test accuracy and loss with its mixture's prediction
        ``sum_m p(m | x) softmax(f_m(x))``; an unseen member (config ``unseen``) first
        adapts ``pi`` on its adaptation split (EM on the weights alone) and is tested
        on the rest."""
        stack = self.stacked()
        log_weights = [self.log_weights(member) for member in self.members]
        if records.config_int(self.config, protocol.UNSEEN, default=0):
            fraction = records.config_float(self.config, protocol.ADAPT_FRACTION)
            splits = [
                adaptation_split(d, fraction, self.run.seed, member.partition)
                for d, member in zip(self.data, self.members, strict=True)
            ]
            log_weights = self.adapted(stack, log_weights, [(s[0], s[1]) for s in splits])
            tests = [(s[2], s[3]) for s in splits]
        else:
            tests = [(d.x_test, d.y_test) for d in self.data]
        every = self.log_probs(stack, self.cohort_data(*zip(*tests, strict=True)))
        return [
            self.test(member, weights, x, y, log_probs)
            for member, weights, (x, y), log_probs in zip(
                self.members, log_weights, tests, every, strict=True
            )
        ]

    def adapted(
        self,
        stack: Stack,
        log_weights: Sequence[np.ndarray],
        samples: Sequence[tuple[np.ndarray, np.ndarray]],
    ) -> list[np.ndarray]:
        """Each member's ``log pi`` adapted on its ``samples`` (EM on the weights,
        learners and components fixed), from the server's weights if it sent them."""
        every = self.log_probs(stack, self.cohort_data(*zip(*samples, strict=True)))
        out = []
        for member, weights, (x, y), log_probs in zip(
            self.members, log_weights, samples, every, strict=True
        ):
            start = member.arrays.get(mixture.MIXTURE_WEIGHTS, np.exp(weights))
            adapted = gmm.adapt_weights(
                self.densities.log_densities(self.run, x, member.arrays),
                log_probs[np.arange(len(y)), :, y],
                start,
            )
            out.append(np.log(adapted))
        return out

    def test(
        self,
        member: Member,
        log_weights: np.ndarray,
        x: np.ndarray,
        y: np.ndarray,
        log_probs: np.ndarray,
    ) -> Metrics:
        """One member's figures on ``(x, y)``: samples, accuracy, loss."""
        if len(y) == 0:
            return {protocol.NUM_EXAMPLES: 0.0, protocol.ACCURACY: 0.0, protocol.LOSS: 0.0}
        probs = gmm.predict_proba(
            log_weights, self.densities.log_densities(self.run, x, member.arrays), np.exp(log_probs)
        )
        chosen = probs[np.arange(len(y)), y]
        return {
            protocol.NUM_EXAMPLES: float(len(y)),
            protocol.ACCURACY: float(np.mean(probs.argmax(axis=1) == y)),
            protocol.LOSS: float(-np.mean(np.log(np.maximum(chosen, 1e-300)))),
        }


def _fit_reply(learners: Arrays, step: EStep, y: np.ndarray) -> Reply:
    """A member's training reply: its learners, the densities' statistics and
    ``gamma_c``; its loss under the mixture of its new ``pi_c`` (the learners before
    their epochs) and its mean log-likelihood."""
    mixture_probs = gmm.predict_proba(np.log(step.weights), step.log_gauss, np.exp(step.log_probs))
    loss = float(-np.mean(np.log(np.maximum(mixture_probs[np.arange(len(y)), y], 1e-300))))
    reply = {**learners, **step.extra, mixture.GAMMA: step.responsibilities.sum(axis=0)}
    return reply, {
        protocol.NUM_EXAMPLES: float(len(y)),
        protocol.LOSS: loss,
        mixture.LOG_LIKELIHOOD: float(np.mean(step.log_joint)),
    }


# --------------------------------------------------- the family's update functions
def fit(cohort: Cohort, *, densities: mixture.Densities = mixture.NO_DENSITY) -> list[Reply]:
    """The family's local update of a cohort: each member's E-step, the M-step of its
    ``pi_c`` (kept in its ``context.state``), then the responsibility-weighted epochs
    of its learners; replies the learners, ``gamma_c`` and the densities' statistics."""
    return Mixture(cohort, densities).fit()


def evaluate(cohort: Cohort, *, densities: mixture.Densities = mixture.NO_DENSITY) -> list[Metrics]:
    """Each member's test figures with its mixture's prediction; unseen members first
    adapt ``pi`` on their adaptation split."""
    return Mixture(cohort, densities).evaluate()


def initial_arrays(cohort: Cohort) -> Arrays:
    """The seeded learners, each under its ``learnerM.`` prefix, as every node builds
    them."""
    return Mixture(cohort, mixture.NO_DENSITY).initial_arrays()
