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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fedpers import records
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.families import personalized
from fedpers.protocol import MODEL_PARTS
from fedpers.settings import at_least, setting

if TYPE_CHECKING:
    import torch

    from fedpers.cohort import Cohort, Reply
    from fedpers.training import Objective, View

# The number m of tasks (personal models) sampled this round, in the training message's
# config; the server keeps every client's model under the prefix TASK.
TASKS = "tasks"
TASK = "task."


@dataclass(frozen=True)
class FedMTLSettings:
    """The task-relationship regularizer of Fed-MTL (the row `fed-mtl`)."""

    HEADING: ClassVar[str] = "fed-mtl"

    # Chosen on validation (docs/reproducing.md): 0.001 of {1e-6 (the FedRep authors'
    # 10^-(digits of the parameter count + 1)), 1e-3, 1e-2, 1e-1}, FedRep's Table 1
    # setting, seeds 0-2; the first three tie within noise.
    fed_mtl_lambda: float = setting(
        0.001,
        "Fed-MTL: the weight c of c (||W||_F^2 + tr(W Omega W^T)), W the round's sampled "
        "personal models as columns and Omega = I - 11^T/m, added to every local step's "
        "loss",
    )

    def check(self) -> None:
        at_least("fed-mtl-lambda", self.fed_mtl_lambda, 0.0)


def regularized(c: float, m: int) -> Objective:
    """The cross-entropy plus ``c (||w_i||^2 + ((m - 1) / m) ||w_i - o||^2)``:
    ``inputs`` holds the member's ``o`` (the mean of the other sampled models, by the
    model's parameter names, in its order)."""
    import torch

    from fedpers import training

    def objective(model: View, batch: tuple[Any, ...], inputs: Any) -> torch.Tensor:
        loss = training.cross_entropy(model, batch, None)
        own = torch.stack([model[name].pow(2).sum() for name in inputs]).sum()
        apart = torch.stack([(model[name] - o).pow(2).sum() for name, o in inputs.items()])
        return loss + c * (own + (m - 1) / m * apart.sum())

    return objective


def fit(cohort: Cohort) -> list[Reply]:
    """``epochs`` of every member's ``w_i`` on its loss plus the regularizer toward the
    ``o`` it received; replies ``w_i``, and keeps it."""
    from fedpers import update

    local = update.Personalized(cohort)
    received = local.received()  # each member's o
    m = records.config_int(local.config, TASKS)
    if m < 1:
        raise ValueError(f"the server's message names {m} sampled tasks; at least 1")
    c = cohort.run.group(FedMTLSettings).fed_mtl_lambda
    if c <= 0:
        return local.train_kept()
    names = [n for n, _ in local.model.named_parameters()]
    return local.train_kept(objective=regularized(c, m), inputs=local.tensors(received, names))


evaluate = personalized.evaluate_kept  # tested with its w_i


ROWS = (
    AlgorithmSpec(
        name="fed-mtl",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        strategy="fedpers.strategies.fedmtl:FedMTL",
        settings=(FedMTLSettings,),
        checks=(personalized.refuses_dp("whose server keeps and relays every personal model"),),
        wire=(TASKS, TASK),
        personal_state=True,  # w_i
        paper="Smith et al., NeurIPS 2017, as FedRep's Table 1 ran it",
    ),
)
