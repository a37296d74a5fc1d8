"""Flower 1.42's wait for an object that is registered but not yet stored, made short.

Flower sends a message before its objects: the receiver sees the message, asks for an
object the sender has not pushed yet, and ``pull_objects``
(``flwr/supercore/inflatable/inflatable_utils.py``) retries after 1 s, doubling up to
10 s. Every side of a deployment pulls this way: the SuperNode (messages from the
server), the ClientApp (from its SuperNode) and the deployed ServerApp (the devices'
replies). A reply whose arrays were still being pushed cost the ServerApp 1 + 2 + 4 + ...
seconds; on the deployed digits run that was most of the 17-28 s training exchanges
(docs/deploying.md). ``set_object_backoff`` shortens the wait in this process; the
pulls, and what they pull, are Flower's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

FLOWER_OBJECT_BACKOFF = 1.0
FLOWER_OBJECT_BACKOFF_CAP = 10.0
OBJECT_BACKOFF = 0.05
OBJECT_BACKOFF_CAP = 1.0


class FlowerWaitError(RuntimeError):
    """The installed Flower does not wait where fedpers expects."""


def set_object_backoff(initial: float = OBJECT_BACKOFF, cap: float = OBJECT_BACKOFF_CAP) -> None:
    """Retry an object not yet stored after ``initial`` seconds, doubling to ``cap``, in
    every ``pull_objects`` of this process.

    Raises
    ------
    FlowerWaitError
        If Flower's ``pull_objects`` no longer takes ``initial_backoff`` and
        ``backoff_cap``: a silent no-op would claim speed it does not give.
    """
    from flwr.supercore.inflatable import inflatable_utils

    defaults = inflatable_utils.pull_objects.__kwdefaults__ or {}
    if not {"initial_backoff", "backoff_cap"} <= set(defaults):
        import flwr

        raise FlowerWaitError(
            f"flwr {flwr.__version__}'s pull_objects takes no initial_backoff and "
            f"backoff_cap ({inflatable_utils.__file__}): fedpers knows Flower 1.42's "
            "waits; install the flwr version of constraints.txt"
        )
    defaults.update(initial_backoff=initial, backoff_cap=cap)


@contextlib.contextmanager
def object_backoff(
    initial: float = OBJECT_BACKOFF, cap: float = OBJECT_BACKOFF_CAP
) -> Iterator[None]:
    """``set_object_backoff`` while open; Flower's values again after (a ServerApp run in
    a test's process leaves nothing behind)."""
    from flwr.supercore.inflatable import inflatable_utils

    saved = dict(inflatable_utils.pull_objects.__kwdefaults__ or {})
    set_object_backoff(initial, cap)
    try:
        yield
    finally:
        inflatable_utils.pull_objects.__kwdefaults__ = saved
