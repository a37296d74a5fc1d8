"""The personalized family: a body/head model, part of it averaged by the server.

FedRep, FedPer, LG-FedAvg, FedAvg, FedAvg+FT, FedProx(+FT), SCAFFOLD(+FT), FedBABU,
Ditto, APFL, Per-FedAvg (FO, HF) and Local are rows of the algorithm table that differ
in what they share and train; the server averages the shared parts
(``strategies/base.py``), the clients keep the rest (``clients/base.py``). This module
holds what the family adds to the core: the result of the fine-tuning test after the
last round, the settings of Ditto, FedProx, APFL, Per-FedAvg and SCAFFOLD (and
SCAFFOLD's wire names), the settings of client-level differential privacy
(``fedpers.privacy``, which only this family's shared parts support) with their checks,
and the summary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from fedpers import families, protocol
from fedpers.families import RunSummary
from fedpers.privacy import DpMode, PrivacySettings
from fedpers.protocol import FinalTestResult, UnseenTest
from fedpers.results import RoundRecord, final_mean
from fedpers.settings import ConfigError, at_least, positive, setting, within

if TYPE_CHECKING:
    from fedpers.cohort import Arrays, Cohort, Metrics, Reply
    from fedpers.config import RunConfig

NAME = "personalized"


@dataclass(frozen=True)
class FinetunedTest(FinalTestResult):
    """Test accuracy after every client fine-tuned its head (FedAvg+FT, FedBABU)."""

    accuracy: float
    clients: dict[str, float] = field(default_factory=dict)  # accuracy per partition


@dataclass(frozen=True)
class DittoSettings:
    """The personal model of Ditto (the row `ditto`)."""

    ditto_lambda: float = setting(
        0.1,
        "Ditto: weight of (lambda/2)||v - w||^2 pulling the personal model v toward the "
        "global model w",
    )

    def check(self) -> None:
        at_least("ditto-lambda", self.ditto_lambda, 0.0)


@dataclass(frozen=True)
class APFLSettings:
    """The personal mixture of APFL (the row `apfl`)."""

    HEADING: ClassVar[str] = "apfl"

    # Chosen on validation (docs/reproducing.md): 0.75 of {0.25, 0.5, 0.75} (the FedRep
    # authors' fixed value; Deng et al. try 0.25-0.75), FedRep's Table 1 setting, seeds 0-2.
    apfl_alpha: float = setting(
        0.75,
        "APFL: the weight alpha of the personal model v in the prediction "
        "alpha v + (1 - alpha) w (with apfl-adaptive, where each client's alpha starts)",
    )
    apfl_adaptive: bool = setting(
        True,
        "APFL: each client learns its alpha by gradient steps on its mixture's loss "
        "(Deng et al., Section 3.2); false keeps apfl-alpha fixed",
    )

    def check(self) -> None:
        within("apfl-alpha", self.apfl_alpha, "[0, 1]")


@dataclass(frozen=True)
class PerFedAvgSettings:
    """The inner step of Per-FedAvg (the rows `per-fedavg` and `per-fedavg-hf`)."""

    HEADING: ClassVar[str] = "per-fedavg"

    # Chosen on validation (docs/reproducing.md), FedRep's Table 1 setting, seeds 0-2:
    # FO 0.1 of {0.001, 0.01, 0.03, 0.1}; HF 0.03 of {0.01, 0.03, 0.1}.
    per_fedavg_alpha: float = setting(
        0.1,
        "Per-FedAvg (FO, the row `per-fedavg`): the step size alpha of the inner step "
        "w - alpha grad f(w; D), in training and in the one step of adaptation before a "
        "client's test (the outer step beta is the round's lr)",
    )
    per_fedavg_hf_alpha: float = setting(
        0.03, "Per-FedAvg HF (the row `per-fedavg-hf`): its alpha, as per-fedavg-alpha's"
    )

    def check(self) -> None:
        at_least("per-fedavg-alpha", self.per_fedavg_alpha, 0.0)
        at_least("per-fedavg-hf-alpha", self.per_fedavg_hf_alpha, 0.0)

    def alpha(self, hessian_free: bool) -> float:
        """The inner step of the FO or the HF row."""
        return self.per_fedavg_hf_alpha if hessian_free else self.per_fedavg_alpha


@dataclass(frozen=True)
class L2GDSettings:
    """The coin and the pull of L2GD (the row `l2gd`)."""

    HEADING: ClassVar[str] = "l2gd"

    # Chosen on validation (docs/reproducing.md): p 0.5 of {0.1, 0.5, 0.9 (the FedRep
    # authors')}, then lambda 0.5 of {0.5, 2, 10}, FedRep's Table 1 setting, seeds 0-2.
    l2gd_p: float = setting(
        0.5,
        "L2GD: the probability p that a round is an aggregation step (each sampled "
        "client's x_i moves toward the mean of all x_j) rather than a local one (x_i "
        "trains on its own data for the round's epochs)",
    )
    l2gd_lambda: float = setting(
        0.5,
        "L2GD: the weight lambda of the penalty (lambda / 2n) sum ||x_i - mean x||^2; an "
        "aggregation step moves x_i by lr lambda (1 - p) / p of its distance to the mean",
    )

    def check(self) -> None:
        within("l2gd-p", self.l2gd_p, "(0, 1)")
        at_least("l2gd-lambda", self.l2gd_lambda, 0.0)

    def pull(self, lr: float) -> float:
        """The share of its distance to the mean an aggregation step moves x_i: the
        paper's step sizes eta lambda / (n p) (aggregation) and eta / (n (1 - p)) (local,
        the round's ``lr``), in the ratio lambda (1 - p) / p."""
        return lr * self.l2gd_lambda * (1.0 - self.l2gd_p) / self.l2gd_p


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


@dataclass(frozen=True)
class PFedMeSettings:
    """The Moreau envelope and the server step of pFedMe (the row `pfedme`)."""

    HEADING: ClassVar[str] = "pfedme"

    pfedme_lambda: float = setting(
        15.0,
        "pFedMe: the weight lambda of (lambda/2)||theta - w||^2 tying the personal model "
        "theta to the local model w (the paper's 15)",
    )
    pfedme_k: int = setting(
        5, "pFedMe: gradient steps K on the inner problem per mini-batch (the paper's 5)"
    )
    pfedme_personal_lr: float = setting(
        0.01, "pFedMe: the step size of those K steps on theta (the round's lr moves w)"
    )
    pfedme_beta: float = setting(
        3.0,
        "pFedMe: the server's step w <- (1 - beta) w + beta mean(w_i) (1: the mean, the "
        "paper's 1 and 2; 3 chosen on validation for FedRep's Table 1)",
    )

    def check(self) -> None:
        positive("pfedme-lambda", self.pfedme_lambda)
        at_least("pfedme-k", self.pfedme_k, 1)
        positive("pfedme-personal-lr", self.pfedme_personal_lr)
        positive("pfedme-beta", self.pfedme_beta)


@dataclass(frozen=True)
class ClusteredFLSettings:
    """The split criteria of Clustered FL (the row `clustered-fl`)."""

    HEADING: ClassVar[str] = "clustered-fl"

    clustered_fl_eps1: float = setting(
        0.4,
        "Clustered FL: a cluster may split only when the norm of its clients' mean update "
        "is below eps1 (near a stationary point of the cluster's objective; FedEM's 0.4)",
    )
    clustered_fl_eps2: float = setting(
        3.2,
        "Clustered FL: ... and the largest norm of its clients' updates is above eps2 "
        "(some client is far from one; chosen on validation, FedEM's 1.6)",
    )
    clustered_fl_max_clusters: int = setting(
        16,
        "Clustered FL: the most clusters a run may hold (the state keeps a model for each; "
        "chosen on validation)",
    )

    def check(self) -> None:
        at_least("clustered-fl-eps1", self.clustered_fl_eps1, 0.0)
        at_least("clustered-fl-eps2", self.clustered_fl_eps2, 0.0)
        at_least("clustered-fl-max-clusters", self.clustered_fl_max_clusters, 1)


# L2GD's coin for the round, in the training message's config: 1 an aggregation step.
AGGREGATE = "aggregate"
# Fed-MTL: the number m of tasks (personal models) sampled this round, in the training
# message's config; the server keeps every client's model under this prefix.
TASKS = "tasks"
TASK = "task."
# Clustered FL: the server's state is a model per cluster under this prefix and each
# seen client's cluster (float64, one entry per partition) under ASSIGNMENT.
CLUSTER = "cluster."
ASSIGNMENT = "clusters.assignment"
# ... and records, each round, the clusters in use and (under the trimmed mean) those
# too small to trim, which kept their model.
CLUSTERS = "clusters"
CLUSTERS_UNCHANGED = "clusters-unchanged"


# Rows whose server step is their own, not the mean that client-level DP releases.
_OWN_SERVER_STEP = {
    L2GDSettings: "whose server tracks the mean of all personal models",
    FedMTLSettings: "whose server keeps and relays every personal model",
    PFedMeSettings: "whose server steps by pfedme-beta from the last global model",
    ClusteredFLSettings: "whose server keeps a model per cluster",
}


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


def check_server_step(run: RunConfig) -> None:
    """SCAFFOLD's and L2GD's server steps are not client-level DP's release: refuse
    either with ``dp`` before anything starts; refuse an L2GD pull beyond the mean."""
    dp = run.group(PrivacySettings).dp
    for group, why in _OWN_SERVER_STEP.items():
        if group in run.spec.settings and dp is not DpMode.NONE:
            raise ConfigError(
                f"run-config key 'dp' = '{dp}' does not cover '{run.algorithm}', {why}: "
                "set dp = 'none', or choose another algorithm."
            )
    if PFedMeSettings in run.spec.settings:
        pull = run.lr * run.group(PFedMeSettings).pfedme_lambda
        if pull > 1.0:
            raise ConfigError(
                f"run-config keys lr = {run.lr:g} and pfedme-lambda = "
                f"{run.group(PFedMeSettings).pfedme_lambda:g} make pFedMe's local step move w "
                f"{pull:.3g} times its distance to theta (past it): lower one of them so "
                "that lr lambda <= 1."
            )
    if L2GDSettings in run.spec.settings:
        settings = run.group(L2GDSettings)
        if settings.pull(run.lr) > 1.0:
            raise ConfigError(
                f"run-config keys lr = {run.lr:g}, l2gd-lambda = {settings.l2gd_lambda:g} "
                f"and l2gd-p = {settings.l2gd_p:g} make an aggregation step move x_i "
                f"{settings.pull(run.lr):.3g} times its distance to the mean (past it): "
                "lower l2gd-lambda or raise l2gd-p so that lr lambda (1 - p) / p <= 1."
            )


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
        groups=(PrivacySettings,),
        checks=(check_privacy, check_server_step),
        update=__name__,
    )
)
