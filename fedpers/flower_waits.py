"""Flower 1.42's wait for an object that is registered but not yet stored, made short.

Flower sends a message before its objects: the receiver sees the message, asks for an
object the sender has not pushed yet, and ``pull_objects``
(``flwr/supercore/inflatable/inflatable_utils.py``) retries after 1 s, doubling up to
10 s. Every side of a deployment pulls this way: the SuperNode (messages from the
server), the ClientApp (from its SuperNode) and the deployed ServerApp (the devices'
replies). A reply whose arrays were still being pushed cost the ServerApp 1 + 2 + 4 + ...
seconds; on the deployed digits run that was most of the 17-28 s training exchanges
(docs/deploying.md). ``set_object_backoff`` shortens the wait in this process; the
pulls, and what they pull, are Flower's. It sets every function of Flower's that takes
the backoff (``PULLS``): a ClientApp pulls its message through
``pull_and_inflate_object_from_tree``, whose own defaults (Flower's 1 s) it hands on, so
until 2026-12-05 a forked ClientApp that asked before its message was stored still
waited about 1 s (seen in a timeline of the namespace deployment).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

FLOWER_OBJECT_BACKOFF = 1.0
FLOWER_OBJECT_BACKOFF_CAP = 10.0
OBJECT_BACKOFF = 0.05
# An object in transit is asked for again every 0.1 s at most: a doubling schedule up to
# 1 s (before 2026-12-05) found an object that arrived just after a retry up to 1 s
# late, and a ClientApp's message or a device's reply is usually there within 0.3 s.
OBJECT_BACKOFF_CAP = 0.1
# Flower 1.42's functions that take the backoff as keyword defaults: ``pull_objects``,
# and ``pull_and_inflate_object_from_tree``, which passes its own defaults on to it
# (a ClientApp pulls its message through the latter).
PULLS = ("pull_objects", "pull_and_inflate_object_from_tree")


class FlowerWaitError(RuntimeError):
    """The installed Flower does not wait where fedpers expects."""


def _pull_defaults() -> list[dict[str, object]]:
    """The keyword defaults of each of ``PULLS``, the dicts Flower's calls read.

    Raises
    ------
    FlowerWaitError
        If one no longer takes ``initial_backoff`` and ``backoff_cap``: a silent no-op
        would claim speed it does not give.
    """
    from flwr.supercore.inflatable import inflatable_utils

    found = []
    for name in PULLS:
        function = getattr(inflatable_utils, name, None)
        defaults = getattr(function, "__kwdefaults__", None) or {}
        if not {"initial_backoff", "backoff_cap"} <= set(defaults):
            import flwr

            raise FlowerWaitError(
                f"flwr {flwr.__version__}'s {name} takes no initial_backoff and "
                f"backoff_cap ({inflatable_utils.__file__}): fedpers knows Flower 1.42's "
                "waits; install the flwr version of constraints.txt"
            )
        found.append(defaults)
    return found


def set_object_backoff(initial: float = OBJECT_BACKOFF, cap: float = OBJECT_BACKOFF_CAP) -> None:
    """Retry an object not yet stored after ``initial`` seconds, doubling to ``cap``, in
    every object pull of this process (each of ``PULLS``).

    Raises
    ------
    FlowerWaitError
        If one of ``PULLS`` no longer takes ``initial_backoff`` and ``backoff_cap``.
    """
    for defaults in _pull_defaults():
        defaults.update(initial_backoff=initial, backoff_cap=cap)


@contextlib.contextmanager
def object_backoff(
    initial: float = OBJECT_BACKOFF, cap: float = OBJECT_BACKOFF_CAP
) -> Iterator[None]:
    """``set_object_backoff`` while open; Flower's values again after (a ServerApp run in
    a test's process leaves nothing behind)."""
    saved = [(defaults, dict(defaults)) for defaults in _pull_defaults()]
    set_object_backoff(initial, cap)
    try:
        yield
    finally:
        for defaults, values in saved:
            defaults.clear()
            defaults.update(values)
