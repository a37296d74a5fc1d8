"""Fed-MTL, the multi-task baseline of FedRep's Table 1 (Collins et al., 2021, after
Smith et al., "Federated Multi-Task Learning", NeurIPS 2017, with its task-relationship
matrix held fixed, as the FedRep authors ran it).

Every client ``i`` keeps a whole personal model ``w_i`` (in ``context.state``; it
starts as the seeded initial model). The ``m`` clients sampled in a round form the
columns of ``W``, each other column at its value when the round began, and client
``i`` trains ``w_i`` for the round's epochs on its loss plus, at every step,

    c (||W||_F^2 + tr(W Omega W^T)),    Omega = I - 11^T / m,

so that ``tr(W Omega W^T) = sum_j ||w_j - mean_j w_j||^2`` pulls the sampled models
toward their mean and ``||W||_F^2`` shrinks them (``c`` = ``fed-mtl-lambda``). Only
``w_i`` varies, so the server sends each client the mean ``o`` of the other ``m - 1``
columns (``strategies/fedmtl.py``), and up to a constant (the other columns' terms)
the term is

    c (||w_i||^2 + ((m - 1) / m) ||w_i - o||^2),

since ``sum_j ||w_j - mean_j w_j||^2`` is ``((m - 1) / m) ||w_i - o||^2`` plus the
spread of the others; its gradient is ``2c w_i + 2c (w_i - mean_j w_j)``. The
client replies ``w_i`` and is tested with it.

Two departures from the FedRep authors' code (main_mtl.py, LocalUpdateMTL), both of
which this row leaves out: there ``Omega`` is ``(I - 11^T/m)`` squared elementwise
(``omega ** 2``, positive off the diagonal, so that the sampled models push apart;
the matrix square of the centring matrix is the matrix itself), and the trace counts
only whole blocks of 4,000 parameters (here 12,000 of the MLP's 14,154).
"""

from __future__ import annotations

import torch
from flwr.app import ConfigRecord, RecordDict

from fedpers import protocol
from fedpers.clients.base import PersonalizedClient
from fedpers.clients.common import Arrays, Metrics, config_int
from fedpers.config import RunConfig
from fedpers.families.personalized import TASKS, FedMTLSettings
from fedpers.legacy_training import evaluate, train
from fedpers.models import part_arrays


class FedMTLClient(PersonalizedClient):
    """A whole personal model, trained with the regularizer that ties it to the other
    sampled clients' models."""

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        self.personal_model = self.kept_model()
        self.c = run.group(FedMTLSettings).fed_mtl_lambda

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """``epochs`` of ``w_i`` on its loss plus the regularizer; replies ``w_i``."""
        # self.model holds the mean o of the other sampled models after start_round.
        generator, x, y, settings = self.start_round(arrays, config)
        m = config_int(config, TASKS)
        if m < 1:
            raise ValueError(f"the server's message names {m} sampled tasks; at least 1")
        others = [p.detach() for p in self.model.parameters()]
        w = list(self.personal_model.parameters())
        c = self.c

        def regularizer(_: torch.Generator) -> torch.Tensor:
            own = torch.stack([p.pow(2).sum() for p in w]).sum()
            apart = torch.stack([(p - o).pow(2).sum() for p, o in zip(w, others, strict=True)])
            return c * (own + (m - 1) / m * apart.sum())

        stats = train(
            self.personal_model,
            x,
            y,
            parts=protocol.MODEL_PARTS,
            epochs=config_int(config, protocol.EPOCHS),
            settings=settings,
            generator=generator,
            augment=self.augment,
            penalty=regularizer if c > 0 else None,
        )
        self.keep(self.personal_model)
        kept = part_arrays(self.personal_model, protocol.MODEL_PARTS)
        metrics = {protocol.NUM_EXAMPLES: float(len(y))}
        if stats.steps:
            metrics[protocol.LOSS] = stats.loss
        return kept, metrics

    def evaluate(self, arrays: Arrays, config: ConfigRecord) -> Metrics:
        """Test accuracy of the personal model ``w_i`` (the server sends nothing)."""
        stats = evaluate(
            self.personal_model, self.tensor(self.data.x_test), self.tensor(self.data.y_test)
        )
        return self._metrics(stats)
