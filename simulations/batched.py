"""The batched engine: a Grid whose nodes' TRAIN and EVALUATE messages train as cohorts.

The ServerApp and its strategy are unchanged: they push a round's messages through
Flower's Grid interface as on any engine. ``BatchedGrid`` groups the messages of one
push by type, run and settings and hands each group, in chunks of at most
``cohort_size`` clients and ``cohort_mb`` megabytes of arrays sent (``chunks``), to
the ClientApp's cohort handlers (``clients.client_app.train_cohort`` and
``evaluate_cohort``): one computation for the whole chunk (``fedpers.training``), with
everything a device does per message (its state, its fault injection, its privacy
mechanism, its reply). Other messages (the start-up and families' queries) run one at
a time through the ClientApp, as on ``InProcessGrid``.

A client's result does not depend on its cohort: ``cohort_size = 1`` is the per-client
path, and the equality tests compare the two (``fedpers.simulations.equality``).

Beyond one process (``workers`` > 0), the nodes are sharded over Ray actors
(``Shard``: partition ``p`` lives on actor ``p % workers``, its state with it), each
running its shard's cohorts; the driver, which runs the ServerApp, sends every actor its
messages of a push at once and collects the replies. On a Ray cluster
(``RAY_ADDRESS``) the actors spread over its machines, so Ray stays the engine that
scales past one machine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, Context, Error, Message, MessageType, RecordDict

from fedpers.clients import client_app
from fedpers.config import EngineSettings
from fedpers.simulations.grid import InProcessGrid

# The run config's defaults, declared once (fedpers.config): clients of one computation
# (memory grows with it, speed saturates) and megabytes of arrays sent to one
# computation's clients. A cohort's memory is a few times what it was sent (its models
# stacked, their gradients and momentum): a mixture's learners or an image model reach
# the budget with a few clients (IFCA's 20 Fashion-MNIST MLPs, 44 MB a client, took
# 18 GB as one cohort of 100), a small MLP's 1,024 clients do not.
COHORT_SIZE = EngineSettings().cohort_size
COHORT_MB = EngineSettings().cohort_mb


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
    cohort_mb : float (default: COHORT_MB)
        The most megabytes of arrays sent to one computation's clients (a client alone
        may exceed it).
    threads : int, optional
        Torch threads of the computations (default: as torch has them).
    dtype : str, optional
        ``"float64"`` to compute in double precision (the equality tests).
    workers : int (default: 0)
        Ray actors the nodes are sharded over (0: every node in this process).
    partitions : sequence of int, optional
        The partitions whose nodes this grid holds (a shard's); default all.
    fail : callable, optional
        As ``InProcessGrid``'s: ``(node, message) -> reason``.
    keep_sent : bool (default: True)
        As ``InProcessGrid``'s.
    """

    engine = "batched"  # the ServerApp checks that a run asking for it runs on it

    def __init__(
        self,
        run_config: Mapping[str, Any],
        num_nodes: int,
        *,
        cohort_size: int = COHORT_SIZE,
        cohort_mb: float = COHORT_MB,
        threads: int | None = None,
        dtype: str | None = None,
        workers: int = 0,
        partitions: Sequence[int] | None = None,
        fail: Callable[[int, Message], str | None] | None = None,
        keep_sent: bool = True,
    ) -> None:
        super().__init__(client_app.app, run_config, 0, fail=fail, keep_sent=keep_sent)
        if cohort_size < 1:
            raise ValueError(f"cohort_size {cohort_size}: at least 1")
        if not cohort_mb > 0:
            raise ValueError(f"cohort_mb {cohort_mb}: more than 0")
        self.cohort_size = cohort_size
        self.cohort_bytes = cohort_mb * 2**20
        self.dtype = dtype
        self.nodes = [self.node_of(p) for p in range(num_nodes)]
        self.partition_of = {node: p for p, node in enumerate(self.nodes)}
        self.shards: list[Any] = []
        if workers > 0:
            self.shards = start_shards(
                run_config,
                num_nodes,
                workers,
                cohort_size=cohort_size,
                cohort_mb=cohort_mb,
                threads=threads,
                dtype=dtype,
            )
            self.threads = 0
            return
        shared = dict(run_config)  # one copy for every node: 100,000 nodes hold no copies
        self.contexts = {
            self.node_of(p): Context(
                run_id=1,
                node_id=self.node_of(p),
                node_config={"partition-id": p, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=shared,
            )
            for p in (range(num_nodes) if partitions is None else partitions)
        }
        if threads is None:
            import torch

            threads = torch.get_num_threads()
        self.threads = threads

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def close(self) -> None:
        """Stop the shards' actors (nothing to do in process), keeping their nodes'
        contexts here (``contexts``: every node's state at the end, as in process)."""
        if self.shards:
            import ray

            for held in ray.get([shard.contexts.remote() for shard in self.shards]):
                self.contexts.update(held)
            for shard in self.shards:
                ray.kill(shard)
            self.shards = []
            if not os.environ.get("RAY_ADDRESS"):
                ray.shutdown()  # the Ray this grid started on this machine
                from fedpers.simulations.launch import remove_ray_directory

                remove_ray_directory(_own_ray_directory())

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Run the messages now, TRAIN and EVALUATE as cohorts (on the shards, if any);
        replies wait for ``pull_messages``. ``fail`` and ``sent`` work as for
        ``InProcessGrid``, whether the nodes are here or on shards."""
        ids, live = self.admit(messages)
        if self.shards:
            self._run_on_shards(live)
        else:
            self.run(live)
        return ids

    def run(self, messages: list[Message]) -> None:
        """Run ``messages`` (each to a node held here), TRAIN and EVALUATE as cohorts
        (``chunks``), any other alone; each reply waits in ``pending`` under its
        message's id."""
        cohorts: dict[str, list[Message]] = {MessageType.TRAIN: [], MessageType.EVALUATE: []}
        for message in messages:
            if message.metadata.message_type in cohorts:
                cohorts[message.metadata.message_type].append(message)
            else:
                self._reply_alone(message)
        handlers = {
            MessageType.TRAIN: client_app.train_cohort,
            MessageType.EVALUATE: client_app.evaluate_cohort,
        }
        for kind, batch in cohorts.items():
            for chunk in chunks(batch, self.cohort_size, self.cohort_bytes):
                pairs = [(m, self.contexts[m.metadata.dst_node_id]) for m in chunk]
                results = handlers[kind](pairs, threads=self.threads, dtype=self.dtype)
                for message, result in zip(chunk, results, strict=True):
                    reply = result if isinstance(result, Message) else _error(message, repr(result))
                    self.pending[message.metadata.message_id] = reply

    def _run_on_shards(self, messages: list[Message]) -> None:
        """Every shard's messages to its actor at once; their replies wait here."""
        import ray

        by_shard: list[list[Message]] = [[] for _ in self.shards]
        for message in messages:
            partition = self.partition_of[message.metadata.dst_node_id]
            by_shard[partition % len(self.shards)].append(message)
        calls = [
            shard.handle.remote(batch)
            for shard, batch in zip(self.shards, by_shard, strict=True)
            if batch
        ]
        for replies in ray.get(calls):
            for reply in replies:
                self.pending[reply.metadata.reply_to_message_id] = reply

    def _reply_alone(self, message: Message) -> None:

        try:
            reply = self.app(message, self.contexts[message.metadata.dst_node_id])
        except Exception as error:
            reply = _error(message, repr(error))
        self.pending[message.metadata.message_id] = reply


def _error(message: Message, reason: str) -> Message:
    return Message(Error(code=0, reason=reason), reply_to=message)


class Shard:
    """A Ray actor holding the nodes of partitions ``p % workers == index`` (a
    ``BatchedGrid`` of its own, in its process) and running their messages."""

    def __init__(
        self,
        run_config: Mapping[str, Any],
        num_nodes: int,
        partitions: Sequence[int],
        *,
        cohort_size: int,
        cohort_mb: float,
        threads: int,
        dtype: str | None,
    ) -> None:
        from fedpers.simulations.grid import set_task_identity

        set_task_identity()
        self.grid = BatchedGrid(
            run_config,
            num_nodes,
            cohort_size=cohort_size,
            cohort_mb=cohort_mb,
            threads=threads,
            dtype=dtype,
            partitions=partitions,
            keep_sent=False,
        )

    def handle(self, messages: list[Message]) -> list[Message]:
        """The replies to ``messages`` (each addressed to a node of this shard, its id
        given by the driver's grid, which also applied its ``fail``)."""
        self.grid.run(messages)
        return self.grid.pull_messages([m.metadata.message_id for m in messages])

    def contexts(self) -> dict[int, Context]:
        """This shard's nodes' contexts, by node id."""
        return self.grid.contexts


def _own_ray_directory() -> Path:
    """The folder of the Ray this process starts for its shards (its session's logs and
    sockets), removed when the grid closes."""
    from fedpers.simulations.launch import ray_directory, work_directory

    return ray_directory(work_directory(), f"b{os.getpid()}")


def sent_bytes(message: Message) -> int:
    """The bytes of the arrays ``message`` carries (what its client's models are made
    from)."""
    return sum(
        len(array.data)
        for record in message.content.values()
        if isinstance(record, ArrayRecord)
        for array in record.values()
    )


def chunks(batch: Sequence[Message], size: int, budget: float) -> Iterable[list[Message]]:
    """``batch`` cut, in order, into runs of at most ``size`` messages whose arrays
    (``sent_bytes``) total at most ``budget`` bytes; a message beyond the budget alone
    is a run of its own."""
    chunk: list[Message] = []
    total = 0
    for message in batch:
        held = sent_bytes(message)
        if chunk and (len(chunk) == size or total + held > budget):
            yield chunk
            chunk, total = [], 0
        chunk.append(message)
        total += held
    if chunk:
        yield chunk


def start_shards(
    run_config: Mapping[str, Any],
    num_nodes: int,
    workers: int,
    *,
    cohort_size: int,
    cohort_mb: float,
    threads: int | None,
    dtype: str | None,
) -> list[Any]:
    """``workers`` Ray actors, each holding a shard of the nodes: on the Ray cluster of
    ``RAY_ADDRESS`` where set (its machines' cores and GPUs), else on a Ray started on
    this machine (its temporary folder in the work folder). Each actor reserves
    ``threads`` cores (default: this machine's cores shared out) and, where a GPU is
    visible and the run's device allows it, one GPU."""
    import ray

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # Ray's FutureWarning
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if not address:
            options["_temp_dir"] = str(_own_ray_directory().resolve())
        if not address or address.startswith("127."):
            _on_loopback()
        ray.init(address=address, logging_level=logging.ERROR, **options)
    cores = threads or max(1, (os.cpu_count() or 1) // workers)
    gpus = 1 if str(run_config.get("device", "auto")) != "cpu" and _gpus() >= workers else 0
    actor = ray.remote(num_cpus=cores, num_gpus=gpus)(Shard)
    return [
        actor.remote(
            dict(run_config),
            num_nodes,
            list(range(index, num_nodes, workers)),
            cohort_size=cohort_size,
            cohort_mb=cohort_mb,
            threads=cores,
            dtype=dtype,
        )
        for index in range(workers)
    ]


def _gpus() -> int:
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


def _on_loopback() -> None:
    """One machine: this driver's Ray stays on loopback. On Linux Ray resolves
    ``127.0.0.1`` to the host's outward address, where a head started on loopback (the
    tests', ``simulations.launch``'s) does not listen; ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER
    = 0`` keeps it, but Ray reads it when it is imported, which Flower may have done
    already: its constant is set too."""
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
