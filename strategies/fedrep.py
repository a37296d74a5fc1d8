"""FedRep (Collins et al., "Exploiting Shared Representations for Personalized
Federated Learning", ICML 2021).

The server averages only the representation (the model's ``body``); heads stay on the
devices. In the linear case (Section 4) the server orthonormalizes the average (QR),
and the representation starts from the Method-of-Moments estimate.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.serverapp import Grid

from fedpers import linear, protocol
from fedpers.protocol import Algorithm
from strategies.base import FedpersStrategy

BODY = "body.weight"  # the linear model's representation, stored as B^T (k x d)


class FedRep(FedpersStrategy):
    """Average the representation over the sampled clients; never touch heads."""

    algorithm = Algorithm.FEDREP


class FedRepLinear(FedRep):
    """Linear FedRep: Method-of-Moments start; average, then orthonormalize.

    Parameters
    ----------
    rank : int
        Dimension ``k`` of the representation.
    **kwargs
        As for ``FedpersStrategy``.
    """

    def __init__(self, *, rank: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.rank = rank

    def initial_arrays(self, grid: Grid, *, timeout: float) -> ArrayRecord:
        """``B0`` from the Method of Moments over every node."""
        initial = moments_representation(self, grid, self.rank, timeout=timeout)
        return ArrayRecord({BODY: Array(np.ascontiguousarray(initial.T))})

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Average the clients' ``B``, then keep Q of its QR decomposition."""
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None:
            averaged = arrays[BODY].numpy().T
            arrays = ArrayRecord(
                {BODY: Array(np.ascontiguousarray(linear.orthonormalize(averaged).T))}
            )
        return arrays, metrics


def moments_representation(
    strategy: FedpersStrategy, grid: Grid, rank: int, *, timeout: float
) -> np.ndarray:
    """The Method-of-Moments representation (d x k) from every node's statistic.

    Each node sends ``(1/m) sum_j y_j^2 x_j x_j^T``; the top-``rank`` eigenvectors of
    their average span ``B*`` approximately (FedRep, Section 4 and Appendix B).
    """
    node_ids = [strategy.node_of_partition[p] for p in sorted(strategy.node_of_partition)]
    replies = strategy.query(grid, protocol.QUERY_MOMENTS, node_ids, timeout=timeout)
    statistics = [
        reply.content.array_records[protocol.ARRAYS]["moments"].numpy() for reply in replies
    ]
    return linear.method_of_moments(statistics, rank)
