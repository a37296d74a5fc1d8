"""FedAvg (McMahan et al., 2017) and FedAvg+FT, as compared in FedRep's Table 1.

FedAvg averages the whole model. FedAvg+FT trains the same way; after the last round
every client fine-tunes only the head for ``finetune-epochs`` epochs on its own data
before the final test.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid

from fedpers import protocol
from fedpers.protocol import Algorithm
from strategies.base import FedpersStrategy


class FederatedAveraging(FedpersStrategy):
    """Average body and head over the sampled clients."""

    algorithm = Algorithm.FEDAVG


class FedAvgFT(FederatedAveraging):
    """FedAvg, then a final evaluation after head-only fine-tuning on every client.

    Parameters
    ----------
    finetune_epochs : int (default: 10)
        Head epochs each client runs before its final test.
    **kwargs
        As for ``FedpersStrategy``.
    """

    algorithm = Algorithm.FEDAVG_FT

    def __init__(self, *, finetune_epochs: int = 10, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.finetune_epochs = finetune_epochs

    def final_evaluation(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        config: ConfigRecord,
        *,
        server_round: int,
        timeout: float,
    ) -> tuple[str, MetricRecord] | None:
        """Every node fine-tunes its head on the final global model, then tests."""
        config = ConfigRecord(dict(config))
        config[protocol.FINETUNE_EPOCHS] = self.finetune_epochs
        messages = self.configure_evaluate(server_round, arrays, config, grid)
        replies = self.in_partition_order(grid.send_and_receive(messages, timeout=timeout))
        metrics = self.aggregate_evaluate(server_round, replies)
        return None if metrics is None else ("finetuned", metrics)
