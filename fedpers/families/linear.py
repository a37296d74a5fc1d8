"""The linear family: FedRep's linear representation learning (its Section 4).

Runs of the data set ``linear`` belong here, whatever their row: each client draws fresh
samples ``y = x^T B* w_i + noise`` every round, the server averages the clients'
representations and orthogonalizes them (``strategies/fedrep.py``), and evaluates the
principal angle distance of the global representation to ``B*`` itself. Clients are
not evaluated. The family's settings, its checks, its wire names, the
Method-of-Moments query of the initialization, the server's evaluation and the summary
live here; the math is ``fedpers.linear``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

from fedpers import families, protocol
from fedpers.families import Arrays, EvaluateFn, Faults, Metrics, QuerySpec, RunSummary
from fedpers.settings import ConfigError, at_least, positive, setting

if TYPE_CHECKING:
    from fedpers.config import RunConfig

NAME = "linear"
DATASET = "linear"  # the data set of this family's runs (fedpers.data.registry)
TEST_SAMPLES = 1000  # fresh test samples per client and evaluation
DISTANCE = "principal-angle-distance"  # the server's metric after every round

# ---- Array names of the personalized linear model ----------------------------------
BODY = "body.weight"  # the representation, stored as B^T (k x d)
HEAD = "head.weight"  # the head, stored as w^T (1 x k)
MOMENTS = "moments"  # a client's Method-of-Moments statistic (d x d)


class LinearQuery(StrEnum):
    """The family's queries (``query.<name>``)."""

    MOMENTS = "moments"  # a client's Method-of-Moments statistic


QUERY_MOMENTS = protocol.query_type(LinearQuery.MOMENTS)


@dataclass(frozen=True)
class LinearSettings:
    """Linear representation learning, FedRep's Section 4 (dataset "linear")."""

    linear_dim: int = setting(10, "input dimension d")
    linear_rank: int = setting(2, "representation dimension k, at most d")
    linear_samples: int = setting(5, "fresh samples m per client and round")
    linear_noise_std: float = setting(0.0316, "label noise (the paper's variance 1e-3)")
    linear_lr: float = setting(0.4, "step on B (gradients averaged over samples and clients)")
    linear_head_steps: int = setting(
        0, "steps on the head: 0 solves it by least squares (FedRep); 1: GD-GD; 10: 10GD-GD"
    )
    linear_head_lr: float = setting(0.4, "step on the head when `linear-head-steps` > 0")

    def check(self) -> None:
        at_least("linear-dim", self.linear_dim, 1)
        at_least("linear-rank", self.linear_rank, 1)
        at_least("linear-samples", self.linear_samples, 1)
        at_least("linear-head-steps", self.linear_head_steps, 0)
        at_least("linear-noise-std", self.linear_noise_std, 0.0)
        positive("linear-lr", self.linear_lr)
        positive("linear-head-lr", self.linear_head_lr)
        if self.linear_rank > self.linear_dim:
            raise ConfigError(
                f"run-config key 'linear-rank' = {self.linear_rank} exceeds "
                f"'linear-dim' = {self.linear_dim}; the representation is d x k, k <= d."
            )


def settings(run: RunConfig) -> LinearSettings:
    """The run's linear settings, typed."""
    return run.group(LinearSettings)


def applies(run: RunConfig) -> bool:
    """True for the runs of this family (the data set ``linear``)."""
    return run.dataset == DATASET


@runtime_checkable
class MomentsSource(Protocol):
    """A client that answers ``query.moments``: its Method-of-Moments statistic."""

    def moments(self) -> Arrays:
        """The statistic of this client's samples."""
        ...


def check_fits_data(run: RunConfig) -> None:
    """A row runs on the linear data only through its linear variant, and a linear-only
    row needs the linear data."""
    spec = run.spec
    if applies(run):
        if spec.linear is None:
            from fedpers import algorithms

            allowed = [s.name for s in algorithms.all_specs() if s.linear is not None]
            raise ConfigError(
                f"run-config key 'algorithm' = '{run.algorithm}' has no linear "
                f"variant; with dataset='linear' choose one of: {', '.join(allowed)}."
            )
        if run.model not in ("auto", "linear"):
            raise ConfigError(
                f"run-config key 'model' = '{run.model}' does not fit "
                "dataset='linear'; use model='linear' or 'auto'."
            )
    elif not spec.deep:
        raise ConfigError(
            f"run-config key 'algorithm' = '{run.algorithm}' exists only for the "
            "linear model; set dataset='linear' or choose fedavg for deep models."
        )


def _moments(
    client: Any, run: RunConfig, arrays: Arrays, config: ConfigRecord
) -> tuple[Arrays, Metrics]:
    return client.moments(), {protocol.NUM_EXAMPLES: float(settings(run).linear_samples)}


def distance_to_truth(run: RunConfig) -> EvaluateFn:
    """Principal angle distance of the global representation to the ground truth.

    The experiment's oracle: ``B*`` is regenerated from the seed, as every client does
    to draw its samples; it plays no part in training.
    """
    from fedpers import linear
    from fedpers.data.synthetic import LinearTasks

    values = settings(run)
    truth = LinearTasks(
        values.linear_dim, values.linear_rank, values.linear_noise_std, run.seed
    ).representation

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        estimate = arrays[BODY].numpy().T
        return MetricRecord({DISTANCE: linear.principal_angle_distance(estimate, truth)})

    return evaluate


def summary(done: RunSummary) -> dict[str, object]:
    """The distance before training, after the last round, and the first round below
    0.01."""
    distances = [r.server[DISTANCE] for r in done.records]
    below = [r.round for r in done.records if r.server[DISTANCE] < 1e-2]
    return {
        "initial_principal_angle_distance": done.initial[DISTANCE],
        "final_principal_angle_distance": distances[-1],
        "first_round_below_0.01": below[0] if below else None,
    }


def _input_shape(run: RunConfig) -> tuple[int, ...] | None:
    return (settings(run).linear_dim,) if applies(run) else None


def _sample_counts(run: RunConfig) -> tuple[int, int]:
    return settings(run).linear_samples, TEST_SAMPLES


FAMILY = families.register(
    families.FamilySpec(
        name=NAME,
        summary=summary,
        groups=(LinearSettings,),
        checks=(check_fits_data,),
        queries=(
            QuerySpec(
                LinearQuery.MOMENTS,
                MomentsSource,
                _moments,
                Faults.STARTUP,
                "linear FedRep's Method-of-Moments statistic",
            ),
        ),
        progress_metric=f"server.{DISTANCE}",
        evaluate_fn=distance_to_truth,
        evaluates_clients=False,
        input_shape=_input_shape,
        sample_counts=_sample_counts,
        wire=(BODY, HEAD, MOMENTS),
    )
)
