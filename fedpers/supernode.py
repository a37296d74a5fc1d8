"""``fedpers-supernode``: Flower's own SuperNode, with its waits shortened.

    fedpers-supernode [--poll-interval S] [--reply-poll S] [--object-backoff S]
                      [--task-poll-interval S] [--active-task-poll S]
                      [--launcher prestarted|flower]
                      [--flower-waits] [--flower-defaults] FLOWER-SUPERNODE-ARGS...

Flower 1.42's SuperNode spends most of a deployed round waiting, not working
(docs/deploying.md, "Where a deployed round's time goes"):

- with no message waiting it sleeps 3 s (a literal in
  ``flwr/supernode/start_client_internal.py``), so the last node to reply picks up the
  next message about 3 s late, every exchange;
- it waits for the ClientApp's reply, and for each object of the reply, in 0.5 s steps;
- it retries an object that is registered but not yet stored after 1 s, doubling to 10 s;
- the SuperExec it starts looks for new tasks every 1 s
  (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``), also in the middle of a run, when the next
  message is due within the round.

- the SuperExec starts a fresh ``flwr-clientapp`` process for every message, which
  imports Flower's command line and then torch before it can start (3-7 s).

This command sets those four waits and, by default, gives the SuperExec fedpers'
prestarted launcher (``fedpers.launcher``: every ClientApp process is forked from one
that has imported Flower and torch already), whose SuperExec asks for tasks every
``--active-task-poll`` seconds for 30 s after a task and at the task-poll interval
otherwise, then runs Flower's unmodified
``flower-supernode`` main with the remaining arguments. The wire protocol is Flower's:
an unmodified SuperLink serves these nodes. ``--flower-waits`` keeps every one of
Flower's waits, ``--launcher flower`` its launcher, and ``--flower-defaults`` both.

A shorter poll costs the SuperLink requests: a node with nothing to do asks for a
message every ``--poll-interval`` seconds (docs/deploying.md gives the interval to
choose for a fleet's size).
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from fedpers.flower_waits import (
    FLOWER_OBJECT_BACKOFF,
    FLOWER_OBJECT_BACKOFF_CAP,
    OBJECT_BACKOFF,
    OBJECT_BACKOFF_CAP,
    set_object_backoff,
)
from fedpers.launcher import ACTIVE_TASK_POLL_ENV, ACTIVE_WINDOW, check_task_poll_source

# Flower's values, as read from the installed 1.42 source (checked in `_check_source`).
FLOWER_POLL = 3.0
FLOWER_REPLY_POLL = 0.5
FLOWER_TASK_POLL = 1.0
TASK_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"

# fedpers' defaults. Measured on 2 cores (docs/deploying.md, "A faster SuperNode"): these
# gave the deployed test's run in the time Flower's waits did (202 s, 201 s), while a
# 0.2 s poll with a 0.1 s SuperExec poll made it slower (244 s): a poll costs CPU that
# the ClientApp processes need. So the SuperExec keeps Flower's 1 s.
POLL = 0.5
REPLY_POLL = 0.05
TASK_POLL = 1.0
# For 30 s after a task (fedpers.launcher.ACTIVE_WINDOW), the prestarted launcher's
# SuperExec asks for the next one every ACTIVE_TASK_POLL seconds: a run's next message
# comes within a round. The ask is local (SuperExec to SuperNode); the SuperLink never
# sees it. An idle node keeps TASK_POLL.
ACTIVE_TASK_POLL = 0.1
LAUNCHERS = ("prestarted", "flower")
SUPEREXEC = "flower-superexec"


class SuperNodeWaitError(RuntimeError):
    """The installed Flower's SuperNode does not wait where this command expects."""


class Waits:
    """``time`` as ``start_client_internal`` sees it: ``sleep(3)`` (nothing to pull)
    becomes ``sleep(poll)``, ``sleep(0.5)`` (a reply or object not ready) becomes
    ``sleep(reply_poll)``; every other call is ``time``'s own."""

    def __init__(self, poll: float, reply_poll: float) -> None:
        self.poll = poll
        self.reply_poll = reply_poll
        self._table = {FLOWER_POLL: poll, FLOWER_REPLY_POLL: reply_poll}

    def sleep(self, seconds: float) -> None:
        time.sleep(self._table.get(float(seconds), seconds))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds") from None
    if not math.isfinite(value) or not 0.01 <= value <= 60:
        raise argparse.ArgumentTypeError(f"{text} s: give a number of seconds in [0.01, 60]")
    return value


def parser() -> argparse.ArgumentParser:
    """fedpers' flags; every other argument goes to ``flower-supernode``."""
    p = argparse.ArgumentParser(
        prog="fedpers-supernode",
        description="Flower's SuperNode with its waits set (fedpers.supernode).",
        epilog="Every other argument is flower-supernode's (flower-supernode --help).",
    )
    p.add_argument(
        "--poll-interval",
        type=_seconds,
        default=POLL,
        help=f"seconds between asks when no message waits (default {POLL}; Flower: 3)",
    )
    p.add_argument(
        "--reply-poll",
        type=_seconds,
        default=REPLY_POLL,
        help=f"step of the waits for a ClientApp's reply and its objects (default "
        f"{REPLY_POLL}; Flower: 0.5)",
    )
    p.add_argument(
        "--object-backoff",
        type=_seconds,
        default=OBJECT_BACKOFF,
        help=f"first retry of an object not yet stored, doubling up to "
        f"{OBJECT_BACKOFF_CAP} s (default {OBJECT_BACKOFF}; Flower: 1, up to 10)",
    )
    p.add_argument(
        "--task-poll-interval",
        type=_seconds,
        default=None,
        help=f"the SuperExec's poll for tasks (default: ${TASK_POLL_ENV} if set, else "
        f"{TASK_POLL}; Flower: 1)",
    )
    p.add_argument(
        "--active-task-poll",
        type=_seconds,
        default=ACTIVE_TASK_POLL,
        help=f"the task poll for {ACTIVE_WINDOW:g} s after a task, with the prestarted "
        f"launcher (default {ACTIVE_TASK_POLL}; the task-poll interval or more: off)",
    )
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="prestarted",
        help="how the SuperExec starts a ClientApp process: forked from a prestarted "
        "one (fedpers.launcher; default) or Flower's fresh process per message",
    )
    p.add_argument(
        "--flower-waits", action="store_true", help="keep all of Flower's waits (3, 0.5, 1, 1)"
    )
    p.add_argument(
        "--flower-defaults",
        action="store_true",
        help="Flower's SuperNode as it ships: --flower-waits and --launcher flower",
    )
    return p


def _check_source(module: ModuleType, pull: Any) -> None:
    """Refuse to start if Flower's SuperNode no longer waits with the literals this
    command replaces: a silent no-op would claim speed it does not give."""
    source = inspect.getsource(module)
    missing = [literal for literal in ("time.sleep(3)", "time.sleep(0.5)") if literal not in source]
    defaults = pull.__kwdefaults__ or {}
    if "initial_backoff" not in defaults or "backoff_cap" not in defaults:
        missing.append("pull_objects(initial_backoff=..., backoff_cap=...)")
    if missing:
        import flwr

        raise SuperNodeWaitError(
            f"flwr {flwr.__version__}'s SuperNode has no {', '.join(missing)} "
            f"({module.__file__}): fedpers-supernode knows Flower 1.42's waits. Run "
            "flower-supernode itself, or install the flwr version of constraints.txt"
        )


class SuperExecCommand:
    """``subprocess`` as ``start_client_internal`` sees it: ``Popen(["flower-superexec",
    ...])`` starts ``python -m fedpers.launcher superexec ...`` (Flower's SuperExec with
    the prestarted launcher) with the same arguments; every other call is
    ``subprocess``'s own."""

    def Popen(self, command: Sequence[str], *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        if list(command[:1]) == [SUPEREXEC]:
            command = [sys.executable, "-m", "fedpers.launcher", "superexec", *command[1:]]
        return subprocess.Popen(command, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


def use_prestarted_launcher() -> None:
    """Make this process's SuperNode start fedpers' SuperExec (``fedpers.launcher``).

    Raises
    ------
    SuperNodeWaitError
        If Flower's SuperNode no longer starts ``flower-superexec`` where this expects.
    """
    from flwr.supernode import start_client_internal as loop

    if f'command = ["{SUPEREXEC}"]' not in inspect.getsource(loop):
        import flwr

        raise SuperNodeWaitError(
            f"flwr {flwr.__version__}'s SuperNode does not start {SUPEREXEC} where "
            f"fedpers-supernode expects ({loop.__file__}): run it with --launcher flower, "
            "or install the flwr version of constraints.txt"
        )
    loop.subprocess = SuperExecCommand()  # type: ignore[assignment]


def install(poll: float, reply_poll: float, backoff: float, backoff_cap: float) -> None:
    """Set the waits in this process's SuperNode modules."""
    from flwr.supercore.inflatable import inflatable_utils
    from flwr.supernode import start_client_internal as loop

    _check_source(loop, inflatable_utils.pull_objects)
    loop.time = Waits(poll, reply_poll)  # type: ignore[assignment]
    set_object_backoff(backoff, backoff_cap)  # the loop's pull_objects is that function


def main(argv: Sequence[str] | None = None) -> None:
    """Set the waits, then run ``flower-supernode`` with the other arguments."""
    args, rest = parser().parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if args.flower_defaults:
        args.flower_waits, args.launcher = True, "flower"
    if args.flower_waits:
        waits = (FLOWER_POLL, FLOWER_REPLY_POLL, FLOWER_OBJECT_BACKOFF, FLOWER_OBJECT_BACKOFF_CAP)
        task_poll = os.environ.get(TASK_POLL_ENV, str(FLOWER_TASK_POLL))
    else:
        cap = max(OBJECT_BACKOFF_CAP, args.object_backoff)
        waits = (args.poll_interval, args.reply_poll, args.object_backoff, cap)
        given = args.task_poll_interval
        task_poll = str(given) if given else os.environ.get(TASK_POLL_ENV, str(TASK_POLL))
    install(*waits)
    os.environ.pop(ACTIVE_TASK_POLL_ENV, None)
    if args.launcher == "prestarted":
        use_prestarted_launcher()
        if not args.flower_waits and args.active_task_poll < float(task_poll):
            check_task_poll_source()
            os.environ[ACTIVE_TASK_POLL_ENV] = str(args.active_task_poll)
    os.environ[TASK_POLL_ENV] = task_poll  # the SuperExec it starts inherits both
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()


if __name__ == "__main__":
    main()
