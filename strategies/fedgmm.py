"""FedGMM (Wu et al., "Personalized Federated Learning under Mixture of
Distributions", ICML 2023).

Shared Gaussian components over an embedding of the inputs and shared learners,
personal weights ``pi_c(m1, m2)``. The server

- initializes, once, the components every client starts from: a pooled PCA (when the
  embedding asks for one), k-means++ over the clients' local centroids, then the
  covariances of the points nearest each mean, all from client summaries;
- aggregates the learners weighted by the clients' responsibilities
  ``gamma_c(m2) = sum_m1 gamma_c(m1, m2)`` (the paper's rule);
- updates the components by exact federated EM: it pools the clients' centred
  sufficient statistics (``gmm-aggregation = "exact"``, equal to centralized EM for one
  client or clients sharing their weights), or, to reproduce the paper,
  averages the clients' local means and covariances weighted by ``gamma_c(m1)``
  (``"average"``).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedpers import gmm, protocol, records
from fedpers.config import RunConfig
from fedpers.families import mixture as mixture_family
from fedpers.families.mixture import Embedding, GmmAggregation, GmmCovariance
from fedpers.strategies import screening
from fedpers.strategies.fedem import FedEM

COMPONENTS_KEPT = "components-kept"  # components that broke the anchored bound, kept
_FREE_ROWS = {
    mixture_family.SUMMARY_CENTROIDS,
    mixture_family.SUMMARY_COUNTS,
}  # a client may find fewer local clusters: their rows are free, not their width


def _shape_key(answer: dict[str, np.ndarray]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """What must agree between start-up answers: every array's shape, but the number of
    rows of the local clusters' (centroids of another width, stacked with the others',
    crashed the run with numpy's ValueError)."""
    return tuple(
        (name, values.shape[1:] if name in _FREE_ROWS else values.shape)
        for name, values in sorted(answer.items())
    )


class FedGMM(FedEM):
    """FedEM plus federated Gaussian components.

    Reads ``gmm-components`` (M1), ``gmm-covariance``, ``gmm-ridge``,
    ``gmm-aggregation`` and ``gmm-embedding``/``gmm-embedding-dim`` besides what
    ``FedEM`` reads.
    """

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.num_components = mixture_family.settings(run).gmm_components
        self.covariance = mixture_family.settings(run).gmm_covariance
        self.ridge = mixture_family.settings(run).gmm_ridge
        self.aggregation = mixture_family.settings(run).gmm_aggregation
        self.embedding = mixture_family.embedding(run)
        self.embedding_dim = mixture_family.settings(run).gmm_embedding_dim
        # The initial components' centre and typical reach (``initial_arrays``, which a
        # resume runs too): what no component may leave by more than update-cap squared
        # typical reaches, over the whole run (``anchored``).
        self.anchor: tuple[np.ndarray, float] | None = None
        self.components_kept = 0  # this round's components that broke it

    @property
    def components(self) -> int:
        return self.num_components

    def expected_arrays(self) -> dict[str, screening.ArraySpec]:
        """FedEM's, and the statistics of the embeddings, shaped as the components."""
        means = self.sent_arrays[mixture_family.GMM_MEANS][0]
        covariances = self.sent_arrays[mixture_family.GMM_COVARIANCES][0]
        return {
            **super().expected_arrays(),
            mixture_family.STATS_COUNT: ((means[0],), "float64"),
            mixture_family.STATS_FIRST: (means, "float64"),
            mixture_family.STATS_SECOND: (covariances, "float64"),
        }

    def scaled_arrays(self) -> tuple[str, ...]:
        """FedEM's, and the statistics (sums over the samples, like ``gamma_c``)."""
        return (
            *super().scaled_arrays(),
            mixture_family.STATS_COUNT,
            mixture_family.STATS_FIRST,
            mixture_family.STATS_SECOND,
        )

    def checks(self) -> list[screening.Check]:
        """FedEM's, then the statistics' invariants."""
        return [*super().checks(), self.statistics_defect]

    def statistics_defect(self, reply: Message) -> str | None:
        """The statistics ``(sum r, sum r (z - c), sum r (z - c)(z - c)^T)`` must be those
        of some data: counts non-negative and equal to ``gamma_c(m1)``, second moments
        symmetric positive semi-definite, and the implied covariances too."""
        arrays = screening.arrays_of(reply)
        count = arrays[mixture_family.STATS_COUNT]
        if not np.allclose(count, arrays[mixture_family.GAMMA].sum(axis=1), rtol=1e-6, atol=1e-6):
            return "statistics counts differ from the responsibilities"
        second = arrays[mixture_family.STATS_SECOND]
        full = self.covariance == GmmCovariance.FULL
        first = arrays[mixture_family.STATS_FIRST]
        reason = screening.statistics_defect(count, first, second, full=full)
        return reason or empty_defect(count, first, second) or self.spread_defect(count, second)

    def spread_defect(self, count: np.ndarray, second: np.ndarray) -> str | None:
        """Why a reply's statistics spread farther than any data near the components the
        server sent, or None: per component, the mean squared distance of its samples to
        the component's mean (``trace(second) / count``) may be at most
        ``screening.HUGE`` times the component's variance (the trace of its covariance).

        Second moments scaled by 1e300, or samples shifted by 1e6, were adopted before:
        finite and PSD, they pass every other check. The mean offset is bounded too,
        since its square is at most that mean squared distance.
        """
        sent = self.current[mixture_family.GMM_COVARIANCES].numpy()
        variance, scatter = self.traces(sent), self.traces(second)
        for k in np.flatnonzero(count > 0):
            spread = float(scatter[k] / count[k])
            bound = screening.HUGE * max(float(variance[k]), 1e-12)
            if not spread <= bound:
                return (
                    f"statistics of component {k} spread {spread:.3g} (mean squared "
                    f"distance), beyond {screening.HUGE:g} x its variance {variance[k]:.3g}"
                )
        return None

    def traces(self, matrices: np.ndarray) -> np.ndarray:
        """Per component, the trace of a (K, d, d) stack of full matrices, or the sum of
        a (K, d) stack of diagonals."""
        if self.covariance == GmmCovariance.FULL:
            return np.trace(matrices, axis1=-2, axis2=-1)
        return matrices.sum(axis=-1)

    def update_bounded(self, screened: screening.Screened) -> screening.Screened:
        """FedEM's bound on the learners' updates, then the same on the statistics: per
        component, a reply's spread (the mean squared distance of its samples to the
        component's mean, ``trace(second) / count``) may be at most ``update-cap``
        squared times the lower median of the spreads of the round's replies that
        hold samples of it. The spread bounds the offset of the reply's mean too (its
        square is at most the spread), so one client's statistics move a component by
        at most its share of ``update-cap`` typical distances. A reply beyond it is left
        out, with the reason."""
        screened = super().update_bounded(screened)
        counted = [r for r in screened.kept if screening.num_examples(r) > 0]
        if len(counted) < 2:
            return screened
        spreads = []
        for reply in counted:
            arrays = screening.arrays_of(reply)
            count = arrays[mixture_family.STATS_COUNT]
            second = arrays[mixture_family.STATS_SECOND]
            scatter = self.traces(second)
            spreads.append(np.where(count > 0, scatter / np.where(count > 0, count, 1.0), np.nan))
        table = np.stack(spreads)  # (replies, components); nan where a reply has none
        cap = self.run.update_cap**2
        reasons: dict[int, str] = {}
        for k in range(table.shape[1]):
            held = [i for i in range(len(counted)) if not np.isnan(table[i, k])]
            bound, beyond = screening.norm_outliers([float(table[i, k]) for i in held], cap)
            for j in beyond:
                reasons.setdefault(
                    held[j],
                    f"statistics of component {k} spread {table[held[j], k]:.3g}, beyond "
                    f"update-cap {self.run.update_cap:g} squared x the round's lower median "
                    f"{bound / cap:.3g}",
                )
        if not reasons:
            return screened
        return self.left_out(screened, {counted[i]: r for i, r in sorted(reasons.items())})

    def state_defect(self, new: ArrayRecord, previous: ArrayRecord) -> str | None:
        """FedEM's, and every covariance positive definite."""
        reason = super().state_defect(new, previous)
        if reason is not None:
            return reason
        covariances = new[mixture_family.GMM_COVARIANCES].numpy()
        if self.covariance == GmmCovariance.FULL:
            try:
                np.linalg.cholesky(covariances)
            except np.linalg.LinAlgError:
                return "a global covariance is not positive definite"
        elif np.any(covariances <= 0):
            return "a global variance is not positive"
        return None

    def learner_weights(self, content: RecordDict) -> np.ndarray:
        """``gamma_c(m2)``: a client's responsibility for each learner."""
        gamma = content.array_records[protocol.ARRAYS][mixture_family.GAMMA].numpy()
        return np.asarray(gamma.sum(axis=0))

    # ------------------------------------------------------------ initialization
    def initial_arrays(self, grid: Grid, *, timeout: float) -> ArrayRecord:
        """Learners and uniform weights (FedEM), then the shared initial components."""
        arrays = super().initial_arrays(grid, timeout=timeout)
        if self.embedding != Embedding.IDENTITY:
            moments = self._ask(
                grid, mixture_family.QUERY_PCA, RecordDict(), timeout, self._pca_defect
            )
            mean, directions = gmm.pca_from_moments(
                float(sum(m[mixture_family.PCA_COUNT][0] for m in moments)),
                np.sum([m[mixture_family.PCA_SUM] for m in moments], axis=0),
                np.sum([m[mixture_family.PCA_OUTER] for m in moments], axis=0),
                self.embedding_dim,
            )
            arrays[mixture_family.PCA_MEAN] = Array(mean)
            arrays[mixture_family.PCA_DIRECTIONS] = Array(np.ascontiguousarray(directions))
        content = RecordDict({protocol.ARRAYS: arrays})
        records = self._ask(
            grid, mixture_family.QUERY_SUMMARY, content, timeout, self._summary_defect
        )
        means = gmm.initial_means(
            np.concatenate([r[mixture_family.SUMMARY_CENTROIDS] for r in records]),
            np.concatenate([r[mixture_family.SUMMARY_COUNTS] for r in records]),
            self.num_components,
            self.run.seed,
        )
        arrays[mixture_family.GMM_MEANS] = Array(np.ascontiguousarray(means))
        content = RecordDict({protocol.ARRAYS: arrays})
        assigned = self._ask(
            grid, mixture_family.QUERY_ASSIGN, content, timeout, self._assign_defect
        )
        pooled = _pooled(assigned, means)
        start = gmm.components_from_statistics(
            pooled, ridge=self.ridge, previous=_fallback(means, self.covariance)
        )
        arrays[mixture_family.GMM_COVARIANCES] = Array(np.ascontiguousarray(start.covariances))
        center = np.median(start.means, axis=0)
        self.anchor = (center, float(np.median(self.reaches(start, center))))
        return arrays

    def reaches(self, components: gmm.Components, center: np.ndarray) -> np.ndarray:
        """Per component, how far its samples lie from ``center``: the squared distance
        of its mean plus its variance (the trace of its covariance), the mean squared
        distance of its samples to ``center``."""
        offsets = np.sum((components.means - center) ** 2, axis=-1)
        return offsets + self.traces(components.covariances)

    def anchored(self, new: gmm.Components, previous: gmm.Components) -> gmm.Components:
        """``new``, where each component whose reach from the initial components' centre
        exceeds ``update-cap`` squared times their median reach keeps its ``previous``
        value (counted in ``components-kept``). Per-round bounds measure a reply against
        the round's components and replies, so a patient attacker compounds them (a
        component's variance grew from 5e4 to 4e20 in six rounds, one client of four,
        under every per-round bound); this bound does not move with the state."""
        if self.anchor is None:
            return new
        center, reach = self.anchor
        bound = self.run.update_cap**2 * max(reach, 1e-12)
        beyond = ~(self.reaches(new, center) <= bound)
        self.components_kept = int(beyond.sum())
        if not self.components_kept:
            return new
        means, covariances = new.means.copy(), new.covariances.copy()
        means[beyond], covariances[beyond] = previous.means[beyond], previous.covariances[beyond]
        return gmm.Components(means, covariances)

    def train_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> dict[int, RecordDict]:
        """FedEM's; a round starts with no component kept by ``anchored``."""
        self.components_kept = 0
        return super().train_contents(server_round, arrays, config, grid)

    def round_metrics(self, server_round: int) -> dict[str, float]:
        """FedEM's, and the components that kept their value by ``anchored`` (when any)."""
        kept = {COMPONENTS_KEPT: float(self.components_kept)} if self.components_kept else {}
        return {**super().round_metrics(server_round), **kept}

    def _ask(
        self,
        grid: Grid,
        query: str,
        content: RecordDict,
        timeout: float,
        check: screening.Check,
    ) -> list[dict[str, np.ndarray]]:
        """The seen clients' usable answers to an initialization query, in partition
        order: each passes ``check``, its arrays have the shapes most clients' have, and
        none is 100 times larger than the median answer (a scaled-up client)."""
        answers = self.startup(grid, query, self.seen, content, timeout, check)
        shapes = Counter(_shape_key(a) for a in answers.values())
        usual = shapes.most_common(1)[0][0]
        sizes = {  # in float64: every answer passed ``check``'s dtype test, but a check
            # that forgot it must not let abs() of int64's least value come out negative
            p: max(float(np.max(np.abs(v.astype(np.float64)), initial=0.0)) for v in a.values())
            for p, a in answers.items()
        }
        large = screening.outliers(sizes)
        for partition, answer in list(answers.items()):
            shape = _shape_key(answer)
            if shape != usual or partition in large:
                why = "its arrays are shaped unlike most" if shape != usual else "100x the median"
                self.reject_at_startup(partition, f"{query}: {why}")
                del answers[partition]
        return [answers[p] for p in sorted(answers)]

    def _held(self, reply: Message, count: float) -> str | None:
        """Why a start-up answer's ``count`` of samples cannot be its node's: negative,
        or more than its weight bound (``Federation.weight_bounds``)."""
        partition = self.federation.partition(reply)
        held = self.federation.weight_bounds([partition])[partition]
        if not count >= 0:
            return "a negative count"
        if count > held * (1 + 1e-9):
            return f"counts of {count:g} samples, more than the {held:g} it may hold"
        return None

    def _pca_defect(self, reply: Message) -> str | None:
        arrays = screening.arrays_of(reply)
        if set(arrays) != {
            mixture_family.PCA_COUNT,
            mixture_family.PCA_SUM,
            mixture_family.PCA_OUTER,
        }:
            expected = {mixture_family.PCA_COUNT, mixture_family.PCA_SUM, mixture_family.PCA_OUTER}
            return f"arrays {sorted(arrays)}, expected {sorted(expected)}"
        if reason := screening.dtype_defect(arrays):
            return reason
        count, total, outer = (
            arrays[mixture_family.PCA_COUNT],
            arrays[mixture_family.PCA_SUM],
            arrays[mixture_family.PCA_OUTER],
        )
        if count.shape != (1,) or total.ndim != 1 or outer.shape != (len(total), len(total)):
            return "moments of inconsistent shapes"
        if reason := self._held(reply, float(count[0])):
            return reason
        return screening.statistics_defect(count, total[None, :], outer[None], full=True)

    def _summary_defect(self, reply: Message) -> str | None:
        arrays = screening.arrays_of(reply)
        if set(arrays) != {mixture_family.SUMMARY_CENTROIDS, mixture_family.SUMMARY_COUNTS}:
            return f"arrays {sorted(arrays)}, expected centroids and counts"
        if reason := screening.dtype_defect(arrays):
            return reason
        centroids, counts = (
            arrays[mixture_family.SUMMARY_CENTROIDS],
            arrays[mixture_family.SUMMARY_COUNTS],
        )
        if centroids.ndim != 2 or counts.shape != (len(centroids),):
            return "centroids and counts of inconsistent shapes"
        if len(centroids) > 2 * self.num_components:
            return f"{len(centroids)} centroids, more than {2 * self.num_components}"
        if np.any(counts < 0):
            return "negative centroid counts"
        return self._held(reply, float(counts.sum()))

    def _assign_defect(self, reply: Message) -> str | None:
        arrays = screening.arrays_of(reply)
        names = {
            mixture_family.STATS_COUNT,
            mixture_family.STATS_FIRST,
            mixture_family.STATS_SECOND,
        }
        if set(arrays) != names:
            return f"arrays {sorted(arrays)}, expected {sorted(names)}"
        if reason := screening.dtype_defect(arrays):
            return reason
        count = arrays[mixture_family.STATS_COUNT]
        first, second = arrays[mixture_family.STATS_FIRST], arrays[mixture_family.STATS_SECOND]
        full = self.covariance == GmmCovariance.FULL
        shape = (len(count), first.shape[-1], first.shape[-1]) if full else first.shape
        if count.ndim != 1 or first.shape[:1] != count.shape or second.shape != shape:
            return "statistics of inconsistent shapes"
        if reason := self._held(reply, float(count.sum())):
            return reason
        return screening.statistics_defect(count, first, second, full=full)

    # ---------------------------------------------------------------- aggregation
    def aggregate_components(
        self, arrays: list[ArrayRecord], gammas: list[np.ndarray]
    ) -> dict[str, np.ndarray]:
        """New means and covariances from the clients' centred statistics."""
        previous = gmm.Components(
            self.current[mixture_family.GMM_MEANS].numpy(),
            self.current[mixture_family.GMM_COVARIANCES].numpy(),
        )
        decoded = [{name: records.values(array) for name, array in a.items()} for a in arrays]
        if self.aggregation == GmmAggregation.EXACT:
            new = gmm.components_from_statistics(
                _pooled(decoded, previous.means), ridge=self.ridge, previous=previous
            )
        else:
            local = [
                gmm.components_from_statistics(
                    _pooled([a], previous.means), ridge=self.ridge, previous=previous
                )
                for a in decoded
            ]
            component_weights = np.stack([g.sum(axis=1) for g in gammas])  # (C, M1)
            new = gmm.average_components(local, component_weights, previous=previous)
        new = self.anchored(new, previous)
        return {
            mixture_family.GMM_MEANS: new.means,
            mixture_family.GMM_COVARIANCES: new.covariances,
        }


def empty_defect(count: np.ndarray, first: np.ndarray, second: np.ndarray) -> str | None:
    """Statistics of no data are zero: a component of count 0 with a first or second
    moment (issue 46: second moments of 1e8-1e13 on a count of 0 passed every other
    check, since the spread is measured per unit of count, and grew the pooled
    covariance by up to 1.4e11)."""
    for k in np.flatnonzero(count == 0):
        if np.any(first[k] != 0) or np.any(second[k] != 0):
            largest = float(np.max(np.abs(second[k]), initial=0.0))
            return (
                f"statistics of component {k} count no sample but have moments (second "
                f"up to {largest:.3g}): no data has those"
            )
    return None


def _pooled(arrays: list[dict[str, np.ndarray]], center: np.ndarray) -> gmm.Statistics:
    """Sum of the clients' statistics, all centred on ``center``."""
    total: gmm.Statistics | None = None
    for record in arrays:
        stats = gmm.Statistics(
            record[mixture_family.STATS_COUNT],
            record[mixture_family.STATS_FIRST],
            record[mixture_family.STATS_SECOND],
            np.asarray(center, dtype=float),
        )
        total = stats if total is None else total + stats
    if total is None:
        raise ValueError("no statistics to pool")
    return total


def _fallback(means: np.ndarray, covariance: str) -> gmm.Components:
    """Unit covariances, for a component no client sample is nearest to."""
    d = means.shape[1]
    unit = (
        np.stack([np.eye(d)] * len(means))
        if covariance == GmmCovariance.FULL
        else np.ones_like(means)
    )
    return gmm.Components(means, unit)
