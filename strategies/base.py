"""What every fedpers strategy adds to Flower's FedAvg.

- The population: wait until every expected node is registered (Flower starts the
  ServerApp before all virtual nodes are up), then ask each node which partition it
  holds (``query.info``), so that sampling is by partition id and reproducible.
- Sampling: a fixed fraction of the partitions each round, drawn from the run seed.
- Messages carry only the shared model parts; the algorithm's split is declared in
  ``fedpers.protocol.SHARED_PARTS``.
- Evaluation on ALL nodes every round (global shared parts + each node's own parts),
  weighted by test samples (FedAvg's ``num-examples`` weighting).
- ``start`` runs Flower's round loop and reports each round to an ``on_round``
  callback (the results writer), outside of any aggregation code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import ClassVar

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from fedpers import protocol
from fedpers.aggregation import weighted_mean
from fedpers.protocol import Algorithm
from fedpers.results import RoundRecord
from fedpers.seeding import rng

logger = logging.getLogger(__name__)

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


class PopulationError(RuntimeError):
    """The nodes that registered do not form the federation the run expects."""


class RoundFailedError(RuntimeError):
    """A round got fewer usable replies than ``min_replies``."""


class FedpersStrategy(FedAvg):
    """FedAvg with a known population, seeded sampling and full evaluation.

    Parameters
    ----------
    num_nodes : int
        Number of nodes (partitions) the run expects; training waits for all of them.
    fraction_train : float (default: 0.1)
        Fraction of the nodes sampled for training each round (at least one node).
    seed : int (default: 0)
        Seed of the per-round sample.
    evaluate_nodes : bool (default: True)
        Send EVALUATE to every node each round. Off for runs evaluated on the server.
    unseen_fraction : float (default: 0.0)
        Fraction of the partitions (the highest ids) that never train nor take part in
        the per-round evaluation: the unseen clients of FedGMM's Table 4, tested once
        after the last round (``final_evaluation``).
    adapt_fraction : float (default: 0.5)
        Share of an unseen client's samples it may adapt on; it is tested on the rest.
    lr_schedule : str (default: "constant")
        ``constant``, or ``milestones``: the learning rate times 0.1 from half of
        ``num_rounds`` and 0.01 from three quarters (FedEM's and FedGMM's schedule).
    num_rounds : int (default: 1)
        Rounds of the run, for the schedule.
    min_replies : int (default: 1)
        Usable training replies a round needs; with fewer it raises ``RoundFailedError``
        (after the round is recorded).
    evaluate_every : int (default: 1)
        Evaluate the nodes every this many rounds, and always in the last
        ``final_rounds`` rounds (the final accuracy is their mean); 0 evaluates only in
        the last round.
    final_rounds : int (default: 1)
        Rounds averaged for the final accuracy.
    """

    algorithm: ClassVar[Algorithm]

    def __init__(
        self,
        *,
        num_nodes: int,
        fraction_train: float = 0.1,
        seed: int = 0,
        evaluate_nodes: bool = True,
        unseen_fraction: float = 0.0,
        adapt_fraction: float = 0.5,
        lr_schedule: str = "constant",
        num_rounds: int = 1,
        min_replies: int = 1,
        evaluate_every: int = 1,
        final_rounds: int = 1,
    ) -> None:
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=1.0 if evaluate_nodes else 0.0,
            min_train_nodes=1,
            min_evaluate_nodes=1 if evaluate_nodes else 0,
            min_available_nodes=num_nodes,
            arrayrecord_key=protocol.ARRAYS,
            configrecord_key=protocol.CONFIG,
            weighted_by_key=protocol.NUM_EXAMPLES,
        )
        self.num_nodes = num_nodes
        self.seed = seed
        self.evaluate_nodes = evaluate_nodes
        self.adapt_fraction = adapt_fraction
        self.lr_schedule = lr_schedule
        self.num_rounds = num_rounds
        self.min_replies = min_replies
        self.evaluate_every = evaluate_every
        self.final_rounds = final_rounds
        self.accepted: dict[int, int] = {}
        first_unseen = num_nodes - round(unseen_fraction * num_nodes)
        self.seen = list(range(first_unseen))
        self.unseen = list(range(first_unseen, num_nodes))
        self.shared = protocol.shared_parts(self.algorithm)
        self.node_of_partition: dict[int, int] = {}
        self.rejections: dict[int, list[str]] = {}
        self.sent_arrays: dict[str, tuple[tuple[int, ...], str]] = {}
        self.train_sizes: dict[int, int] = {}
        self.test_sizes: dict[int, int] = {}
        self.nodes_registered_at = float("nan")  # time.time() when all nodes were seen

    # ------------------------------------------------------------------ population
    def connect(self, grid: Grid, *, timeout: float, poll: float = 0.2) -> None:
        """Wait for ``num_nodes`` nodes, then learn each node's partition id."""
        deadline = time.monotonic() + timeout
        last_count = -1
        while (count := len(list(grid.get_node_ids()))) < self.num_nodes:
            if time.monotonic() > deadline:
                raise PopulationError(
                    f"only {count} of the {self.num_nodes} expected nodes registered "
                    f"within {timeout:.0f} s. In simulation pass --federation-config "
                    f'"num-supernodes={self.num_nodes}"; in deployment start that many '
                    "SuperNodes, or lower num-clients."
                )
            if count != last_count:
                logger.info("waiting for nodes: %d of %d registered", count, self.num_nodes)
                last_count = count
            time.sleep(poll)
        self.nodes_registered_at = time.time()
        node_ids = sorted(grid.get_node_ids())
        replies = self.query(grid, protocol.QUERY_INFO, node_ids, timeout=timeout)
        for node_id, reply in zip(node_ids, replies, strict=True):
            metrics = reply.content.metric_records[protocol.METRICS]
            partition = int(metrics[protocol.PARTITION_ID])  # type: ignore[arg-type]
            if partition in self.node_of_partition:
                raise PopulationError(
                    f"nodes {self.node_of_partition[partition]} and {node_id} both hold "
                    f"partition {partition}: give each SuperNode its own partition-id"
                )
            self.node_of_partition[partition] = node_id
            self.train_sizes[partition] = int(metrics[protocol.NUM_TRAIN])  # type: ignore[arg-type]
            self.test_sizes[partition] = int(metrics[protocol.NUM_TEST])  # type: ignore[arg-type]
        missing = sorted(set(range(self.num_nodes)) - set(self.node_of_partition))
        if missing:
            raise PopulationError(
                f"no node holds partition(s) {missing[:10]}; expected partitions "
                f"0..{self.num_nodes - 1} (num-partitions = num-clients = {self.num_nodes})"
            )
        logger.info("%d nodes registered, partitions 0..%d", len(node_ids), self.num_nodes - 1)

    def refresh_population(self, grid: Grid, *, timeout: float) -> None:
        """Learn the partition of nodes that registered since ``connect``.

        A SuperNode that restarts without node authentication comes back under a new
        node id; sending to the old id would time out every round. Nodes with the same
        id (authenticated restarts, simulation) need nothing.
        """
        new = sorted(set(grid.get_node_ids()) - set(self.node_of_partition.values()))
        if not new:
            return
        messages = [
            Message(content=RecordDict(), message_type=protocol.QUERY_INFO, dst_node_id=n)
            for n in new
        ]
        for reply in grid.send_and_receive(messages, timeout=timeout):
            if reply.has_error():
                continue
            metrics = reply.content.metric_records[protocol.METRICS]
            partition = int(metrics[protocol.PARTITION_ID])  # type: ignore[arg-type]
            old = self.node_of_partition.get(partition)
            self.node_of_partition[partition] = reply.metadata.src_node_id
            logger.info(
                "partition %d is now served by node %d (was %s)",
                partition,
                reply.metadata.src_node_id,
                old,
            )

    def query(
        self,
        grid: Grid,
        message_type: str,
        node_ids: list[int],
        *,
        timeout: float,
        content: RecordDict | None = None,
    ) -> list[Message]:
        """Send one query to each node; every node must answer without error."""
        messages = [
            Message(content=content or RecordDict(), message_type=message_type, dst_node_id=n)
            for n in node_ids
        ]
        replies = {
            r.metadata.src_node_id: r for r in grid.send_and_receive(messages, timeout=timeout)
        }
        failed = [
            f"node {n}: {replies[n].error.reason if n in replies else 'no reply'}"
            for n in node_ids
            if n not in replies or replies[n].has_error()
        ]
        if failed:
            raise PopulationError(
                f"{message_type} failed on {len(failed)} node(s): " + "; ".join(failed[:5])
            )
        return [replies[n] for n in node_ids]

    def initial_arrays(self, grid: Grid, *, timeout: float) -> ArrayRecord:
        """The shared parts of the seeded initial model, as built by partition 0's node.

        Every process builds the same model from the seed, so the server needs no model
        code (and no torch) to start.
        """
        if not self.shared:
            return ArrayRecord()
        (reply,) = self.query(
            grid, protocol.QUERY_INITIAL, [self.node_of_partition[0]], timeout=timeout
        )
        return reply.content.array_records[protocol.ARRAYS]

    # -------------------------------------------------------------------- sampling
    def sample(self, server_round: int) -> list[int]:
        """Partition ids trained in ``server_round`` (seeded, sorted; seen clients only)."""
        count = max(1, round(self.fraction_train * len(self.seen)))
        chosen = rng(self.seed, "sample", server_round).choice(self.seen, count, replace=False)
        return sorted(int(p) for p in chosen)

    def lr_factor(self, server_round: int) -> float:
        """Multiplier of the learning rate in ``server_round`` under the schedule."""
        if self.lr_schedule == "milestones":
            if server_round > 0.75 * self.num_rounds:
                return 0.01
            if server_round > 0.5 * self.num_rounds:
                return 0.1
        return 1.0

    def in_partition_order(self, replies: Iterable[Message]) -> list[Message]:
        """Replies sorted by partition id: aggregation sums floats in a fixed order, so
        the result does not depend on which node answered first."""
        partition_of = {node: p for p, node in self.node_of_partition.items()}
        return sorted(replies, key=lambda r: partition_of.get(r.metadata.src_node_id, -1))

    def _messages(
        self, node_ids: Iterable[int], arrays: ArrayRecord, config: ConfigRecord, kind: str
    ) -> list[Message]:
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return [Message(content=record, message_type=kind, dst_node_id=n) for n in node_ids]

    # ---------------------------------------------------------- Flower's interface
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """TRAIN to this round's sample, carrying the shared arrays and the settings."""
        config[protocol.ROUND] = server_round
        self.sent_arrays = {name: (tuple(a.shape), a.dtype) for name, a in arrays.items()}
        if protocol.LR in config:
            base_lr = float(config[protocol.LR])  # type: ignore[arg-type]
            config[protocol.LR] = base_lr * self.lr_factor(server_round)
        nodes = [self.node_of_partition[p] for p in self.sample(server_round)]
        return self._messages(nodes, arrays, config, MessageType.TRAIN)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """EVALUATE to every seen node (none when the run is evaluated on the server)."""
        if not self.evaluate_nodes:
            return []
        config[protocol.ROUND] = server_round
        nodes = [self.node_of_partition[p] for p in self.seen]
        return self._messages(nodes, arrays, config, MessageType.EVALUATE)

    def summary(self) -> None:
        """Log the strategy's configuration."""
        logger.info(
            "%s: %d nodes (%d unseen), %.0f%% trained per round (%d), shared %s, seed %d",
            type(self).__name__,
            self.num_nodes,
            len(self.unseen),
            100 * self.fraction_train,
            max(1, round(self.fraction_train * len(self.seen))),
            list(self.shared) or "none",
            self.seed,
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Weighted average (``fedpers.aggregation.weighted_mean``) of the replies that
        pass ``screen``, weighted by their ``num-examples``; None without any."""
        valid = self.screen(server_round, replies)
        if not valid:
            return None, None
        contents = [reply.content for reply in valid]
        arrays = [
            {
                k: v.numpy()
                for k, v in c.array_records.get(self.arrayrecord_key, ArrayRecord()).items()
            }
            for c in contents
        ]
        weights = [_num_examples(c) for c in contents]
        averaged = weighted_mean(arrays, weights)
        record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in averaged.items()})
        return record, self.train_metrics_aggr_fn(contents, self.weighted_by_key)

    def screen(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """Replies fit to aggregate: no error, every array and metric finite.

        A rejected reply is logged with its reason and counted in ``rejections``; it
        never reaches an average.
        """
        partition_of = {node: p for p, node in self.node_of_partition.items()}
        kept = []
        for reply in replies:
            partition = partition_of.get(reply.metadata.src_node_id, -1)
            reason = _defect(reply) or self._mismatch(reply)
            if reason is None:
                kept.append(reply)
                continue
            logger.warning(
                "round %d: left out the reply of partition %d: %s",
                server_round,
                partition,
                reason,
            )
            self.rejections.setdefault(server_round, []).append(f"partition {partition}: {reason}")
        self.accepted[server_round] = len(kept)
        return kept

    def _mismatch(self, reply: Message) -> str | None:
        """Why a reply's arrays do not fit the arrays sent this round, or None.

        Arrays the server sent must come back with the same shape and dtype; arrays it
        did not send (statistics, gammas) are the algorithm's to check.
        """
        metrics = reply.content.metric_records.get(protocol.METRICS)
        if metrics is None or protocol.NUM_EXAMPLES not in metrics:
            return f"no '{protocol.NUM_EXAMPLES}' metric"
        if float(metrics[protocol.NUM_EXAMPLES]) < 0:  # type: ignore[arg-type]
            return "negative number of examples"
        returned = reply.content.array_records.get(self.arrayrecord_key, ArrayRecord())
        for name, sent in self.sent_arrays.items():
            if name not in returned:
                continue
            value = returned[name]
            if tuple(value.shape) != sent[0] or value.dtype != sent[1]:
                return (
                    f"array '{name}' is {value.dtype}{list(value.shape)}, "
                    f"expected {sent[1]}{list(sent[0])}"
                )
        if self.shared and set(returned) < set(self.sent_arrays):
            missing = sorted(set(self.sent_arrays) - set(returned))[:3]
            return f"arrays missing from the reply: {missing}"
        return None

    # ------------------------------------------------------------------ round loop
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
        *,
        first_round: int = 1,
        on_round: Callable[[RoundRecord], None] | None = None,
        on_checkpoint: Callable[[int, ArrayRecord], None] | None = None,
    ) -> Result:
        """Flower's round loop (train, aggregate, evaluate), reporting every round.

        Same contract as ``flwr.serverapp.strategy.Strategy.start``, plus: ``first_round``
        (a resumed run starts after its checkpoint with ``initial_arrays`` from it),
        ``on_round`` (called with each round's ``RoundRecord``) and ``on_checkpoint``
        (called with the round and the global arrays after it, to save them).

        Raises
        ------
        RoundFailedError
            When a round has fewer usable training replies than ``min_replies``.
        """
        self.summary()
        result = Result()
        arrays = initial_arrays
        result.arrays = arrays
        if (
            evaluate_fn is not None
            and (metrics := evaluate_fn(first_round - 1, arrays)) is not None
        ):
            result.evaluate_metrics_serverapp[first_round - 1] = metrics
        for server_round in range(first_round, num_rounds + 1):
            started = time.monotonic()
            self.refresh_population(grid, timeout=timeout)
            messages = list(
                self.configure_train(
                    server_round, arrays, ConfigRecord(dict(train_config or {})), grid
                )
            )
            replies = self.in_partition_order(grid.send_and_receive(messages, timeout=timeout))
            self._note_missing(server_round, messages, replies, timeout)
            self.accepted[server_round] = sum(not r.has_error() for r in replies)
            new_arrays, train_metrics = self.aggregate_train(server_round, replies)
            if new_arrays is not None:
                arrays = new_arrays
                result.arrays = arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[server_round] = train_metrics
            trained = time.monotonic()
            evaluate_metrics, evaluated = None, 0
            if self._evaluates(server_round, num_rounds):
                evaluate_messages = list(
                    self.configure_evaluate(
                        server_round, arrays, ConfigRecord(dict(evaluate_config or {})), grid
                    )
                )
                if evaluate_messages:
                    evaluate_replies = self.in_partition_order(
                        grid.send_and_receive(evaluate_messages, timeout=timeout)
                    )
                    evaluated = sum(not r.has_error() for r in evaluate_replies)
                    evaluate_metrics = self.aggregate_evaluate(server_round, evaluate_replies)
            if evaluate_metrics is not None:
                result.evaluate_metrics_clientapp[server_round] = evaluate_metrics
            server_metrics = evaluate_fn(server_round, arrays) if evaluate_fn else None
            if server_metrics is not None:
                result.evaluate_metrics_serverapp[server_round] = server_metrics
            accepted = self.accepted.get(server_round, 0)
            record = RoundRecord(
                round=server_round,
                seconds=time.monotonic() - started,
                train=_plain(train_metrics),
                evaluate=_plain(evaluate_metrics),
                server={**_plain(server_metrics), **self.round_metrics(server_round)},
                sampled=len(messages),
                replies=accepted,
                failures=len(messages) - accepted,
                evaluated=evaluated,
                rejections=list(self.rejections.get(server_round, [])),
                train_seconds=trained - started,
                evaluate_seconds=time.monotonic() - trained,
            )
            if on_round is not None:
                on_round(record)
            if messages and accepted < self.min_replies:
                raise RoundFailedError(
                    f"round {server_round}: {accepted} usable replies of {len(messages)}, "
                    f"fewer than min-replies = {self.min_replies}; "
                    + "; ".join(record.rejections[:5])
                )
            if on_checkpoint is not None:
                on_checkpoint(server_round, arrays)
        return result

    def _evaluates(self, server_round: int, num_rounds: int) -> bool:
        if server_round == num_rounds:
            return True
        if self.evaluate_every == 0:
            return False
        return (
            server_round % self.evaluate_every == 0 or server_round > num_rounds - self.final_rounds
        )

    def _note_missing(
        self, server_round: int, messages: list[Message], replies: list[Message], timeout: float
    ) -> None:
        """Record every sampled node that did not answer within the round's timeout."""
        answered = {r.metadata.src_node_id for r in replies}
        partition_of = {node: p for p, node in self.node_of_partition.items()}
        for message in messages:
            node = message.metadata.dst_node_id
            if node not in answered:
                reason = f"partition {partition_of.get(node, -1)}: no reply within {timeout:g} s"
                logger.warning("round %d: %s", server_round, reason)
                self.rejections.setdefault(server_round, []).append(reason)

    def round_metrics(self, server_round: int) -> dict[str, float]:
        """Server-side figures of a round for ``rounds.jsonl`` (none by default)."""
        return {}

    def final_evaluation(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        config: ConfigRecord,
        *,
        server_round: int,
        timeout: float,
    ) -> tuple[str, MetricRecord] | None:
        """An evaluation after the last round: ``("unseen", metrics)`` of the unseen
        clients, each adapting on part of its data first; None without unseen clients.
        (FedAvg+FT overrides it with its fine-tuned evaluation.)"""
        if not self.unseen:
            return None
        config = ConfigRecord(dict(config))
        config[protocol.ROUND] = server_round
        config[protocol.UNSEEN] = 1
        config[protocol.ADAPT_FRACTION] = self.adapt_fraction
        nodes = [self.node_of_partition[p] for p in self.unseen]
        messages = self._messages(nodes, arrays, config, MessageType.EVALUATE)
        replies = self.in_partition_order(grid.send_and_receive(messages, timeout=timeout))
        metrics = self.aggregate_evaluate(server_round, replies)
        return None if metrics is None else ("unseen", metrics)


def _num_examples(content: RecordDict) -> float:
    value = content.metric_records[protocol.METRICS][protocol.NUM_EXAMPLES]
    return float(value)  # type: ignore[arg-type]


def _defect(reply: Message) -> str | None:
    """Why a reply cannot be aggregated, or None."""
    if reply.has_error():
        return f"client error: {reply.error.reason}"
    for name, arrays in reply.content.array_records.items():
        for key, array in arrays.items():
            values = array.numpy()
            if np.issubdtype(values.dtype, np.number) and not np.all(np.isfinite(values)):
                return f"non-finite values in array '{name}/{key}'"
    for metrics in reply.content.metric_records.values():
        for key, value in metrics.items():
            if isinstance(value, float) and not np.isfinite(value):
                return f"non-finite metric '{key}'"
    return None


def _plain(metrics: MetricRecord | None) -> dict[str, float]:
    if metrics is None:
        return {}
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
