"""The two changes fedpers makes inside Flower 1.42's simulation runtime, both proposed
upstream, installed together by ``install()``: a per-node index for the in-memory
LinkState, and a cache for the run config that every virtual node's context is built
from.

The LinkState index. The problem (reproducer: ``python -m simulations.linkstate_cost``).
The simulation runtime's dispatcher
(``flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue``) asks, every 0.1 s,
for the next message of *every* node: ``state.get_message_ins(node_id, limit=1)``.
``InMemoryLinkState.get_message_ins`` answers by scanning, and re-validating, every
stored message. One sweep therefore costs nodes x stored messages: 1.0-1.4 s at 1,000
nodes and 1,000 messages, 41 s at 5,000 and 5,000, during which the dispatcher holds
the state's lock and the GIL of the process that also runs the ServerApp. Flower's SQL
LinkState filters by node in its query, but the simulation process always builds an
in-memory one (``flwr.simulation.run_simulation._main_loop``), so ``--database`` does
not reach it.

The change. ``store_message_ins`` also appends the new message's id to a list kept per
destination node; ``get_message_ins(node_id, ...)`` walks that node's list only, with
the same checks, in the same order, with the same result, as the full scan (expired
messages are dropped by the same ``_check_stored_messages``; delivered and deleted ones
leave the list). A sweep then costs nodes + messages. The upstream form of this is a
``dst_node_id -> message ids`` dict maintained in ``store_message_ins`` and
``delete_messages``; here the index is kept beside the class, so it is installed by
wrapping two methods, once per process, and only on the Flower version it was checked
against (``tests/strategies/test_flower_patches.py`` replays random operation sequences
against the unpatched class as the oracle).

The run-config cache. Flower builds every virtual node's context by reading and parsing the
app's pyproject.toml (``vce_api._register_node_info_stores`` ->
``get_fused_config_from_dir``), 10,000 times for 10,000 nodes: about 4 s (py-spy),
before Ray starts. ``install()`` also wraps that function so that it parses a file
once per (path, modification time, size, overrides) and returns a copy.

The ServerApp module calls ``install()`` when it is imported into a process that has
imported Flower's in-memory LinkState: a simulation's process, which holds the
LinkState. In a deployment the LinkState lives in the SuperLink process, which never
imports fedpers; Flower 1.42's ``flwr-serverapp`` imports the in-memory LinkState
module as well, so the changes are installed there too, and stay idle (that process
holds no LinkState). Whether a run is a simulation is decided by its grid
(``server_app.simulated``), not by this import.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import flwr
from flwr.app import Message
from flwr.app.user_config import UserConfig
from flwr.compat.client import run_info_store
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
from flwr.supercore.date import now

logger = logging.getLogger(__name__)

CHECKED_VERSIONS = ("1.42.",)  # the Flower versions whose InMemoryLinkState this matches
_PENDING = "_fedpers_pending_by_node"  # attribute holding the index on each state
_ORIGINAL = "_fedpers_original_get_message_ins"


def install() -> bool:
    """Index ``InMemoryLinkState`` by destination node and cache the nodes' run config;
    True if installed (or already).

    A Flower version other than ``CHECKED_VERSIONS`` is left as it is, with a warning:
    the change is only correct against the code it was checked on.
    """
    if installed():
        return True
    if not flwr.__version__.startswith(CHECKED_VERSIONS):
        logger.warning(
            "flwr %s: fedpers' changes to Flower's simulation runtime were checked against "
            "%s only and are not installed; large simulations dispatch messages in nodes x "
            "messages time",
            flwr.__version__,
            ", ".join(f"{v}x" for v in CHECKED_VERSIONS),
        )
        return False
    original_store = InMemoryLinkState.store_message_ins
    setattr(InMemoryLinkState, _ORIGINAL, InMemoryLinkState.get_message_ins)
    InMemoryLinkState.store_message_ins = _indexed_store(original_store)  # type: ignore[method-assign,assignment]
    InMemoryLinkState.get_message_ins = _indexed_get  # type: ignore[method-assign]
    run_info_store.get_fused_config_from_dir = _cached_config(
        run_info_store.get_fused_config_from_dir
    )
    return True


@contextlib.contextmanager
def installed_as(enabled: bool) -> Iterator[None]:
    """Within the block, the changes are installed (``enabled``) or not; afterwards as
    before (benchmarks and tests compare the two)."""
    was = installed()
    if enabled:
        install()
    else:
        uninstall()
    try:
        yield
    finally:
        if was:
            install()
        else:
            uninstall()


def installed() -> bool:
    """Whether the index is installed in this process."""
    return hasattr(InMemoryLinkState, _ORIGINAL)


def uninstall() -> None:
    """Restore Flower's own methods (for tests)."""
    original_get = getattr(InMemoryLinkState, _ORIGINAL, None)
    if original_get is None:
        return
    store = InMemoryLinkState.store_message_ins
    InMemoryLinkState.store_message_ins = store.__wrapped__  # type: ignore[attr-defined,method-assign]
    InMemoryLinkState.get_message_ins = original_get  # type: ignore[method-assign]
    delattr(InMemoryLinkState, _ORIGINAL)
    fused = run_info_store.get_fused_config_from_dir
    run_info_store.get_fused_config_from_dir = fused.__wrapped__  # type: ignore[attr-defined]


def _cached_config(original: Callable[[Path, UserConfig], UserConfig]) -> Any:
    """``get_fused_config_from_dir`` that reads and parses a pyproject.toml once, not
    once per virtual node (``vce_api._register_node_info_stores``): the same run config
    for the same file (path, modification time and size) and overrides, as a copy."""
    cache: dict[tuple[object, ...], UserConfig] = {}

    @functools.wraps(original)
    def get_fused_config_from_dir(project_dir: Path, override_config: UserConfig) -> UserConfig:
        try:
            pyproject = (Path(project_dir) / "pyproject.toml").resolve()
            stat = pyproject.stat()
            key = (str(pyproject), stat.st_mtime_ns, stat.st_size, *sorted(override_config.items()))
            hash(key)
        except (OSError, TypeError):  # no such file, unhashable overrides: Flower decides
            return original(project_dir, override_config)
        if key not in cache:
            if len(cache) >= 8:
                cache.clear()
            cache[key] = original(project_dir, override_config)
        return dict(cache[key])

    return get_fused_config_from_dir


def _pending(state: InMemoryLinkState) -> dict[int, list[str]]:
    """The state's index, built from its store on first use (caller holds the lock)."""
    pending: dict[int, list[str]] | None = state.__dict__.get(_PENDING)
    if pending is None:
        pending = {}
        for message_id, message in state.message_ins_store.items():
            if message.metadata.delivered_at == "":
                pending.setdefault(message.metadata.dst_node_id, []).append(message_id)
        state.__dict__[_PENDING] = pending
    return pending


def _indexed_store(
    original: Callable[[InMemoryLinkState, Message], str | None],
) -> Callable[[InMemoryLinkState, Message], str | None]:
    @functools.wraps(original)
    def store_message_ins(self: InMemoryLinkState, message: Message) -> str | None:
        with self.lock:
            pending = _pending(self)
            known = message.metadata.message_id in self.message_ins_store
            message_id = original(self, message)
            if message_id is not None and not known:
                pending.setdefault(message.metadata.dst_node_id, []).append(message_id)
            return message_id

    return store_message_ins


def _indexed_get(
    self: InMemoryLinkState,
    node_id: int,
    limit: int | None,
    *,
    run_id: int | None = None,
) -> list[Message]:
    """``InMemoryLinkState.get_message_ins`` over the node's own messages only."""
    if limit is not None and limit < 1:
        raise AssertionError("`limit` must be >= 1")
    found: list[Message] = []
    with self.lock:
        queue = _pending(self).get(node_id)
        if not queue:
            return found
        keep: list[str] = []
        for position, message_id in enumerate(queue):
            if limit and len(found) == limit:
                keep.extend(queue[position:])
                break
            self._check_stored_messages({message_id})
            message: Any = self.message_ins_store.get(message_id)
            if message is None or message.metadata.delivered_at != "":
                continue  # deleted, expired or delivered: leaves the index
            if run_id is not None and message.metadata.run_id != run_id:
                keep.append(message_id)
                continue
            found.append(message)
        queue[:] = keep
    delivered_at = now().isoformat()
    for message in found:
        message.metadata.delivered_at = delivered_at
    return found
