"""FedEM (Marfoq et al., "Federated Multi-Task Learning under a Mixture of
Distributions", NeurIPS 2021): shared learners, personal mixture weights.

Every learner is averaged over the sampled clients weighted by their sample counts;
the clients' summed responsibilities ``gamma_c`` give the server's global mixture
weights (used by clients that never trained and for scoring new samples). FedGMM
extends it with Gaussian components and responsibility-weighted learners.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedpers import gmm, protocol, records
from fedpers.aggregation import Aggregation
from fedpers.config import RunConfig
from fedpers.families import mixture as mixture_family
from fedpers.strategies import screening
from fedpers.strategies.base import FedpersStrategy, mean_metrics


class FedEM(FedpersStrategy):
    """Average each learner; keep the global mixture weights from the clients' gammas.

    Reads ``mixture-learners`` (M2) besides what ``FedpersStrategy`` reads.
    """

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.learners = mixture_family.settings(run).mixture_learners
        self.current = ArrayRecord()  # the global arrays a round's aggregation starts from

    @property
    def components(self) -> int:
        """Cells on the component axis of the weights (FedEM: one, no density)."""
        return 1

    def initial_arrays(self, grid: Grid, *, timeout: float) -> ArrayRecord:
        """The seeded learners (from one node) and uniform global weights."""
        arrays = super().initial_arrays(grid, timeout=timeout)
        cells = self.components * self.learners
        arrays[mixture_family.MIXTURE_WEIGHTS] = Array(
            np.full((self.components, self.learners), 1 / cells)
        )
        return arrays

    def train_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> dict[int, RecordDict]:
        """As FedpersStrategy; remembers the arrays the aggregation starts from."""
        self.current = arrays
        return super().train_contents(server_round, arrays, config, grid)

    # ---------------------------------------------------------------- screening
    def expected_arrays(self) -> dict[str, screening.ArraySpec]:
        """The learners as sent, and ``gamma_c`` (M1, M2)."""
        learners = {
            name: spec
            for name, spec in self.sent_arrays.items()
            if any(name.startswith(mixture_family.learner_prefix(m)) for m in range(self.learners))
        }
        return {**learners, mixture_family.GAMMA: ((self.components, self.learners), "float64")}

    def scaled_arrays(self) -> tuple[str, ...]:
        """``gamma_c`` sums over the client's samples: a capped weight scales it."""
        return (mixture_family.GAMMA,)

    def checks(self) -> list[screening.Check]:
        """FedpersStrategy's, then the responsibilities' invariants."""
        return [*super().checks(), self.responsibilities_defect]

    def responsibilities_defect(self, reply: Message) -> str | None:
        """``gamma_c`` must be non-negative and sum to the client's samples (each sample's
        responsibilities sum to one)."""
        gamma = screening.arrays_of(reply)[mixture_family.GAMMA]
        if np.any(gamma < 0):
            return "negative responsibilities"
        samples = screening.num_examples(reply)
        if not abs(float(gamma.sum()) - samples) <= 1e-6 * max(1.0, samples):
            return (
                f"responsibilities sum to {float(gamma.sum()):.6g}, not to its {samples:g} samples"
            )
        return None

    def state_defect(self, new: ArrayRecord, previous: ArrayRecord) -> str | None:
        """FedpersStrategy's, and the global mixture weights must be a distribution."""
        reason = super().state_defect(new, previous)
        if reason is not None:
            return reason
        weights = new[mixture_family.MIXTURE_WEIGHTS].numpy()
        if np.any(weights < 0) or not abs(float(weights.sum()) - 1.0) <= 1e-6:
            return "the global mixture weights are not a distribution"
        return None

    # -------------------------------------------------------------- aggregation
    def learner_weights(self, content: RecordDict) -> np.ndarray:
        """Weight of a client's learners in their averages (M2,): its sample count."""
        count = records.number(content.metric_records[protocol.METRICS][protocol.NUM_EXAMPLES])
        return np.full(self.learners, count)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Weighted learner averages, global weights, and (FedGMM) the components."""
        valid = [r for r in replies if screening.num_examples(r) > 0]
        if not valid:
            return None, None
        contents = [reply.content for reply in valid]
        arrays = [c.array_records[protocol.ARRAYS] for c in contents]
        weights = np.stack([self.learner_weights(c) for c in contents])  # (C, M2)
        updated = {name: records.values(array) for name, array in self.current.items()}
        for m in range(self.learners):
            if not weights[:, m].sum() > 0:
                continue  # no client used this learner: keep it
            prefix = mixture_family.learner_prefix(m)
            names = [n for n in updated if n.startswith(prefix)]
            if self.run.aggregation == Aggregation.MEAN:
                for name in names:
                    average = gmm.weighted_average(
                        [records.values(a[name]) for a in arrays], weights[:, m]
                    )
                    updated[name] = average.astype(updated[name].dtype)
                continue
            users = [c for c in range(len(arrays)) if weights[c, m] > 0]
            combined = self.combine(
                [{n: arrays[c][n].numpy() for n in names} for c in users],
                [float(weights[c, m]) for c in users],
                {n: updated[n] for n in names},
            )
            updated.update(combined)
        gammas = [a[mixture_family.GAMMA].numpy() for a in arrays]
        updated[mixture_family.MIXTURE_WEIGHTS] = gmm.global_weights(gammas)
        updated.update(self.aggregate_components(arrays, gammas))
        metrics = mean_metrics(contents)
        return ArrayRecord({k: Array(records.contiguous(v)) for k, v in updated.items()}), metrics

    def aggregate_components(
        self, arrays: list[ArrayRecord], gammas: list[np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Further global arrays from the replies; FedEM has none."""
        return {}
