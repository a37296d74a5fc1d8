"""An in-process Grid that delivers messages to the real ClientApp: no Ray, no SuperLink.

Each node is a Context (its own state and node config) and a message is handled by
calling the ClientApp directly, as a SuperNode would. Replies to a handler that raises
become error replies, as in Flower. The tests use it, the reply sweep of
``simulations.robustness`` (``fedpers.simulations.reply_fuzz``), and the runs of
``fedpers.simulations.inprocess`` (its per-client path; ``fedpers.simulations.batched``
extends it into the batched engine).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.common import serde
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.supercore.task_identity import TaskIdentity

from fedpers.config import schema_defaults

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


def on_the_wire(message: Message) -> Message:
    """``message`` as its receiver gets it from Flower: encoded by Flower's ``serde``
    into the protobuf bytes that cross the network, and decoded again."""
    encoded = serde.message_to_proto(message).SerializeToString()
    return serde.message_from_proto(ProtoMessage.FromString(encoded))


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
    keep_sent : bool (default: True)
        Keep every message pushed in ``sent`` (what the tests inspect); a run's grid
        keeps none, so that its memory does not grow with its rounds.
    wire : bool (default: False)
        Send each message, and the app's reply, through Flower's own encoding (protobuf
        bytes and back, ``on_the_wire``), as between a SuperLink and a SuperNode: the
        app gets a copy of its own, and a reply that Flower cannot encode fails here as
        it would there. The scripts' tests run their in-process runs so.
    """

    DROP = "__drop__"  # what `fail` returns for a message that never gets a reply

    def __init__(
        self,
        app: Callable[[Message, Context], Message],
        run_config: Mapping[str, Any],
        num_nodes: int,
        *,
        fail: Callable[[int, Message], str | None] | None = None,
        keep_sent: bool = True,
        wire: bool = False,
    ) -> None:
        set_task_identity()
        self.app = app
        self.wire = wire
        self.fail = fail
        self.keep_sent = keep_sent
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
        ids, live = self.admit(messages)
        for message in live:
            delivered = on_the_wire(message) if self.wire else message
            try:
                reply = self.app(delivered, self.contexts[message.metadata.dst_node_id])
                reply = on_the_wire(reply) if self.wire else reply
            except Exception as error:
                reply = Message(Error(code=0, reason=repr(error)), reply_to=message)
            self.pending[message.metadata.message_id] = reply
        return ids

    def admit(self, messages: Iterable[Message]) -> tuple[list[str], list[Message]]:
        """Every message's fresh id (in order), and the messages its node runs. Each is
        kept in ``sent`` if asked; one that ``fail`` fails gets that error as its reply
        now, one it drops never gets a reply."""
        ids, live = [], []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            ids.append(message.metadata.message_id)
            if self.keep_sent:
                self.sent.append(message)
            reason = self.fail(message.metadata.dst_node_id, message) if self.fail else None
            if reason is None:
                live.append(message)
            elif reason != self.DROP:
                self.pending[message.metadata.message_id] = Message(
                    Error(code=0, reason=reason), reply_to=message
                )
        return ids, live

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        """The replies to ``message_ids`` that exist, each delivered once."""
        return [self.pending.pop(i) for i in list(message_ids) if i in self.pending]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Flower's ``Grid.send_and_receive``, without waiting for dropped replies."""
        return self.pull_messages(self.push_messages(messages))
