"""The batched engine: a Grid whose nodes' TRAIN and EVALUATE messages train as cohorts.

The ServerApp and its strategy are unchanged: they push a round's messages through
Flower's Grid interface as on any engine. ``BatchedGrid`` groups the messages of one
push by type, run and settings and hands each group, in chunks of ``cohort_size``, to
the ClientApp's cohort handlers (``clients.client_app.train_cohort`` and
``evaluate_cohort``): one computation for the whole chunk (``fedpers.training``), with
everything a device does per message (its state, its fault injection, its privacy
mechanism, its reply). Other messages (the start-up and families' queries) run one at
a time through the ClientApp, as on ``InProcessGrid``.

A client's result does not depend on its cohort: ``cohort_size = 1`` is the per-client
path, and the equality tests compare the two (tests/simulations/test_batched.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import Context, Error, Message, MessageType, RecordDict

from fedpers.clients import client_app
from fedpers.simulations.inprocess import InProcessGrid

COHORT_SIZE = 1024  # clients of one computation: memory grows with it, speed saturates


class BatchedGrid(InProcessGrid):
    """A ``Grid`` of in-process nodes whose TRAIN and EVALUATE messages run as cohorts.

    Parameters
    ----------
    run_config : Mapping
        The run config every node sees (one shared copy).
    num_nodes : int
        Nodes with partition ids ``0..num_nodes-1`` (node ids scrambled).
    cohort_size : int (default: COHORT_SIZE)
        The most clients of one computation (1: every client alone, the per-client path).
    threads : int, optional
        Torch threads of the computations (default: as torch has them).
    dtype : str, optional
        ``"float64"`` to compute in double precision (the equality tests).
    fail : callable, optional
        As ``InProcessGrid``'s: ``(node, message) -> reason``.
    """

    def __init__(
        self,
        run_config: Mapping[str, Any],
        num_nodes: int,
        *,
        cohort_size: int = COHORT_SIZE,
        threads: int | None = None,
        dtype: str | None = None,
        fail: Callable[[int, Message], str | None] | None = None,
    ) -> None:
        super().__init__(client_app.app, run_config, 0, fail=fail)
        shared = dict(run_config)  # one copy for every node: 100,000 nodes hold no copies
        self.contexts = {
            self.node_of(p): Context(
                run_id=1,
                node_id=self.node_of(p),
                node_config={"partition-id": p, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=shared,
            )
            for p in range(num_nodes)
        }
        if cohort_size < 1:
            raise ValueError(f"cohort_size {cohort_size}: at least 1")
        self.cohort_size = cohort_size
        if threads is None:
            import torch

            threads = torch.get_num_threads()
        self.threads = threads
        self.dtype = dtype

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Run the messages now, TRAIN and EVALUATE as cohorts; replies wait for
        ``pull_messages``."""
        ids = []
        cohorts: dict[str, list[Message]] = {MessageType.TRAIN: [], MessageType.EVALUATE: []}
        single = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.sent.append(message)
            ids.append(message.metadata.message_id)
            reason = self.fail(message.metadata.dst_node_id, message) if self.fail else None
            if reason == self.DROP:
                continue
            if reason is not None:
                self.pending[message.metadata.message_id] = _error(message, reason)
            elif message.metadata.message_type in cohorts:
                cohorts[message.metadata.message_type].append(message)
            else:
                single.append(message)
        for message in single:
            self._reply_alone(message)
        handlers = {
            MessageType.TRAIN: client_app.train_cohort,
            MessageType.EVALUATE: client_app.evaluate_cohort,
        }
        for kind, batch in cohorts.items():
            for start in range(0, len(batch), self.cohort_size):
                chunk = batch[start : start + self.cohort_size]
                pairs = [(m, self.contexts[m.metadata.dst_node_id]) for m in chunk]
                results = handlers[kind](pairs, threads=self.threads, dtype=self.dtype)
                for message, result in zip(chunk, results, strict=True):
                    reply = result if isinstance(result, Message) else _error(message, repr(result))
                    self.pending[message.metadata.message_id] = reply
        return ids

    def _reply_alone(self, message: Message) -> None:
        try:
            reply = self.app(message, self.contexts[message.metadata.dst_node_id])
        except Exception as error:
            reply = _error(message, repr(error))
        self.pending[message.metadata.message_id] = reply


def _error(message: Message, reason: str) -> Message:
    return Message(Error(code=0, reason=reason), reply_to=message)
