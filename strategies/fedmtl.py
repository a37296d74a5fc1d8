"""Fed-MTL's server (the clients' update and the regularizer are
``fedpers/algorithms/fed_mtl.py``). It keeps every client's personal model, as the
FedRep authors' loop does, so that a sampled client can be sent the mean of the other
sampled clients' models as they were when the round began: the global state is one
model per seen client, named ``task.<partition>.<parameter>``
(``fedpers.algorithms.fed_mtl.TASK``), all the seeded initial model at first. It is
checkpointed with the run, and each round the replies kept replace their clients'
models. The models of the ``m`` clients sampled are combined by the run's
``aggregation`` (equal weights), so a robust aggregation bounds what one client's model
does to the others' regularizer; a round with one client sampled sends zeros (the trace
term is then zero). Evaluation sends nothing: clients test their own model. Memory: the
server holds n models (100 x 14,154 floats, 5.7 MB, in FedRep's Table 1 analogue).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedpers import protocol, records
from fedpers.algorithms.fed_mtl import TASK, TASKS
from fedpers.strategies import screening
from fedpers.strategies.base import FedpersStrategy, mean_metrics

Model = dict[str, np.ndarray]


class FedMTL(FedpersStrategy):
    """Every client's model kept; each sampled client sent the mean of the others'."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tasks: dict[int, Model] = {}  # the models this round started from

    def initial_arrays(self, grid: Grid, *, timeout: float) -> ArrayRecord:
        """The seeded initial model (as a majority of the nodes build it), once per seen
        client."""
        model = {
            k: records.values(v) for k, v in super().initial_arrays(grid, timeout=timeout).items()
        }
        return _record(dict.fromkeys(self.seen, model))

    def train_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> dict[int, RecordDict]:
        """To each sampled client the mean of the other sampled models and ``m``."""
        self.tasks = _tasks(arrays)
        sampled = self.sample(server_round)
        self.round_config(server_round, config)
        config[TASKS] = len(sampled)
        models = [self.tasks[p] for p in sampled]
        reference = _mean(models)
        contents = {}
        for i, partition in enumerate(sampled):
            others = models[:i] + models[i + 1 :]
            mean = (
                self.combine(others, [1.0] * len(others), reference)
                if others
                else {k: np.zeros_like(v) for k, v in reference.items()}
            )
            sent = ArrayRecord({k: Array(records.contiguous(v)) for k, v in mean.items()})
            contents[partition] = RecordDict({protocol.ARRAYS: sent, protocol.CONFIG: config})
        # Replies are models of the sampled clients, each screened against its own model
        # as the round began (``sent_to``); their mean stands for them elsewhere.
        self.current_shared = reference
        self.sent_arrays = screening.array_specs(
            ArrayRecord({k: Array(records.contiguous(v)) for k, v in reference.items()})
        )
        return contents

    def sent_to(self, reply: Message) -> dict[str, np.ndarray]:
        """A reply's update is the change of its client's own model this round."""
        partition = self.federation.partition(reply)
        return self.tasks.get(partition, self.current_shared)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The kept replies replace their clients' models; None without one."""
        valid = [r for r in replies if screening.num_examples(r) > 0]
        if not valid:
            return None, None
        tasks = dict(self.tasks)
        for reply in valid:
            tasks[self.federation.partition(reply)] = screening.arrays_of(reply)
        return _record(tasks), mean_metrics([r.content for r in valid])

    def evaluate_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> dict[int, RecordDict]:
        """Nothing but the config: every client tests its own model."""
        return super().evaluate_contents(server_round, ArrayRecord(), config)


def _tasks(arrays: ArrayRecord) -> dict[int, Model]:
    """The global state's models by partition."""
    tasks: dict[int, Model] = {}
    for name, array in arrays.items():
        partition, _, parameter = name.removeprefix(TASK).partition(".")
        tasks.setdefault(int(partition), {})[parameter] = records.values(array)
    return tasks


def _record(tasks: dict[int, Model]) -> ArrayRecord:
    return ArrayRecord(
        {
            f"{TASK}{p}.{name}": Array(records.contiguous(v))
            for p, model in sorted(tasks.items())
            for name, v in model.items()
        }
    )


def _mean(models: list[Model]) -> Model:
    return {
        k: np.mean([m[k].astype(np.float64) for m in models], axis=0).astype(v.dtype)
        for k, v in models[0].items()
    }
