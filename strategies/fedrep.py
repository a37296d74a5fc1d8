"""FedRep (Collins et al., "Exploiting Shared Representations for Personalized
Federated Learning", ICML 2021), linear case (Section 4).

The deep FedRep is a row of the algorithm table (``fedpers.algorithms``): the base
strategy averages the shared ``body`` and never sees heads. In the linear case the
server also orthonormalizes the average (QR), and the representation starts from the
Method-of-Moments estimate.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedpers import linear, protocol, records
from fedpers.families import linear as linear_family
from fedpers.families.linear import BODY as LINEAR_BODY
from fedpers.strategies import screening
from fedpers.strategies.base import FedpersStrategy


class FedRepLinear(FedpersStrategy):
    """Linear FedRep: Method-of-Moments start; average, then orthonormalize.

    Reads ``linear-rank`` (the dimension ``k`` of the representation) besides what
    ``FedpersStrategy`` reads.
    """

    def step_size(self) -> float:
        """The step on ``B`` (``linear-lr``)."""
        return linear_family.settings(self.run).linear_lr

    def initial_arrays(self, grid: Grid, *, timeout: float) -> ArrayRecord:
        """``B0`` from the Method of Moments over every node."""
        initial = moments_representation(self, grid, timeout=timeout)
        return ArrayRecord({LINEAR_BODY: Array(records.contiguous(initial.T))})

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Average the clients' ``B``, then keep Q of its QR decomposition."""
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None:
            averaged = arrays[LINEAR_BODY].numpy().T
            arrays = ArrayRecord(
                {LINEAR_BODY: Array(records.contiguous(linear.orthonormalize(averaged).T))}
            )
        return arrays, metrics


def moments_representation(strategy: FedpersStrategy, grid: Grid, *, timeout: float) -> np.ndarray:
    """The Method-of-Moments representation (d x k) from every node's statistic.

    Each node sends ``(1/m) sum_j y_j^2 x_j x_j^T``; the top-``k`` eigenvectors of
    their average span ``B*`` approximately (FedRep, Section 4 and Appendix B).
    """
    partitions = sorted(strategy.federation.node_of_partition)
    d = linear_family.settings(strategy.run).linear_dim
    statistics = strategy.startup(
        grid,
        linear_family.QUERY_MOMENTS,
        partitions,
        RecordDict(),
        timeout,
        check=functools.partial(_moments_defect, dim=d),
    )
    scale = {p: float(np.linalg.norm(s[linear_family.MOMENTS])) for p, s in statistics.items()}
    for partition in sorted(screening.outliers(scale)):
        strategy.reject_at_startup(
            partition, f"{linear_family.QUERY_MOMENTS}: a statistic 100x the median"
        )
        del statistics[partition]
    return linear.method_of_moments(
        [statistics[p][linear_family.MOMENTS] for p in sorted(statistics)],
        linear_family.settings(strategy.run).linear_rank,
    )


def _moments_defect(reply: Message, *, dim: int) -> str | None:
    """A moment statistic is one symmetric positive semi-definite ``d x d`` matrix."""
    returned = reply.content.array_records.get(protocol.ARRAYS, ArrayRecord())
    if reason := screening.arrays_defect(
        returned, {linear_family.MOMENTS: ((dim, dim), "float64")}
    ):
        return reason
    return screening.symmetric_psd_defect(
        linear_family.MOMENTS, screening.arrays_of(reply)[linear_family.MOMENTS]
    )
