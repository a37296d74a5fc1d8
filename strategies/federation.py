"""The federation as the server sees it: which node holds which partition, and one way
to exchange messages with them.

Flower names nodes by random ids and starts the ServerApp before every virtual node is
up. fedpers addresses clients by partition id instead (sampling, seeding and result
order depend on it), so the server waits for the expected population, asks each node
which partition it holds (``query.info``) and keeps the map both ways. Every exchange
(training, evaluation, start-up queries, the Sheaf-FRL relay) goes through
``Federation.send`` (the messages a strategy's ``configure_*`` built) or
``Federation.exchange`` (contents by partition): one send-and-collect with one failure
policy, answers in partition order and every missing or failed answer named with its
reason.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from flwr.app import Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedpers import protocol
from fedpers.logs import one_line
from fedpers.strategies import screening

logger = logging.getLogger(__name__)


class PopulationError(RuntimeError):
    """The nodes that registered do not form the federation the run expects."""


@dataclass
class Exchange:
    """The outcome of one exchange: answers and failures, both keyed by partition.

    ``sent`` lists the partitions messaged, ``replies`` holds every answer that arrived
    (error replies included) in partition order; ``failures`` the partitions whose
    answer is missing or an error, with why.
    """

    sent: list[int]
    replies: dict[int, Message] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)

    def ok(self) -> dict[int, RecordDict]:
        """Contents of the answers without error, by partition."""
        return {p: r.content for p, r in self.replies.items() if not r.has_error()}


class Federation:
    """Registration of the expected nodes and the partition <-> node map.

    Parameters
    ----------
    num_nodes : int
        Partitions ``0..num_nodes-1`` the run expects, one node each.
    weight_cap : float
        The largest weight of one reply, in multiples of the lower median of the sizes
        the nodes registered (``weight_bound``; run-config ``weight-cap``).
    """

    def __init__(self, num_nodes: int, *, weight_cap: float = math.inf) -> None:
        self.num_nodes = num_nodes
        self.weight_cap = weight_cap
        self.node_of_partition: dict[int, int] = {}
        self.partition_of_node: dict[int, int] = {}
        self.train_sizes: dict[int, int] = {}
        self.test_sizes: dict[int, int] = {}
        self.registered_at = float("nan")  # time.time() when all nodes were seen
        self.missed: set[int] = set()  # partitions whose node missed its last message
        self.claims: dict[int, int] = {}  # node -> partition it claims, not yet granted
        self._notes: list[str] = []

    # ------------------------------------------------------------------ population
    def connect(
        self,
        grid: Grid,
        *,
        timeout: float,
        poll: float = 0.2,
        settled: float | None = None,
    ) -> None:
        """Wait for ``num_nodes`` nodes, then learn each node's partition id.

        ``settled`` (a simulation, whose virtual nodes all register before the
        ServerApp starts): fail once the count has not changed for that many seconds,
        instead of waiting ``timeout`` for nodes that cannot come.
        """
        started = time.monotonic()
        deadline = started + timeout
        last_count, changed = -1, started
        while (count := len(list(grid.get_node_ids()))) < self.num_nodes:
            now = time.monotonic()
            if count != last_count:
                logger.info("waiting for nodes: %d of %d registered", count, self.num_nodes)
                last_count, changed = count, now
            if settled is not None and now - changed > settled:
                raise PopulationError(
                    f"this simulation has {count} virtual nodes and num-clients = "
                    f"{self.num_nodes} needs one per client. Run with --federation-config "
                    f'"num-supernodes={self.num_nodes}", or with --run-config '
                    f'"num-clients={count}"; the scripts in simulations/ size it for you.'
                )
            if now > deadline:
                raise PopulationError(
                    f"only {count} of the {self.num_nodes} expected nodes registered "
                    f"within {timeout:.0f} s. In simulation pass --federation-config "
                    f'"num-supernodes={self.num_nodes}"; in deployment start that many '
                    "SuperNodes, or lower num-clients."
                )
            time.sleep(poll)
        self.registered_at = time.time()
        node_ids = sorted(grid.get_node_ids())
        for node_id, reply in self._info(grid, node_ids, timeout=timeout, strict=True):
            partition, train, test = _info_metrics(reply)
            if partition in self.node_of_partition:
                raise PopulationError(
                    f"nodes {self.node_of_partition[partition]} and {node_id} both hold "
                    f"partition {partition}: give each SuperNode its own partition-id"
                )
            self._assign(partition, node_id)
            self.train_sizes[partition] = train
            self.test_sizes[partition] = test
        missing = sorted(set(range(self.num_nodes)) - set(self.node_of_partition))
        if missing:
            raise PopulationError(
                f"no node holds partition(s) {missing[:10]}; expected partitions "
                f"0..{self.num_nodes - 1} (num-partitions = num-clients = {self.num_nodes})"
            )
        logger.info(
            "%d nodes registered, partitions 0..%d, %d training and %d test samples in all",
            len(node_ids),
            self.num_nodes - 1,
            sum(self.train_sizes.values()),
            sum(self.test_sizes.values()),
        )

    def weight_bounds(self, partitions: Iterable[int], *, test: bool = False) -> dict[int, float]:
        """The most a reply of each of ``partitions`` may weigh: the training (``test``:
        test) samples its node registered, and at most ``weight_cap`` times the lower
        median of what all nodes registered.

        The node's own claim alone bounds nothing (it may claim 1e12 samples). The lower
        median (the ``(n+1)//2``-th smallest) is set by the honest nodes while they are
        a majority, so no minority can raise it; at least 1, so that a federation whose
        nodes mostly hold nothing still counts the others. Without registered sizes (a
        strategy used without ``connect``) nothing is bounded.
        """
        sizes = self.test_sizes if test else self.train_sizes
        if not sizes:
            return dict.fromkeys(partitions, math.inf)
        typical = max(1.0, float(screening.lower_median(sizes.values())))
        cap = self.weight_cap * typical
        return {p: min(sizes.get(p, math.inf), cap) for p in partitions}

    def refresh(self, grid: Grid, *, timeout: float) -> None:
        """Learn the partition of nodes that registered since ``connect``, and let one
        take its partition over only under the takeover rule.

        A SuperNode that restarts without node authentication comes back under a new
        node id; sending to the old id would time out every round. Nodes with the same
        id (authenticated restarts, simulation) need nothing. The rule: a new node takes
        a partition over only when the partition's node is gone (no longer registered)
        or missed its last message (no reply, or an error). A node that claims the
        partition of a node that still answers is ignored, with a note
        (``take_notes``), and asked again at the next refresh.
        """
        current = set(grid.get_node_ids())
        new = sorted(current - set(self.partition_of_node) - set(self.claims))
        for node_id, reply in self._info(grid, new, timeout=timeout, strict=False):
            self.claims[node_id], _, _ = _info_metrics(reply)
        for node_id, partition in sorted(self.claims.items()):
            old = self.node_of_partition.get(partition)
            if node_id not in current:
                del self.claims[node_id]
            elif old is None or old not in current or partition in self.missed:
                del self.claims[node_id]
                self._assign(partition, node_id)
                self.missed.discard(partition)
                logger.info(
                    "partition %d is now served by node %d (was %s)", partition, node_id, old
                )
            else:
                note = (
                    f"partition {partition}: node {node_id} claims it while node {old} still "
                    "answers; ignored (a partition changes node only after its node missed "
                    "a message)"
                )
                logger.warning("%s", note)
                self._notes.append(note)

    def take_notes(self) -> list[str]:
        """What ``refresh`` refused since the last call, for the round's rejections."""
        notes, self._notes = self._notes, []
        return notes

    def _assign(self, partition: int, node_id: int) -> None:
        old = self.node_of_partition.get(partition)
        if old is not None:
            self.partition_of_node.pop(old, None)
        self.node_of_partition[partition] = node_id
        self.partition_of_node[node_id] = partition

    def _info(
        self, grid: Grid, node_ids: list[int], *, timeout: float, strict: bool
    ) -> list[tuple[int, Message]]:
        """``query.info`` to nodes not yet mapped; (node id, reply) of those that answered
        (all of them, or PopulationError, when ``strict``)."""
        if not node_ids:
            return []
        messages = [
            Message(content=RecordDict(), message_type=protocol.QUERY_INFO, dst_node_id=n)
            for n in node_ids
        ]
        by_node = {r.metadata.src_node_id: r for r in send_and_collect(grid, messages, timeout)}
        answered, failed = [], []
        for node in node_ids:
            reply = by_node.get(node)
            if reply is None or reply.has_error():
                failed.append(
                    f"node {node}: {one_line(reply.error.reason) if reply else 'no reply'}"
                )
                continue
            try:
                partition, _, _ = _info_metrics(reply)
            except ValueError as error:
                failed.append(f"node {node}: {error}")
                continue
            if partition >= self.num_nodes:
                failed.append(f"node {node}: partition {partition} >= {self.num_nodes}")
                continue
            answered.append((node, reply))
        if failed and strict:
            raise PopulationError(
                f"{protocol.QUERY_INFO} failed on {len(failed)} node(s): " + "; ".join(failed[:5])
            )
        for reason in failed:
            logger.warning("%s ignored: %s", protocol.QUERY_INFO, reason)
        return answered

    # -------------------------------------------------------------------- exchange
    def nodes(self, partitions: Iterable[int]) -> list[int]:
        """Node ids of ``partitions``."""
        return [self.node_of_partition[p] for p in partitions]

    def partition(self, reply: Message) -> int:
        """The partition of a reply's sender (-1 for a node the map does not know)."""
        return self.partition_of_node.get(reply.metadata.src_node_id, -1)

    def messages(self, message_type: str, contents: Mapping[int, RecordDict]) -> list[Message]:
        """One message per partition of ``contents``, addressed to the node that holds it,
        in partition order."""
        partitions = sorted(contents)
        return [
            Message(content=contents[p], message_type=message_type, dst_node_id=n)
            for p, n in zip(partitions, self.nodes(partitions), strict=True)
        ]

    def send(self, grid: Grid, messages: Iterable[Message], *, timeout: float) -> Exchange:
        """Send ``messages`` (at most one per node) and collect the answers by partition.

        What Flower's ``Strategy.start`` does with ``grid.send_and_receive``, with the
        answers keyed by the partition of their node, pushed in partition order.

        Raises
        ------
        ValueError
            If a message goes to a node that holds no partition of the run, or two go
            to one node.
        """
        by_partition: dict[int, Message] = {}
        for message in messages:
            node = message.metadata.dst_node_id
            partition = self.partition_of_node.get(node)
            if partition is None:
                raise ValueError(f"a message to node {node}, which holds no partition of the run")
            if partition in by_partition:
                raise ValueError(f"two messages to node {node} (partition {partition}) at once")
            by_partition[partition] = message
        partitions = sorted(by_partition)
        result = Exchange(partitions)
        registered = set(grid.get_node_ids())  # the SuperLink drops a message to another
        outgoing = [
            m for p in partitions if (m := by_partition[p]).metadata.dst_node_id in registered
        ]
        by_node = {r.metadata.src_node_id: r for r in send_and_collect(grid, outgoing, timeout)}
        for partition, node in zip(partitions, self.nodes(partitions), strict=True):
            reply = by_node.get(node)
            self.missed.add(partition)
            if node not in registered:
                result.failures[partition] = f"node {node} is no longer registered"
                continue
            if reply is None:
                result.failures[partition] = f"no reply within {timeout:g} s"
                continue
            result.replies[partition] = reply
            if reply.has_error():
                result.failures[partition] = f"client error: {one_line(reply.error.reason)}"
            else:
                self.missed.discard(partition)
        return result

    def exchange(
        self,
        grid: Grid,
        message_type: str,
        contents: Mapping[int, RecordDict],
        *,
        timeout: float,
    ) -> Exchange:
        """Send each partition its own content and collect the answers (``messages``,
        then ``send``).

        Parameters
        ----------
        grid : Grid
            Flower's grid.
        message_type : str
            ``MessageType.TRAIN``/``EVALUATE`` or a ``protocol.query_type``.
        contents : mapping of int to RecordDict
            What each partition receives.
        timeout : float
            Seconds to wait for the answers.
        """
        return self.send(grid, self.messages(message_type, contents), timeout=timeout)

    def broadcast(
        self,
        grid: Grid,
        message_type: str,
        partitions: Iterable[int],
        content: RecordDict,
        *,
        timeout: float,
    ) -> Exchange:
        """``exchange`` with the same content for every partition."""
        return self.exchange(
            grid, message_type, dict.fromkeys(partitions, content), timeout=timeout
        )


PULL_INTERVAL = 0.1  # seconds: the shortest wait between two pulls
PULL_SHARE = 0.1  # the most of an exchange's time spent pulling (see send_and_collect)


EXPIRY_GRACE = 2.0  # seconds a message outlives its exchange


def expire_with_the_round(messages: Iterable[Message], timeout: float) -> None:
    """Let each message live as long as the round waits for it, and no longer.

    Flower gives a message a 12-hour TTL by default. A node that was away when its round
    ended (a cut link: the SuperNode reconnects by itself) then fetched that round's
    message when it came back, trained on it and replied to a round that was over: the
    reply was dropped, but the device's personal state had taken the step (seen in every
    run of tests/deployment/test_network.py). With the TTL ending when the round stops
    waiting, the SuperLink no longer hands it out (its ``get_message_ins`` skips expired
    messages), in deployment and in simulation alike."""
    if not math.isfinite(timeout):
        return
    now = time.time()
    for message in messages:
        # EXPIRY_GRACE: a reply that arrived just before the deadline is still alive at
        # the last pull (the SuperLink answers an expired reply with an error)
        alive = now - message.metadata.created_at + timeout + EXPIRY_GRACE
        message.metadata.ttl = min(message.metadata.ttl, alive)


def send_and_collect(grid: Grid, messages: list[Message], timeout: float) -> list[Message]:
    """Flower's ``grid.send_and_receive``, with a pull interval that follows the pull's cost.

    Flower's in-memory grid pulls every 0.1 s, and each pull checks every outstanding
    message id under the LinkState's lock: in a 10,000-node simulation py-spy found the
    ServerApp's thread busy 38% of the time (about 60 ms a pull between 0.1 s sleeps),
    holding the lock and the GIL that the threads feeding the ClientApps need. The
    deployed grid waits a fixed 3 s between pulls, however few are missing. Here the
    wait after a pull is ``(1 - PULL_SHARE) / PULL_SHARE`` times the processor time it
    took, at least ``PULL_INTERVAL``: pulling costs at most ``PULL_SHARE`` of the time,
    and a reply is seen at most one interval after it arrives. Processor time, not wall
    time: a deployed pull that waited for a reply's objects (Flower's backoff) spent
    nothing, and a wall-clock measure made the next wait nine times that wait (18-20 s
    gaps in the deployed digits run). Same results as ``send_and_receive``: every reply
    that arrives before ``timeout`` seconds; a message is not handed out after them
    (``expire_with_the_round``).
    """
    expire_with_the_round(messages, timeout)
    outstanding = set(grid.push_messages(messages))
    replies: list[Message] = []
    deadline = time.monotonic() + timeout
    while outstanding:
        started = time.thread_time()
        pulled = list(grid.pull_messages(outstanding))
        spent = time.thread_time() - started
        replies.extend(pulled)
        outstanding.difference_update(r.metadata.reply_to_message_id for r in pulled)
        left = deadline - time.monotonic()
        if not outstanding or left <= 0:
            break
        time.sleep(min(left, max(PULL_INTERVAL, spent * (1 - PULL_SHARE) / PULL_SHARE)))
    return replies


def _info_metrics(reply: Message) -> tuple[int, int, int]:
    """Partition id, training and test samples of a ``query.info`` reply.

    Raises
    ------
    ValueError
        If any is missing or not a non-negative whole number.
    """
    metrics = reply.content.metric_records.get(protocol.METRICS) or MetricRecord()
    values = []
    for key in (protocol.PARTITION_ID, protocol.NUM_TRAIN, protocol.NUM_TEST):
        value = metrics.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"'{key}' is {type(value).__name__}, not a number")
        if not (math.isfinite(value) and value >= 0 and float(value).is_integer()):
            raise ValueError(f"'{key}' = {value} is not a non-negative whole number")
        values.append(int(value))
    return values[0], values[1], values[2]
