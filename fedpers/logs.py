"""Route fedpers' loggers through Flower's, so `flwr run --stream` shows them."""

from __future__ import annotations

import logging
import re

PACKAGES = ("fedpers", "strategies", "clients")


def route_to_flower(level: int = logging.INFO) -> None:
    """Give the project's loggers the handlers of Flower's ``flwr`` logger.

    Flower captures what its own handlers write and streams it to ``flwr run``; a
    plain ``logging.getLogger(__name__)`` elsewhere would be lost.
    """
    handlers = logging.getLogger("flwr").handlers
    for name in PACKAGES:
        package_logger = logging.getLogger(name)
        package_logger.handlers = list(handlers)
        package_logger.setLevel(level)
        package_logger.propagate = False


class ExplainedErrors(logging.Filter):
    """Flower logs an exception that ends a ServerApp with its traceback (``ServerApp
    raised an exception`` and 20 lines); for the errors whose message already says what
    was wrong and how to fix it (a bad key, a refused resume, too few nodes) the
    traceback only hides that line. This filter, on Flower's ``flwr`` logger, turns such
    a record into that one line: ``ServerApp stopped: ConfigError: ...``."""

    def __init__(self, explained: tuple[type[BaseException], ...]) -> None:
        super().__init__()
        self.explained = explained

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, self.explained):
            record.msg, record.args = "ServerApp stopped: %s: %s", (type(error).__name__, error)
            record.exc_info, record.exc_text = None, None
        return True


def explain_errors(explained: tuple[type[BaseException], ...]) -> None:
    """Install ``ExplainedErrors`` on Flower's logger (once per process)."""
    flower = logging.getLogger("flwr")
    for old in [f for f in flower.filters if isinstance(f, ExplainedErrors)]:
        flower.removeFilter(old)
    flower.addFilter(ExplainedErrors(explained))


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|NotFound)\b.*:")


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour and cursor codes (for files)."""
    return ANSI.sub("", text)


_FLOWER_REASON = re.compile(r"<class '([\w.]+)'>:<'(.*)'>", re.DOTALL)
_WRAPPED = re.compile(r"Exception ClientAppException occurred\. Message: (.*)", re.DOTALL)


def one_line(text: str | None, limit: int = 400) -> str:
    """A client's error as one clean line: no ANSI codes; Flower's wrapping
    (``<class 'ValueError'>:<'...'>``, and in simulation ``Exception
    ClientAppException occurred. Message: ...``) undone to ``ValueError: ...``; of a
    traceback only its last exception line; at most ``limit`` characters."""
    text = strip_ansi(text or "").strip()
    if match := _FLOWER_REASON.fullmatch(text):
        name, text = match.group(1).rsplit(".", 1)[-1], match.group(2).strip()
        if wrapped := _WRAPPED.search(text):
            text = wrapped.group(1).strip()
        elif name not in ("Exception", "ClientAppException"):
            text = f"{name}: {text}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    chosen = lines[-1]
    if len(lines) > 1:
        exceptions = [line for line in lines if _EXCEPTION_LINE.match(line)]
        chosen = exceptions[-1] if exceptions else lines[-1]
    return chosen if len(chosen) <= limit else chosen[: limit - 3] + "..."
