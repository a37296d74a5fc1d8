"""``send_and_collect``: the ServerApp's wait between pulls follows what a pull cost the
processor, not how long it waited."""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest

from fedpers.strategies import federation


class _SlowGrid:
    """A deployed grid whose first pull waits ``wait`` seconds (for a reply's objects:
    Flower's backoff) and returns nothing, and whose second pull returns the reply."""

    def __init__(self, wait: float) -> None:
        self.wait = wait
        self.pulls = 0

    def push_messages(self, messages: list[Any]) -> list[str]:
        return ["m1"]

    def pull_messages(self, ids: Any) -> list[Any]:
        self.pulls += 1
        if self.pulls == 1:
            threading.Event().wait(self.wait)  # asleep, not working: no processor time
            return []
        reply = types.SimpleNamespace(metadata=types.SimpleNamespace(reply_to_message_id="m1"))
        return [reply]


def test_a_pull_that_waited_does_not_lengthen_the_next_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits: list[float] = []
    monkeypatch.setattr(federation.time, "sleep", waits.append)
    replies = federation.send_and_collect(_SlowGrid(wait=0.3), [], timeout=60)  # type: ignore[arg-type]
    assert len(replies) == 1
    # Wall time would have asked for 9 x 0.3 s; the pull used (almost) no processor.
    assert waits == [federation.PULL_INTERVAL]
