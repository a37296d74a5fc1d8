"""An in-process Grid that delivers messages to the real ClientApp: no Ray, no SuperLink.

Each node is a Context (its own state and node config) and a message is handled by
calling the ClientApp directly, as a SuperNode would. Replies to a handler that raises
become error replies, as in Flower. The tests use it, and so do the reply sweep of
``simulations.robustness`` (``fedpers.simulations.reply_fuzz``) and its attack table's
``--in-process`` runs (``InProcessSimulation``, ``run_in_process``).

``InProcessSimulation`` runs a whole run this way: the ServerApp's ``main`` on an
``InProcessGrid`` of real ClientApps. A run writes what ``flwr run`` writes, every float
to 1e-9 (the tests check it on each script's first run); a real run's start-up (about
25 s here) and Ray's 0.3-0.7 s a round are what it saves.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedpers.clients.client_app import app as client_app
from fedpers.config import Engine, schema_defaults
from fedpers.results import FAILURE_FILE, SUMMARY_FILE, ResultsExistError, run_directory
from fedpers.simulations import launch
from fedpers.simulations.launch import FlowerRunError
from fedpers.strategies import server_app

SERVER_NODE = 1


def set_task_identity() -> None:
    """Flower reads the sender's identity from process-wide state when building a
    message; the ServerApp process sets it in a real run."""
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = SERVER_NODE
    TaskIdentity.task_id = 1


def run_config(**overrides: Any) -> dict[str, Any]:
    """The default run config with kebab-case overrides (underscores accepted)."""
    values = schema_defaults()
    for key, value in overrides.items():
        values[key.replace("_", "-")] = value
    return values


class InProcessGrid:
    """A ``Grid`` whose nodes run the ClientApp in this process.

    Parameters
    ----------
    app : callable
        The ClientApp (``clients.client_app.app``) or any ``(Message, Context) -> Message``.
    run_config : Mapping
        The run config every node sees.
    num_nodes : int
        Nodes with partition ids ``0..num_nodes-1``; node ids are scrambled so that
        nothing can assume node id == partition id.
    fail : callable, optional
        ``(node, message) -> reason``: a reason makes the node answer with that error,
        ``DROP`` makes it never answer, ``None`` lets it run the app.
    """

    DROP = "__drop__"  # what `fail` returns for a message that never gets a reply

    def __init__(
        self,
        app: Callable[[Message, Context], Message],
        run_config: Mapping[str, Any],
        num_nodes: int,
        *,
        fail: Callable[[int, Message], str | None] | None = None,
    ) -> None:
        set_task_identity()
        self.app = app
        self.fail = fail
        self.contexts = {
            1000 + 7 * p: Context(
                run_id=1,
                node_id=1000 + 7 * p,
                node_config={"partition-id": p, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for p in range(num_nodes)
        }
        self.sent: list[Message] = []
        self.pending: dict[str, Message] = {}  # replies not pulled yet, by message id

    def node_of(self, partition: int) -> int:
        return 1000 + 7 * partition

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Run the app on each message now; its reply waits for ``pull_messages``."""
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.sent.append(message)
            ids.append(message.metadata.message_id)
            node = message.metadata.dst_node_id
            reason = self.fail(node, message) if self.fail else None
            if reason == self.DROP:
                continue
            if reason is None:
                try:
                    reply = self.app(message, self.contexts[node])
                except Exception as error:
                    reply = Message(Error(code=0, reason=repr(error)), reply_to=message)
            else:
                reply = Message(Error(code=0, reason=reason), reply_to=message)
            self.pending[message.metadata.message_id] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        """The replies to ``message_ids`` that exist, each delivered once."""
        return [self.pending.pop(i) for i in list(message_ids) if i in self.pending]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Flower's ``Grid.send_and_receive``, without waiting for dropped replies."""
        return self.pull_messages(self.push_messages(messages))


class InProcessSimulation:
    """``LocalSimulation``'s interface, each run in this process: the ServerApp's
    ``main`` on an ``InProcessGrid`` of real ClientApps, one node per virtual node, with
    the run config that ``flwr run`` would pass. No SuperLink, no Ray, no start-up.

    A run ends as under Flower: with its results directory, or with ``FlowerRunError``
    and the reason its ``failure.json`` gives. ``runs`` lists the run names, in order.
    Runs that a script starts from several threads run one at a time: each real run has
    a process of its own, and nothing of one may leak into another.
    """

    one_at_a_time = threading.Lock()

    def __init__(
        self,
        *,
        echo: Callable[[str], None] | None = None,
        keep_home: bool = False,
        environment: Mapping[str, str] | None = None,
        batched: Mapping[str, Any] | None = None,
        threads: int | None = None,
    ) -> None:
        self.runs: list[str] = []
        self.process = None
        self.threads = threads  # the batched engine's torch threads (None: as torch has)
        # with ``batched`` (BatchedGrid's keywords: cohort_size, threads, dtype), the
        # nodes' TRAIN and EVALUATE messages run as cohorts (the batched engine)
        self.batched = batched
        self.grid: InProcessGrid | None = None  # the last run's, for the tests

    def __enter__(self) -> InProcessSimulation:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def run(
        self,
        overrides: Mapping[str, Any],
        *,
        num_supernodes: int | None = None,
        cpus_per_client: int = 1,
        gpus_per_client: float = 0.0,
    ) -> Path:
        config = launch.resolved_config(overrides)
        directory = run_directory(config.results_dir, config.run_name)
        if (directory / SUMMARY_FILE).exists() and not config.resume:
            raise ResultsExistError(f"{directory} already holds results; remove it first")
        values = config.to_mapping()
        nodes = num_supernodes or config.num_clients
        if self.batched is not None or config.engine is Engine.BATCHED:
            from fedpers.simulations.batched import BatchedGrid

            options = {
                "cohort_size": config.cohort_size,
                "threads": config.engine_threads or self.threads,
                "workers": config.engine_workers,
                **(self.batched or {}),
            }
            grid: InProcessGrid = BatchedGrid(values, nodes, **options)
        else:
            grid = InProcessGrid(client_app, values, nodes)
        self.grid = grid
        context = Context(
            run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=values
        )
        with self.one_at_a_time:
            self.runs.append(config.run_name)
            try:
                server_app.main(grid, context)  # type: ignore[arg-type]
            except Exception as error:  # the run ended; what it wrote says how
                ended = f"{type(error).__name__}: {error}"
            else:
                ended = "no error"
            finally:
                close = getattr(grid, "close", None)
                if close is not None:
                    close()

        if (directory / SUMMARY_FILE).exists():
            return directory
        failure = directory / FAILURE_FILE
        reason = json.loads(failure.read_text())["reason"] if failure.exists() else "no summary"
        raise FlowerRunError(f"run '{config.run_name}' failed: {reason} ({ended})")

    def run_all(
        self, runs: Sequence[Mapping[str, Any]], *, parallel: int = 1, **kwargs: Any
    ) -> list[Path]:
        for overrides in runs:
            launch.resolved_config(overrides)
        return [self.run(overrides, **kwargs) for overrides in runs]


def run_in_process(overrides: Mapping[str, Any], threads: int | None = None) -> Path:
    """One run in this process (``InProcessSimulation``; ``threads``: the batched
    engine's torch threads), for a process pool: its results directory; a run that did
    not finish raises ``FlowerRunError``."""
    return InProcessSimulation(threads=threads).run(overrides)
