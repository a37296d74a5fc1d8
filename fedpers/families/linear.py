"""The linear family: FedRep's linear representation learning (its Section 4).

Runs of the data set ``linear`` belong here, whatever their row: each client draws fresh
samples ``y = x^T B* w_i + noise`` every round, the server averages the clients'
representations and orthogonalizes them (``strategies/fedrep.py``), and evaluates the
principal angle distance of the global representation to ``B*`` itself. Clients are
not evaluated. The family's settings, its checks, its wire names, the
Method-of-Moments query of the initialization, the server's evaluation and the summary
live here; the math is ``fedpers.linear``.

The family's local update, written for a cohort in numpy (no torch), is FedRep's (the
variant of the row ``fedrep``): each member solves its head exactly by least squares
(or takes ``linear-head-steps`` gradient steps from the head it keeps), then one
gradient step on ``B``. A row's linear variant names its own update module for what
differs (``fedpers.algorithms.fedsgd``); the rest, the Method-of-Moments statistic
(``moments``) for one, is this module's. Every member draws its fresh samples from its
own stream, ``rng(seed, "linear", purpose, partition, round)``, whatever its cohort.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord

from fedpers import families, linear, protocol, records
from fedpers.families import EvaluateFn, Faults, QuerySpec, RunSummary
from fedpers.seeding import rng
from fedpers.settings import ConfigError, at_least, setting, step_size

if TYPE_CHECKING:
    from fedpers.cohort import Arrays, Cohort, Member, Metrics, Reply
    from fedpers.config import RunConfig
    from fedpers.data.synthetic import LinearTasks

NAME = families.LINEAR
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
        step_size("linear-lr", self.linear_lr)
        step_size("linear-head-lr", self.linear_head_lr)
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


# ----------------------------------------------------------------- local update
@dataclass(frozen=True)
class Task:
    """One client's regression task: ``y = x^T B* w_i* + noise`` with its head
    ``w_i*`` (``client``: the partition whose head it is)."""

    tasks: LinearTasks
    client: int

    def sample(self, count: int, generator: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``count`` fresh pairs (X: count x d, y: count) drawn from ``generator``."""
        return self.tasks.sample(self.client, count, generator)


class LinearLocal:
    """A cohort's side of a linear update (numpy): each member's task (``data``), its
    own random streams (``generators``), the round's settings and what it received.

    As ``fedpers.update.Local`` for the torch updates: an update takes its samples from
    ``data`` and ``generators`` only (``samples``), which the equality test's controls
    swap between two members.

    Parameters
    ----------
    cohort : Cohort
        The members, the run configuration and the round's settings.
    """

    def __init__(self, cohort: Cohort) -> None:
        self.cohort = cohort
        self.run = cohort.run
        self.config = cohort.config
        self.members = cohort.members
        self.values = settings(cohort.run)

    @cached_property
    def data(self) -> list[Task]:
        """Each member's task (the generative model regenerated from the seed)."""
        from fedpers.data.synthetic import LinearTasks

        values = self.values
        tasks = LinearTasks(
            values.linear_dim, values.linear_rank, values.linear_noise_std, self.run.seed
        )
        return [Task(tasks, member.partition) for member in self.members]

    def generators(self, purpose: str, server_round: int) -> list[np.random.Generator]:
        """Each member's stream for ``purpose`` in ``server_round``, seeded by the run,
        the purpose, its partition and the round: its own, whatever its cohort."""
        return [
            rng(self.run.seed, "linear", purpose, member.partition, server_round)
            for member in self.members
        ]

    @property
    def round(self) -> int:
        """The round the server named in its message."""
        return records.config_int(self.config, protocol.ROUND)

    @property
    def lr(self) -> float:
        """The step on ``B`` the server sent for this round."""
        return records.config_float(self.config, protocol.LR)

    def samples(
        self, purpose: str, server_round: int, count: int | None = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each member's fresh samples for ``purpose`` in ``server_round`` (``count``,
        by default ``linear-samples``)."""
        size = count or self.values.linear_samples
        streams = self.generators(purpose, server_round)
        return [task.sample(size, stream) for task, stream in zip(self.data, streams, strict=True)]

    def received(self, names: Sequence[str]) -> list[Arrays]:
        """Each member's arrays; each must hold ``names``.

        Raises
        ------
        ValueError
            Naming the arrays expected and those received.
        """
        for member in self.members:
            if not set(names) <= set(member.arrays):
                raise ValueError(
                    f"{self.run.algorithm} client (linear) expected arrays {sorted(names)}, "
                    f"received {sorted(member.arrays)}"
                )
        return [member.arrays for member in self.members]

    def test(self, models: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[Metrics]:
        """Each member's mean squared error with its model ``(B, w)`` on
        ``TEST_SAMPLES`` fresh test samples of the round."""
        tests = self.samples("test", self.round, TEST_SAMPLES)
        return [
            {
                protocol.NUM_EXAMPLES: float(len(y)),
                protocol.LOSS: linear.mean_squared_error(x, y, representation, head),
            }
            for (x, y), (representation, head) in zip(tests, models, strict=True)
        ]


def stored_head(member: Member) -> np.ndarray | None:
    """The head ``member`` kept from earlier rounds, if any."""
    if protocol.STATE_PERSONAL not in member.state:
        return None
    record = member.state[protocol.STATE_PERSONAL]
    assert isinstance(record, ArrayRecord)
    head: np.ndarray = record[HEAD].numpy()[0]
    return head


def store_head(member: Member, head: np.ndarray) -> None:
    """Keep ``member``'s head on its device for later rounds."""
    member.state[protocol.STATE_PERSONAL] = ArrayRecord({HEAD: Array(head[None, :].copy())})


def moments(cohort: Cohort) -> list[Reply]:
    """Each member's Method-of-Moments statistic of ``linear-samples`` fresh samples
    (``query.moments``: FedRep's initialization)."""
    local = LinearLocal(cohort)
    count = float(local.values.linear_samples)
    return [
        ({MOMENTS: linear.moment_statistic(x, y)}, {protocol.NUM_EXAMPLES: count})
        for x, y in local.samples("moments", 0)
    ]


def fit(cohort: Cohort) -> list[Reply]:
    """FedRep (linear): each member's head solved exactly on its fresh samples
    (``linear-head-steps`` = 0; 1 or 10 take that many gradient steps from the head it
    keeps instead: GD-GD, 10GD-GD), kept, then one gradient step on ``B``."""
    local = LinearLocal(cohort)
    received = local.received((BODY,))
    lr = local.lr
    draws = local.samples("train", local.round)
    steps = [
        _fedrep_step(local, member, arrays[BODY].T, sample, lr)
        for member, arrays, sample in zip(local.members, received, draws, strict=True)
    ]
    for member, (_, head) in zip(local.members, steps, strict=True):  # once all succeeded
        store_head(member, head)
    return [reply for reply, _ in steps]


def _fedrep_step(
    local: LinearLocal,
    member: Member,
    representation: np.ndarray,
    sample: tuple[np.ndarray, np.ndarray],
    lr: float,
) -> tuple[Reply, np.ndarray]:
    """One member's reply (its step on ``B``) and its new head, to keep."""
    x, y = sample
    steps = local.values.linear_head_steps
    if steps == 0:
        head = linear.least_squares_head(x, y, representation)
    else:
        start = stored_head(member)
        head = linear.gradient_descent_head(
            x,
            y,
            representation,
            np.zeros(local.values.linear_rank) if start is None else start,
            lr=local.values.linear_head_lr,
            steps=steps,
        )
    loss = linear.mean_squared_error(x, y, representation, head)
    step = lr * linear.representation_gradient(x, y, representation, head)
    metrics = {protocol.NUM_EXAMPLES: float(len(y)), protocol.LOSS: loss}
    return ({BODY: (representation - step).T}, metrics), head


def evaluate(cohort: Cohort) -> list[Metrics]:
    """Each member's test error with the global ``B`` and the head it keeps; a member
    that never trained solves its head on a fresh batch, as a round would."""
    local = LinearLocal(cohort)
    representations = [arrays[BODY].T for arrays in local.received((BODY,))]
    kept = [stored_head(member) for member in local.members]
    draws = local.samples("train", 0) if any(head is None for head in kept) else []
    heads = [
        linear.least_squares_head(*draws[i], representation) if head is None else head
        for i, (head, representation) in enumerate(zip(kept, representations, strict=True))
    ]
    return local.test(list(zip(representations, heads, strict=True)))


def distance_to_truth(run: RunConfig) -> EvaluateFn:
    """Principal angle distance of the global representation to the ground truth.

    The experiment's oracle: ``B*`` is regenerated from the seed, as every client does
    to draw its samples; it plays no part in training.
    """
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
                faults=Faults.STARTUP,
                doc="linear FedRep's Method-of-Moments statistic",
                function="moments",
            ),
        ),
        progress_metric=f"server.{DISTANCE}",
        evaluate_fn=distance_to_truth,
        evaluates_clients=False,
        input_shape=_input_shape,
        sample_counts=_sample_counts,
        wire=(BODY, HEAD, MOMENTS),
        update=__name__,
    )
)
