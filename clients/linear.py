"""Clients of the linear representation-learning experiments (FedRep, Section 4).

Arrays use the names of ``fedpers.models.linear_model``: ``body.weight`` is ``B^T``
(k x d) and ``head.weight`` is ``w^T`` (1 x k). Each round a client draws ``m`` fresh
samples from its own stream (the setting of Theorem 1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedpers import linear, protocol
from fedpers.clients.common import Arrays, ClientBase, Metrics, config_float, config_int
from fedpers.config import RunConfig
from fedpers.data.synthetic import LinearTasks
from fedpers.families import linear as linear_family
from fedpers.families.linear import BODY, HEAD
from fedpers.seeding import rng


class LinearClient(ClientBase, ABC):
    """Shared plumbing: the client's task, its fresh samples and its stored head."""

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        self.tasks = LinearTasks(
            linear_family.settings(run).linear_dim,
            linear_family.settings(run).linear_rank,
            linear_family.settings(run).linear_noise_std,
            run.seed,
        )

    def samples(
        self, purpose: str, server_round: int, count: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Fresh samples of this client for ``purpose`` in ``server_round``."""
        generator = rng(self.run.seed, "linear", purpose, self.partition_id, server_round)
        return self.tasks.sample(
            self.partition_id, count or linear_family.settings(self.run).linear_samples, generator
        )

    def moments(self) -> Arrays:
        """The Method-of-Moments statistic of ``m`` samples (FedRep's initialization)."""
        return {linear_family.MOMENTS: linear.moment_statistic(*self.samples("moments", 0))}

    def stored_head(self) -> np.ndarray | None:
        """The head kept from earlier rounds, if any."""
        if protocol.STATE_PERSONAL not in self.state:
            return None
        record = self.state[protocol.STATE_PERSONAL]
        assert isinstance(record, ArrayRecord)
        return record[HEAD].numpy()[0]

    def store_head(self, head: np.ndarray) -> None:
        """Keep the head on the device for later rounds."""
        self.state[protocol.STATE_PERSONAL] = ArrayRecord({HEAD: Array(head[None, :].copy())})

    @abstractmethod
    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """One round of the algorithm's local update."""

    @abstractmethod
    def model(self, arrays: Arrays) -> tuple[np.ndarray, np.ndarray]:
        """(B, w) this client predicts with."""

    def evaluate(self, arrays: Arrays, config: ConfigRecord) -> Metrics:
        """Mean squared error on fresh test samples with the client's current model."""
        representation, head = self.model(arrays)
        x, y = self.samples("test", config_int(config, protocol.ROUND), linear_family.TEST_SAMPLES)
        mse = linear.mean_squared_error(x, y, representation, head)
        return {protocol.NUM_EXAMPLES: float(len(y)), protocol.LOSS: mse}


class LinearFedRepClient(LinearClient):
    """FedRep (linear): exact (or GD) head update, then one gradient step on ``B``.

    ``linear-head-steps = 0`` solves the head by least squares (FedRep); 1 or 10 take
    that many gradient steps from the stored head instead (GD-GD, 10GD-GD).
    """

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        representation = arrays[BODY].T
        x, y = self.samples("train", config_int(config, protocol.ROUND))
        steps = linear_family.settings(self.run).linear_head_steps
        if steps == 0:
            head = linear.least_squares_head(x, y, representation)
        else:
            start = self.stored_head()
            head = linear.gradient_descent_head(
                x,
                y,
                representation,
                np.zeros(linear_family.settings(self.run).linear_rank) if start is None else start,
                lr=linear_family.settings(self.run).linear_head_lr,
                steps=steps,
            )
        self.store_head(head)
        loss = linear.mean_squared_error(x, y, representation, head)
        step = config_float(config, protocol.LR) * linear.representation_gradient(
            x, y, representation, head
        )
        return {BODY: (representation - step).T}, {
            protocol.NUM_EXAMPLES: float(len(y)),
            protocol.LOSS: loss,
        }

    def model(self, arrays: Arrays) -> tuple[np.ndarray, np.ndarray]:
        representation = arrays[BODY].T
        head = self.stored_head()
        if head is None:  # never trained: solve on a fresh batch, as a round would
            head = linear.least_squares_head(*self.samples("train", 0), representation)
        return representation, head


class FedSGDClient(LinearClient):
    """FedSGD: one gradient step on a single global model ``(B, w)``."""

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        representation, head = self.model(arrays)
        x, y = self.samples("train", config_int(config, protocol.ROUND))
        lr = config_float(config, protocol.LR)
        loss = linear.mean_squared_error(x, y, representation, head)
        new_representation = representation - lr * linear.representation_gradient(
            x, y, representation, head
        )
        new_head = head - lr * linear.head_gradient(x, y, representation, head)
        return {BODY: new_representation.T, HEAD: new_head[None, :]}, {
            protocol.NUM_EXAMPLES: float(len(y)),
            protocol.LOSS: loss,
        }

    def model(self, arrays: Arrays) -> tuple[np.ndarray, np.ndarray]:
        return arrays[BODY].T, arrays[HEAD][0]
