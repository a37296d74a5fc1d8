"""Peer relay for Sheaf-FRL (2026): the server holds no model and only relays pilots.

Each round it gathers every agent's pilot matrix (``query.pilots``) and sends each agent
exactly its graph neighbours' matrices with ``train``; agents refit their incident
restriction maps and train locally. It never sees a model parameter. Variants (run-config
key ``sheaf-variant``):

- ``heterogeneous`` (default): raw whitened pilots go to neighbours and both endpoints of
  an edge compute its map (from the same two matrices, hence the same map);
- ``homogeneous`` (equal latent dimensions): the edge's source computes its one SVD
  (``query.maps``) and its pilots travel already transported to the target;
- ``private`` (equal latent dimensions): agents only send pilots transported into each
  neighbour's coordinates with their current maps (``query.transport``); the relay
  never sees an agent's own coordinates.

``non-cooperative`` (lambda = 0) exchanges nothing while training. After the last round
``final_evaluation`` measures communication accuracy: every agent's whitened test
latents go to its neighbours, which transport them with the Procrustes map fitted on the
same pilots and decode them with their own heads. Bytes are counted from the arrays of
every training exchange.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

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

from fedpers import protocol, sheaf
from fedpers.protocol import Algorithm
from strategies.base import FedpersStrategy

logger = logging.getLogger(__name__)


class PeerRelay(FedpersStrategy):
    """Relay pilots between graph neighbours; every agent trains every round.

    Parameters
    ----------
    edges : list of (int, int)
        The oriented communication graph (agents are partition ids).
    variant : str (default: "heterogeneous")
        ``heterogeneous``, ``homogeneous`` or ``private`` (see the module docstring).
    cooperative : bool (default: True)
        False for the lambda = 0 baseline: no pilots are exchanged while training.
    whitening_modes : tuple of str (default: ("pilots",))
        Whitenings under which communication accuracy is measured at the end:
        ``pilots`` (Sheaf-FRL's) and/or ``train`` (the paper's baseline).
    **kwargs
        As for ``FedpersStrategy``.
    """

    algorithm = Algorithm.SHEAF_FRL

    def __init__(
        self,
        *,
        edges: list[tuple[int, int]],
        variant: str = "heterogeneous",
        cooperative: bool = True,
        whitening_modes: tuple[str, ...] = ("pilots",),
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.edges = edges
        self.variant = variant
        self.cooperative = cooperative
        self.whitening_modes = whitening_modes
        self.neighbours = {i: sheaf.neighbours(edges, i) for i in range(self.num_nodes)}
        self.bytes_sent: dict[int, int] = {}
        self.private_accuracy: dict[int, float] = {}
        self.timeout = 600.0

    def sample(self, server_round: int) -> list[int]:
        """Every agent, every round."""
        return list(range(self.num_nodes))

    # --------------------------------------------------------------- exchanges
    def _exchange(
        self,
        grid: Grid,
        message_type: str,
        contents: dict[int, RecordDict],
        server_round: int,
    ) -> dict[int, ArrayRecord]:
        """Send each agent its content, return each agent's reply arrays; count bytes."""
        replies = self.query_each(grid, message_type, contents, timeout=self.timeout)
        for record in [*contents.values(), *(r for r in replies.values())]:
            for arrays in record.array_records.values():
                self._count(server_round, arrays.count_bytes())
        return {p: r.array_records.get(protocol.ARRAYS, ArrayRecord()) for p, r in replies.items()}

    def query_each(
        self, grid: Grid, message_type: str, contents: dict[int, RecordDict], *, timeout: float
    ) -> dict[int, RecordDict]:
        """One query per agent with its own content; every agent must answer."""
        partitions = sorted(contents)
        nodes = [self.node_of_partition[p] for p in partitions]
        messages = [
            Message(content=contents[p], message_type=message_type, dst_node_id=n)
            for p, n in zip(partitions, nodes, strict=True)
        ]
        by_node = {
            r.metadata.src_node_id: r for r in grid.send_and_receive(messages, timeout=timeout)
        }
        failed = [
            p
            for p, n in zip(partitions, nodes, strict=True)
            if n not in by_node or by_node[n].has_error()
        ]
        if failed:
            reasons = [
                by_node[self.node_of_partition[p]].error.reason
                if self.node_of_partition[p] in by_node
                else "no reply"
                for p in failed
            ]
            raise RuntimeError(f"{message_type} failed for agents {failed}: {reasons[:3]}")
        return {p: by_node[n].content for p, n in zip(partitions, nodes, strict=True)}

    def _count(self, server_round: int, count: int) -> None:
        self.bytes_sent[server_round] = self.bytes_sent.get(server_round, 0) + count

    # ------------------------------------------------------------ Flower hooks
    def initial_arrays(self, grid: Grid, *, timeout: float) -> ArrayRecord:
        """No model is shared: the global arrays stay empty."""
        self.timeout = timeout
        return ArrayRecord()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Gather and relay pilots (as the variant says), then TRAIN every agent."""
        config[protocol.ROUND] = server_round
        relayed = self._relay(server_round, config, grid) if self.cooperative else {}
        messages = []
        for agent in range(self.num_nodes):
            record = ArrayRecord(relayed.get(agent, {}))
            self._count(server_round, record.count_bytes())
            content = RecordDict(
                {protocol.ARRAYS: record, protocol.CONFIG: ConfigRecord(dict(config))}
            )
            messages.append(
                Message(
                    content=content,
                    message_type=MessageType.TRAIN,
                    dst_node_id=self.node_of_partition[agent],
                )
            )
        return messages

    def _relay(
        self, server_round: int, config: ConfigRecord, grid: Grid
    ) -> dict[int, dict[str, Array]]:
        """What each agent receives with its TRAIN message."""
        everyone = range(self.num_nodes)
        empty = {p: RecordDict({protocol.CONFIG: ConfigRecord(dict(config))}) for p in everyone}
        if self.variant == "heterogeneous":
            pilots = self._exchange(grid, protocol.QUERY_PILOTS, empty, server_round)
            return {
                i: {
                    protocol.from_agent(protocol.PILOTS, j): pilots[j][protocol.PILOTS]
                    for j in self.neighbours[i]
                }
                for i in everyone
            }
        if self.variant == "homogeneous":
            targets = sorted({b for _, b in self.edges})
            pilots = self._exchange(
                grid, protocol.QUERY_PILOTS, {p: empty[p] for p in targets}, server_round
            )
            owners = sorted({a for a, _ in self.edges})
            owned = {
                a: RecordDict(
                    {
                        protocol.ARRAYS: ArrayRecord(
                            {
                                protocol.from_agent(protocol.PILOTS, b): pilots[b][protocol.PILOTS]
                                for x, b in self.edges
                                if x == a
                            }
                        )
                    }
                )
                for a in owners
            }
            transported = self._exchange(grid, protocol.QUERY_MAPS, owned, server_round)
            out: dict[int, dict[str, Array]] = {i: {} for i in everyone}
            for a, b in self.edges:
                for kind in (protocol.TRANSPORTED, protocol.MAP):
                    out[b][protocol.from_agent(kind, a)] = transported[a][
                        protocol.from_agent(kind, b)
                    ]
            return out
        # private: each agent sends its pilots transported into each neighbour's frame
        contents = {
            p: RecordDict(
                {protocol.CONFIG: ConfigRecord({"neighbours": self.neighbours[p] or [-1]})}
            )
            for p in everyone
        }
        transported = self._exchange(grid, protocol.QUERY_TRANSPORT, contents, server_round)
        return {
            j: {
                protocol.from_agent(protocol.TRANSPORTED, i): transported[i][
                    protocol.from_agent(protocol.TRANSPORTED, j)
                ]
                for i in self.neighbours[j]
            }
            for j in everyone
        }

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Nothing to aggregate but metrics (agents return no arrays)."""
        valid = self.screen(server_round, replies)
        for reply in valid:
            for arrays in reply.content.array_records.values():
                self._count(server_round, arrays.count_bytes())
        if not valid:
            return None, None
        return None, self.train_metrics_aggr_fn([r.content for r in valid], self.weighted_by_key)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Mean private accuracy over agents (each reply weighs 1); keeps per-agent values."""
        replies = list(replies)
        partition_of = {n: p for p, n in self.node_of_partition.items()}
        for reply in replies:
            if not reply.has_error():
                accuracy = reply.content.metric_records[protocol.METRICS][protocol.ACCURACY]
                self.private_accuracy[partition_of[reply.metadata.src_node_id]] = float(accuracy)  # type: ignore[arg-type]
        return super().aggregate_evaluate(server_round, replies)

    def round_metrics(self, server_round: int) -> dict[str, float]:
        """Bytes of the round's training exchanges (both directions)."""
        return {"bytes": float(self.bytes_sent.get(server_round, 0))}

    # -------------------------------------------------------------- final test
    def final_evaluation(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        config: ConfigRecord,
        *,
        server_round: int,
        timeout: float,
    ) -> tuple[str, MetricRecord] | None:
        """Communication accuracy of every directed edge, per whitening mode."""
        metrics: dict[str, float] = {}
        for agent, accuracy in self.private_accuracy.items():
            metrics[f"private.{agent}"] = accuracy
        for mode in self.whitening_modes:
            mode_config = ConfigRecord({protocol.WHITENING: mode, protocol.ROUND: server_round})
            ask = {p: RecordDict({protocol.CONFIG: mode_config}) for p in range(self.num_nodes)}
            shared = self.query_each(grid, protocol.QUERY_LATENTS, ask, timeout=timeout)
            tests = {}
            for receiver in range(self.num_nodes):
                relayed = {}
                for sender in self.neighbours[receiver]:
                    sent = shared[sender].array_records[protocol.ARRAYS]
                    for name in (protocol.PILOTS, protocol.LATENTS, protocol.LABELS):
                        relayed[protocol.from_agent(name, sender)] = sent[name]
                config_record = ConfigRecord(
                    {
                        protocol.WHITENING: mode,
                        protocol.COMMUNICATION: 1,
                        protocol.ROUND: server_round,
                    }
                )
                tests[receiver] = RecordDict(
                    {protocol.ARRAYS: ArrayRecord(relayed), protocol.CONFIG: config_record}
                )
            results = self._evaluate_each(grid, tests, timeout=timeout)
            per_receiver = []
            for receiver, values in results.items():
                for key, value in values.items():
                    if key.startswith("edge."):
                        metrics[f"{mode}.{key.split('.', 1)[1]}->{receiver}"] = float(value)  # type: ignore[arg-type]
                if np.isfinite(float(values[protocol.ACCURACY])):  # type: ignore[arg-type]
                    per_receiver.append(float(values[protocol.ACCURACY]))  # type: ignore[arg-type]
            metrics[f"communication.{mode}"] = (
                float(np.mean(per_receiver)) if per_receiver else float("nan")
            )
        return "communication", MetricRecord(metrics)  # type: ignore[arg-type]

    def _evaluate_each(
        self, grid: Grid, contents: dict[int, RecordDict], *, timeout: float
    ) -> dict[int, MetricRecord]:
        partitions = sorted(contents)
        messages = [
            Message(
                content=contents[p],
                message_type=MessageType.EVALUATE,
                dst_node_id=self.node_of_partition[p],
            )
            for p in partitions
        ]
        by_node = {
            r.metadata.src_node_id: r for r in grid.send_and_receive(messages, timeout=timeout)
        }
        out = {}
        for p in partitions:
            reply = by_node.get(self.node_of_partition[p])
            if reply is None or reply.has_error():
                logger.warning(
                    "communication test of agent %d failed: %s",
                    p,
                    reply.error.reason if reply else "no reply",
                )
                continue
            out[p] = reply.content.metric_records[protocol.METRICS]
        return out
