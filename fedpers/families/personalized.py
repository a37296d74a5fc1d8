"""The personalized family: a body/head model, part of it averaged by the server.

FedRep, FedPer, LG-FedAvg, FedAvg, FedAvg+FT, FedProx(+FT), SCAFFOLD(+FT), FedBABU,
Ditto, APFL, Per-FedAvg (FO, HF) and Local are rows of the algorithm table that differ
in what they share and train; the server averages the shared parts
(``strategies/base.py``), the clients keep the rest. This module holds what the family
adds to the core: the result of the fine-tuning test after the last round, the settings
of client-level differential privacy (``fedpers.privacy``, which only this family's
shared parts support) with their checks (``refuses_dp``: the check of a row whose
server step it does not cover), the family's local update and the summary; each row's
own settings, wire names and checks are its module's (``fedpers.algorithms``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedpers import families, protocol, server_step
from fedpers.data.registry import BATCH_NORM_MODELS
from fedpers.families import RunSummary
from fedpers.privacy import DpMode, PrivacySettings
from fedpers.protocol import FinalTestResult, UnseenTest
from fedpers.results import RoundRecord, final_mean
from fedpers.settings import ConfigError

if TYPE_CHECKING:
    from fedpers.cohort import Arrays, Cohort, Metrics, Reply
    from fedpers.config import RunConfig

NAME = "personalized"


@dataclass(frozen=True)
class FinetunedTest(FinalTestResult):
    """Test accuracy after every client fine-tuned its head (FedAvg+FT, FedBABU)."""

    accuracy: float
    clients: dict[str, float] = field(default_factory=dict)  # accuracy per partition


def refuses_dp(why: str) -> Callable[[RunConfig], None]:
    """A row's check: its server step is its own, not the mean that client-level DP
    releases (``why``: what its server does), so ``dp`` is refused before anything
    starts."""

    def check(run: RunConfig) -> None:
        dp = run.group(PrivacySettings).dp
        if dp is not DpMode.NONE:
            raise ConfigError(
                f"run-config key 'dp' = '{dp}' does not cover '{run.algorithm}', {why}: "
                "set dp = 'none', or choose another algorithm."
            )

    return check


def refuses_batch_norm(why: str) -> Callable[[RunConfig], None]:
    """A row's check: it cannot take a model with BatchNorm layers (``why``: what of its
    update covers every array of the model), so such a built-in model is refused before
    anything starts."""

    def check(run: RunConfig) -> None:
        if run.model_name in BATCH_NORM_MODELS:
            raise ConfigError(
                f"algorithm '{run.algorithm}' does not take model = '{run.model_name}', whose "
                f"BatchNorm layers hold running statistics and an integer step count: {why}; "
                "choose a model without BatchNorm layers (model = 'auto')."
            )

    return check


def check_privacy(run: RunConfig) -> None:
    """Client-level DP (``dp``) covers this family's shared parts only, combined by the
    plain mean: every run's check."""
    settings = run.group(PrivacySettings)
    if settings.dp is DpMode.NONE:
        return
    if run.family.name != NAME:
        rows = row_names()
        raise ConfigError(
            f"run-config key 'dp' = '{settings.dp}' makes the shared parts of the "
            f"personalized family's algorithms private ({', '.join(rows)}); the "
            f"'{run.family.name}' family of algorithm '{run.algorithm}' (dataset "
            f"'{run.dataset}') shares other things that it does not cover: set dp = 'none'."
        )
    if str(run.aggregation) != "mean":
        raise ConfigError(
            f"run-config key 'dp' = '{settings.dp}' clips every update itself and sums them "
            f"with equal weights; aggregation = '{run.aggregation}' has another sensitivity "
            "than the accountant assumes: set aggregation = 'mean'."
        )


def row_names() -> list[str]:
    """The names of the rows of the algorithm table in this family, sorted."""
    from fedpers import algorithms  # the table imports the families

    return sorted(s.name for s in algorithms.all_specs() if s.family == NAME)


def last_client_accuracy(records: list[RoundRecord]) -> dict[str, float]:
    """Each client's accuracy in the last round that evaluated clients."""
    for record in reversed(records):
        if record.clients:
            return {
                p: v[protocol.ACCURACY] for p, v in record.clients.items() if protocol.ACCURACY in v
            }
    return {}


def summary(done: RunSummary) -> dict[str, object]:
    """Final accuracy (mean of the last rounds, or after fine-tuning), each client's,
    and the unseen clients' after they adapted."""
    before = final_mean(done.records, "evaluate.accuracy", done.run.final_rounds)
    last = last_client_accuracy(done.records)
    result: dict[str, object] = {"final_accuracy": before, "client_accuracy": last}
    if isinstance(done.final, FinetunedTest):
        result = {
            "final_accuracy": done.final.accuracy,
            "final_accuracy_before_finetune": before,
            "client_accuracy": done.final.clients,
            "client_accuracy_before_finetune": last,
        }
    elif isinstance(done.final, UnseenTest):
        result["unseen_accuracy"] = done.final.accuracy
        result["unseen_client_accuracy"] = done.final.clients
    return result


# ----------------------------------------------------------------- local update
def fit(
    cohort: Cohort,
    *,
    objective: Any = None,
    inputs: Callable[[Any], Any] | None = None,
) -> list[Reply]:
    """The family's local update of a cohort: each member's model is what it keeps
    with the shared parts it received; the row's ``phases`` train through the one
    training loop (``objective``, by default the cross-entropy, and its per-member
    ``inputs(local)``); the personal parts are stored again and the shared ones sent
    back with the samples and the last phase's loss."""
    from fedpers import training, update

    local = update.Personalized(cohort)
    stack = local.models()
    stats = local.train_phases(
        stack,
        objective=objective or training.cross_entropy,
        inputs=None if inputs is None else inputs(local),
    )
    local.keep_personal(stack)
    return update.fit_replies(local.shared_arrays(stack), stats)


def evaluate(cohort: Cohort) -> list[Metrics]:
    """Each member's test figures with the global shared parts and its own personal
    parts (after fine-tuning its head where the server asks: the +FT rows)."""
    from fedpers import update

    local = update.Personalized(cohort)
    return local.evaluate(local.models())


def evaluate_kept(cohort: Cohort) -> list[Metrics]:
    """Each member's test figures with the whole personal model it keeps (Ditto's
    ``v``, L2GD's ``x_i``, Fed-MTL's ``w_i``, pFedMe's ``theta``; the seeded initial
    model before its first round): the ``evaluate`` of the rows that test it."""
    from fedpers import training, update

    local = update.Personalized(cohort)
    return [update.test_metrics(s) for s in training.evaluate(local.kept(), local.test_data())]


def initial_arrays(cohort: Cohort) -> Arrays:
    """The seeded initial values of the row's shared parts (the server's round-0
    model), as every node builds them."""
    from fedpers import models, update

    local = update.Personalized(cohort)
    return models.part_arrays(local.model, local.shared)


FAMILY = families.register(
    families.FamilySpec(
        name=NAME,
        summary=summary,
        groups=(PrivacySettings, server_step.ServerStrategySettings),
        checks=(check_privacy, server_step.check),
        update=__name__,
    )
)
