"""The personalized client all deep-model algorithms share.

A client is numpy arrays in, numpy arrays out: it receives the parts of the model its
algorithm shares (``fedpers.protocol.SHARED_PARTS``), restores the parts it keeps from
``context.state``, runs its algorithm's local update through ``fedpers.training``, stores
the personal parts again and returns the shared ones. An algorithm only says what its
local update is (``local_update``): which parts train, for how many epochs, in what
order.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from clients.common import Arrays, Metrics, config_float, config_int
from fedpers import protocol
from fedpers.config import RunConfig
from fedpers.data.client import adaptation_split, client_data
from fedpers.models import build_model, load_part_arrays, part_arrays
from fedpers.protocol import Algorithm
from fedpers.seeding import int_seed
from fedpers.training import (
    EvalStats,
    SGDSettings,
    evaluate,
    random_crop_flip,
    resolve_device,
    train,
)

AUGMENTED_DATASETS = ("cifar10", "cifar100")


def settings_from(config: ConfigRecord) -> SGDSettings:
    """The optimizer settings the server sent with a message."""
    return SGDSettings(
        lr=config_float(config, protocol.LR),
        momentum=config_float(config, protocol.MOMENTUM),
        weight_decay=config_float(config, protocol.WEIGHT_DECAY),
        batch_size=config_int(config, protocol.BATCH_SIZE),
    )


class PersonalizedClient:
    """A client with a ``body``/``head`` model, part shared and part personal.

    Parameters
    ----------
    run : RunConfig
        The run configuration (data set, model, partition, seed).
    partition_id : int
        This client's partition.
    state : RecordDict
        ``context.state`` of the node: where the personal parts persist across rounds.
    """

    algorithm: ClassVar[Algorithm]

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        torch.set_num_threads(run.client_threads)
        self.run = run
        self.partition_id = partition_id
        self.state = state
        self.shared = protocol.shared_parts(self.algorithm)
        self.personal = protocol.personal_parts(self.algorithm)
        self.data = client_data(run, partition_id)
        # Every process builds the same initial model from the seed, so a client that
        # has never trained holds the same initial personal parts as the server's model.
        self.model = build_model(
            run.model_name, run.num_classes, int_seed(run.seed, "model"), run.input_shape
        )
        if protocol.STATE_PERSONAL in state:
            stored = state[protocol.STATE_PERSONAL]
            assert isinstance(stored, ArrayRecord)
            load_part_arrays(self.model, {k: v.numpy() for k, v in stored.items()})
        self.augment = random_crop_flip() if run.dataset in AUGMENTED_DATASETS else None
        self.device = resolve_device(run.device)
        self.model.to(self.device)

    # ------------------------------------------------------------ algorithm hook
    def local_update(self, config: ConfigRecord) -> list[tuple[tuple[str, ...], int]]:
        """The phases of the local update: (trainable parts, epochs), in order."""
        return [(protocol.MODEL_PARTS, config_int(config, protocol.EPOCHS))]

    # ------------------------------------------------------------------ messages
    def sizes(self) -> tuple[int, int]:
        """Numbers of training and test samples of this client."""
        return len(self.data.y_train), len(self.data.y_test)

    def initial_arrays(self) -> Arrays:
        """The seeded initial values of the shared parts (the server's round-0 model)."""
        return part_arrays(self.model, self.shared)

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """One round of local training from the server's shared arrays."""
        self.load_shared(arrays)
        server_round = config_int(config, protocol.ROUND)
        generator = self._generator("train", server_round)
        x, y = self.tensor(self.data.x_train), self.tensor(self.data.y_train)
        settings = settings_from(config)
        loss = float("nan")
        for parts, epochs in self.local_update(config):
            stats = train(
                self.model,
                x,
                y,
                parts=parts,
                epochs=epochs,
                settings=settings,
                generator=generator,
                augment=self.augment,
            )
            loss = stats.loss if stats.steps else loss
        if self.personal:
            self.state[protocol.STATE_PERSONAL] = _to_record(part_arrays(self.model, self.personal))
        metrics = {protocol.NUM_EXAMPLES: float(len(y)), protocol.LOSS: loss}
        return part_arrays(self.model, self.shared), metrics

    def evaluate(self, arrays: Arrays, config: ConfigRecord) -> Metrics:
        """Test accuracy with the server's shared parts and this client's own parts.

        With ``finetune-epochs > 0`` in ``config`` the head is first trained on the
        client's training data for that many epochs (the +FT baselines); the fine-tuned
        head is not stored.
        """
        self.load_shared(arrays)
        if config_int(config, protocol.UNSEEN, default=0):
            # An unseen client (FedAvg in FedGMM's Table 4): the global model tested on
            # the same held-out part the mixtures are tested on, without adaptation.
            _, _, x, y = adaptation_split(
                self.data,
                config_float(config, protocol.ADAPT_FRACTION),
                self.run.seed,
                self.partition_id,
            )
            return self._metrics(evaluate(self.model, self.tensor(x), self.tensor(y)))
        finetune_epochs = config_int(config, protocol.FINETUNE_EPOCHS, default=0)
        if finetune_epochs > 0:
            train(
                self.model,
                self.tensor(self.data.x_train),
                self.tensor(self.data.y_train),
                parts=(protocol.HEAD,),
                epochs=finetune_epochs,
                settings=settings_from(config),
                generator=self._generator("finetune", config_int(config, protocol.ROUND)),
                augment=self.augment,
            )
        stats = evaluate(
            self.model,
            self.tensor(self.data.x_test),
            self.tensor(self.data.y_test),
        )
        return self._metrics(stats)

    @staticmethod
    def _metrics(stats: EvalStats) -> Metrics:
        return {
            protocol.NUM_EXAMPLES: float(stats.num_examples),
            protocol.ACCURACY: stats.accuracy,
            protocol.LOSS: stats.loss,
        }

    # ------------------------------------------------------------------- helpers
    def tensor(self, array: np.ndarray) -> torch.Tensor:
        """A numpy array on the client's device."""
        return torch.from_numpy(array).to(self.device)

    def load_shared(self, arrays: Arrays) -> None:
        """Load the server's shared parts; exactly the expected arrays must be there."""
        expected = set(part_arrays(self.model, self.shared))
        if set(arrays) != expected:
            raise ValueError(
                f"{self.algorithm} client expected shared arrays {sorted(expected)}, "
                f"received {sorted(arrays)}"
            )
        load_part_arrays(self.model, arrays)

    def _generator(self, purpose: str, server_round: int) -> torch.Generator:
        seed = int_seed(self.run.seed, purpose, self.partition_id, server_round)
        return torch.Generator().manual_seed(seed)


def _to_record(arrays: Arrays) -> ArrayRecord:
    return ArrayRecord({name: Array(np.ascontiguousarray(a)) for name, a in arrays.items()})
