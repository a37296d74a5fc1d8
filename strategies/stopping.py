"""A run that Flower stops (``flwr stop``, SIGINT or SIGTERM to the ServerApp's process)
says so in its results directory and its log.

Flower 1.42 ends a stopped run by signalling the process that runs its ServerApp: the
SuperLink withdraws the run's task token, the process's next call to the SuperLink (a
deployed ServerApp's grid, a simulation's heartbeat) is refused with 401, and Flower's
retry code sends SIGINT to its own process; the handler Flower installed there
(``flwr.supercore.exit``) runs the registered exit handlers and exits. A simulation runs
the ServerApp in a thread of that process, so nothing in the ServerApp's own code would
see the stop; a deployed ServerApp runs in the main thread, which the handler's
``SystemExit`` unwinds from wherever it was. In both, the registered exit handlers run
first: ``on_flower_exit`` registers one for the length of a run, in the phase before
Flower's own (which upload the run's last log lines, so ``flwr log`` shows the line it
writes), and takes it out when the run ends.

The handler (``stop_handler``) marks the run stopped (``RunRecorder.stop``): no round,
checkpoint or summary is written after it, ``failure.json`` says it was interrupted and
how many rounds are kept, the directory's lock is released, and one log line names the
directory and what to add to the same ``flwr run`` to continue (``resume=true`` and the
run's name), or why it cannot be. A round's line is written before its checkpoint and
the stop waits for a write in progress, so the checkpoint kept never runs ahead of
``rounds.jsonl``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from fedpers.config import RunConfig
from fedpers.results import RunRecorder

logger = logging.getLogger(__name__)

STOPPED = "stopped from outside (flwr stop, or SIGINT/SIGTERM to the ServerApp's process)"


@contextmanager
def on_flower_exit(handler: Callable[[], None]) -> Iterator[None]:
    """Within it, Flower's exit (a stopped run's signal) calls ``handler`` first."""
    from flwr.supercore.exit import add_exit_handler
    from flwr.supercore.exit import exit_handler as registry

    add_exit_handler(handler, run_before_force_exit=True)
    try:
        yield
    finally:
        with registry._lock_handlers:
            registry.registered_exit_handlers[:] = [
                entry
                for entry in registry.registered_exit_handlers
                if entry.exit_handler is not handler
            ]


def resume_hint(config: RunConfig, run_name: str, *, simulated: bool) -> str:
    """How to continue the run once stopped: what to add to the same ``flwr run``'s
    ``--run-config``, or why it cannot be continued (a simulated row that keeps state on
    its clients, run without ``client-state-dir``: that state is gone)."""
    if simulated and config.spec.keeps_state and not config.client_state_dir:
        return (
            f"it cannot be resumed: '{config.algorithm}' keeps state on its clients and "
            "this run had no client-state-dir; start afresh with client-state-dir set to "
            "be able to resume"
        )
    return f"to continue, add resume=true run-name='{run_name}' to the same flwr run's --run-config"


def stop_handler(recorder: RunRecorder, hint: str) -> Callable[[], None]:
    """The exit handler of one run: record the stop, log one line (``hint``:
    ``resume_hint``)."""

    def stopped() -> None:
        reason = f"{STOPPED}; {hint}"
        rounds = recorder.stop(reason)
        if rounds is None:  # it had finished, failed, or was stopped already
            return
        logger.warning(
            "%s | stopped after round %d/%d (flwr stop, or a signal): %d rounds and their "
            "checkpoint kept in %s; %s",
            recorder.name,
            rounds,
            recorder.total_rounds,
            rounds,
            recorder.directory,
            hint,
        )

    return stopped
