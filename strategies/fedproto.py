"""FedProto's server (Tan et al., AAAI 2022, Algorithm 1; the agents are
``fedpers/algorithms/fedproto.py``): it holds no model, only the global prototypes. Each round
every agent is sent them, and they become, for each class ``j``, the mean of the kept
replies' prototypes weighted by the samples behind each,

    C_bar^j = sum_i n_i^j C_i^j / sum_i n_i^j,

a class no reply holds keeping none (count 0). Under a robust ``aggregation`` each
class's prototype is the trimmed mean, median or clipped mean of its holders' instead
(``robust_prototypes``; a class held by too few replies to trim keeps its last one,
counted in ``classes-unchanged``). The counts are bounded as weights are: their sum must
be the reply's ``num-examples``, which its node's registered size caps (the counts scale
with the cap). A reply's prototypes may be at most ``screening.HUGE`` times the largest
global prototype sent (at least 1). After the last round the agents are aligned and
their communication accuracy measured (``PeerRelay.final_test``), whitened on their
training latents as the paper's baselines are and on the pilots as Sheaf-FRL is.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedpers import protocol, records
from fedpers.aggregation import Aggregation
from fedpers.algorithms.fedproto import CLASSES_UNCHANGED
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import PROTOTYPE_COUNTS, PROTOTYPES
from fedpers.strategies import screening
from fedpers.strategies.base import mean_metrics
from fedpers.strategies.peer_relay import PeerRelay


class FedProto(PeerRelay):
    """Global class prototypes, averaged from the agents' by their class counts."""

    cooperative = False
    # Aligned after training as the paper's baselines are (whitened on the training
    # latents) and as Sheaf-FRL is (on the pilots).
    whitening_modes = (sheaf_family.Whitening.TRAIN, sheaf_family.Whitening.PILOTS)

    unchanged = 0  # this round's classes held by too few replies for the trimmed mean

    def initial_arrays(self, grid: Grid, *, timeout: float) -> ArrayRecord:
        """No prototype yet: zeros, each held by 0 samples (the state keeps one shape)."""
        (classes, d), _ = self.expected_arrays()[PROTOTYPES]
        return ArrayRecord(
            {
                PROTOTYPES: Array(np.zeros((classes, d), dtype=np.float32)),
                PROTOTYPE_COUNTS: Array(np.zeros(classes, dtype=np.float64)),
            }
        )

    def train_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> dict[int, RecordDict]:
        """Every agent the global prototypes (all counts 0 before the first round)."""
        self.round_config(server_round, config)
        self.current_shared = {k: records.values(v) for k, v in arrays.items()}
        contents = {}
        for agent in self.agents:
            record = ArrayRecord(
                {k: Array(records.contiguous(v)) for k, v in self.current_shared.items()}
            )
            self._count(server_round, record.count_bytes())
            contents[agent] = RecordDict(
                {protocol.ARRAYS: record, protocol.CONFIG: ConfigRecord(dict(config))}
            )
        return contents

    def expected_arrays(self) -> dict[str, screening.ArraySpec]:
        """Prototypes (classes x d, float32) and their counts (classes, float64)."""
        classes, d = self.run.num_classes, self.dims[0]
        return {
            PROTOTYPES: ((classes, d), "float32"),
            PROTOTYPE_COUNTS: ((classes,), "float64"),
        }

    def checks(self) -> list[screening.Check]:
        return [*super().checks(), self.counts_check]

    def counts_check(self, reply: Message) -> str | None:
        """Counts are non-negative whole numbers summing to the reply's weight."""
        counts = screening.arrays_of(reply)[PROTOTYPE_COUNTS]
        if np.any(counts < 0) or np.any(counts != np.round(counts)):
            return "prototype counts are not non-negative whole numbers"
        claimed = screening.num_examples(reply)
        if not np.isclose(counts.sum(), claimed):
            return f"prototype counts sum to {counts.sum():.6g}, not num-examples {claimed:.6g}"
        return None

    def scaled_arrays(self) -> tuple[str, ...]:
        """The counts are sums over the reply's samples: they scale with a capped weight."""
        return (PROTOTYPE_COUNTS,)

    def update_norm(self, reply: Message) -> float:
        """The prototypes' update alone: the counts are checked exactly
        (``counts_check``), and, tens to hundreds of samples per class, they set the
        norm of the whole reply, so that a prototype moved by 10,932 against honest
        moves of 0.5 passed the update cap (issue 46)."""
        arrays = screening.arrays_of(reply)
        sent = self.sent_to(reply)
        return screening.update_norm(
            {PROTOTYPES: arrays[PROTOTYPES]}, {PROTOTYPES: sent[PROTOTYPES]}
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The count-weighted mean prototype of every class (under a robust
        ``aggregation``, ``robust_prototypes``)."""
        counted = self._count_replies(server_round, replies)
        valid = [r for r in counted if screening.num_examples(r) > 0]
        if not valid:
            return None, None
        total = np.zeros(self.expected_arrays()[PROTOTYPES][0])
        counts = np.zeros(self.run.num_classes)
        for reply in valid:
            sent = screening.arrays_of(reply)
            total += sent[PROTOTYPE_COUNTS][:, None] * sent[PROTOTYPES].astype(np.float64)
            counts += sent[PROTOTYPE_COUNTS]
        if self.run.aggregation == Aggregation.MEAN:
            means = total / np.maximum(counts, 1.0)[:, None]
        else:
            means, counts = self.robust_prototypes(valid, counts)
        record = ArrayRecord(
            {
                PROTOTYPES: Array(records.contiguous(means.astype(np.float32))),
                PROTOTYPE_COUNTS: Array(records.contiguous(counts)),
            }
        )
        return record, mean_metrics([r.content for r in valid])

    def robust_prototypes(
        self, replies: list[Message], counts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each class's prototype by the run's ``aggregation`` over the replies that hold
        the class (weighted by their counts where it weighs; the clipped mean's updates
        measured from the last global prototype). A class no reply holds has none, as
        under the mean; one whose holders are too few for the trimmed mean (one or two,
        at any trim) keeps its last prototype and count."""
        previous = self.current_shared[PROTOTYPES].astype(np.float64)
        previous_counts = self.current_shared[PROTOTYPE_COUNTS]
        sent = [screening.arrays_of(reply) for reply in replies]
        means, counts = np.zeros_like(previous), counts.copy()
        self.unchanged = 0
        for j in range(self.run.num_classes):
            holders = [a for a in sent if a[PROTOTYPE_COUNTS][j] > 0]
            if not holders:
                continue
            if self.trims_every_reply(len(holders)):
                means[j], counts[j] = previous[j], previous_counts[j]
                self.unchanged += 1
                continue
            combined = self.combine(
                [{PROTOTYPES: a[PROTOTYPES][j].astype(np.float64)} for a in holders],
                [float(a[PROTOTYPE_COUNTS][j]) for a in holders],
                {PROTOTYPES: previous[j]},
            )
            means[j] = combined[PROTOTYPES]
        return means, counts

    def round_metrics(self, server_round: int) -> dict[str, float]:
        """As the relay's, and under the trimmed mean the classes that kept their last
        prototype because too few replies held them (``classes-unchanged``)."""
        metrics = super().round_metrics(server_round)
        if self.run.aggregation == Aggregation.TRIMMED_MEAN:
            metrics[CLASSES_UNCHANGED] = float(self.unchanged)
        return metrics
