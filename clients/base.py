"""The torch client base, and the personalized client all body/head algorithms share.

``TorchClient`` holds what every torch client needs: its threads, its device, its data
and tensor placement. ``PersonalizedClient`` is numpy arrays in, numpy arrays out: it
receives the parts of the model its algorithm shares (the algorithm table's
``shared``), restores the parts it keeps from ``context.state``, runs the row's local
update (``phases``: which parts train, for how many epochs, in what order) through
``fedpers.training``, stores the personal parts again and returns the shared ones.
FedRep, FedPer, FedAvg(+FT), LG-FedAvg, Local and FedBABU are this class with
different rows.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedpers import protocol, records
from fedpers.clients.common import Arrays, ClientBase, Metrics, config_float, config_int
from fedpers.config import RunConfig
from fedpers.data.client import ClientData, adaptation_split, client_data
from fedpers.models import build_model, load_part_arrays, part_arrays
from fedpers.seeding import int_seed
from fedpers.training import (
    EvalStats,
    SGDSettings,
    random_crop_flip,
    resolve_device,
    train_model,
)
from fedpers.training import evaluate_model as evaluate

AUGMENTED_DATASETS = ("cifar10", "cifar100")
# A term added to a local step's loss, called with the step's generator (``train``).
Penalty = Callable[[torch.Generator], torch.Tensor]


class LocalRound(NamedTuple):
    """What a local update starts from (``PersonalizedClient.start_round``)."""

    generator: torch.Generator
    x: torch.Tensor
    y: torch.Tensor
    settings: SGDSettings


class TorchClient(ClientBase):
    """A client that trains torch models on its partition's data.

    Parameters
    ----------
    run : RunConfig
        The run configuration (data set, model, partition, seed, device, threads).
    partition_id : int
        This client's partition.
    state : RecordDict
        ``context.state`` of the node.
    """

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        torch.set_num_threads(run.client_threads)
        self.device = resolve_device(run.device)

    @cached_property
    def data(self) -> ClientData:
        """This client's data (``client_data``), read at its first use: a start-up query
        needs none, and the initial model's vote asks every node. Read in ``__init__``,
        the vote made all 200 clients of `simulations.scale --quick` generate their
        MNIST-1D at start-up: that stage took 18.6 s, and 5.1 s with the data read
        here (one run each, 2026-12-03)."""
        return client_data(self.run, self.partition_id)

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        """A numpy array on the client's device."""
        return torch.from_numpy(array).to(self.device)

    def sgd_settings(self, config: ConfigRecord) -> SGDSettings:
        """The optimizer settings: the learning rate the server sent for this round
        (its schedule may change it), the rest from the run configuration."""
        return SGDSettings(
            lr=config_float(config, protocol.LR),
            momentum=self.run.momentum,
            weight_decay=self.run.weight_decay,
            batch_size=self.run.batch_size,
        )

    def generator(self, purpose: str, *keys: int) -> torch.Generator:
        """A torch generator seeded by the run, ``purpose``, the partition and ``keys``."""
        seed = int_seed(self.run.seed, purpose, self.partition_id, *keys)
        return torch.Generator().manual_seed(seed)


class PersonalizedClient(TorchClient):
    """A client with a ``body``/``head`` model, part shared and part personal.

    Parameters
    ----------
    run : RunConfig
        The run configuration; ``run.spec`` is the algorithm's row.
    partition_id : int
        This client's partition.
    state : RecordDict
        ``context.state`` of the node: where the personal parts persist across rounds.
    """

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        self.spec = run.spec
        self.shared = self.spec.shared
        self.personal = self.spec.personal
        # Every process builds the same initial model from the seed, so a client that
        # has never trained holds the same initial personal parts as the server's model.
        self.model = build_model(
            run.model_name, run.num_classes, int_seed(run.seed, "model"), run.input_shape
        )
        if protocol.STATE_PERSONAL in state:
            stored = state[protocol.STATE_PERSONAL]
            assert isinstance(stored, ArrayRecord)
            load_part_arrays(self.model, {k: records.values(v) for k, v in stored.items()})
        self.augment = random_crop_flip() if run.dataset in AUGMENTED_DATASETS else None
        self.model.to(self.device)

    # ------------------------------------------------------------ algorithm hook
    def local_update(self, config: ConfigRecord) -> list[tuple[tuple[str, ...], int]]:
        """The phases of the local update: (trainable parts, epochs), in order (the
        row's ``phases``, with the epochs the server sent)."""
        return [(phase.parts, config_int(config, phase.epochs)) for phase in self.spec.phases]

    # ------------------------------------------------------------------ messages
    def initial_arrays(self) -> Arrays:
        """The seeded initial values of the shared parts (the server's round-0 model)."""
        return part_arrays(self.model, self.shared)

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """One round of local training from the server's shared arrays."""
        generator, x, y, settings = self.start_round(arrays, config)
        loss = float("nan")
        for parts, epochs in self.local_update(config):
            stats = train_model(
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

    def start_round(self, arrays: Arrays, config: ConfigRecord) -> LocalRound:
        """Load the server's shared arrays; the round's training generator, training data
        (on the device) and optimizer settings: what every local update starts from."""
        self.load_shared(arrays)
        generator = self.generator("train", config_int(config, protocol.ROUND))
        x, y = self.tensor(self.data.x_train), self.tensor(self.data.y_train)
        return LocalRound(generator, x, y, self.sgd_settings(config))

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
            train_model(
                self.model,
                self.tensor(self.data.x_train),
                self.tensor(self.data.y_train),
                parts=(protocol.HEAD,),
                epochs=finetune_epochs,
                settings=self.sgd_settings(config),
                generator=self.generator("finetune", config_int(config, protocol.ROUND)),
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
    def kept_model(self) -> torch.nn.Module:
        """A whole personal model kept on the device (Ditto's and APFL's v, L2GD's x_i,
        Fed-MTL's w_i, pFedMe's theta): what ``keep`` stored last, else the seeded
        initial model."""
        model = copy.deepcopy(self.model)
        stored = self.state.get(protocol.STATE_PERSONAL)
        if isinstance(stored, ArrayRecord):
            load_part_arrays(model, {k: records.values(v) for k, v in stored.items()})
        return model

    def keep(self, model: torch.nn.Module) -> None:
        """Store a whole personal model in ``context.state`` (``kept_model`` reads it)."""
        self.state[protocol.STATE_PERSONAL] = _to_record(part_arrays(model, protocol.MODEL_PARTS))

    def load_shared(self, arrays: Arrays) -> None:
        """Load the server's shared parts; exactly the expected arrays must be there."""
        expected = set(part_arrays(self.model, self.shared))
        if set(arrays) != expected:
            raise ValueError(
                f"{self.spec.name} client expected shared arrays {sorted(expected)}, "
                f"received {sorted(arrays)}"
            )
        load_part_arrays(self.model, arrays)


def _to_record(arrays: Arrays) -> ArrayRecord:
    return ArrayRecord({name: Array(np.ascontiguousarray(a)) for name, a in arrays.items()})
