"""Flower's log of a ServerApp that ends on an explained error: one line, no traceback
(fedpers.logs.ExplainedErrors); any other error keeps its traceback."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from fedpers.config import ConfigError
from fedpers.logs import ExplainedErrors, explain_errors


@pytest.fixture
def flower_log() -> Iterator[io.StringIO]:
    """Flower's ``flwr`` logger writing to a buffer, its filters restored after."""
    flower = logging.getLogger("flwr")
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    filters = list(flower.filters)
    flower.addHandler(handler)
    try:
        yield buffer
    finally:
        flower.removeHandler(handler)
        flower.filters[:] = filters


def _raised(error: Exception) -> Exception:
    try:
        raise error
    except Exception as caught:
        return caught


def test_an_explained_error_is_one_line(flower_log: io.StringIO) -> None:
    explain_errors((ConfigError,))
    explain_errors((ConfigError,))  # installed once, however often it is called
    assert sum(isinstance(f, ExplainedErrors) for f in logging.getLogger("flwr").filters) == 1
    error = _raised(ConfigError("run-config key 'x' = 1 is bad; set it to 2"))
    # as flwr-serverapp logs it (flwr.superlink.runtime.run_serverapp)
    logging.getLogger("flwr").error("%s raised an exception", "ServerApp", exc_info=error)
    assert flower_log.getvalue() == (
        "ServerApp stopped: ConfigError: run-config key 'x' = 1 is bad; set it to 2\n"
    )


def test_any_other_error_keeps_its_traceback(flower_log: io.StringIO) -> None:
    explain_errors((ConfigError,))
    error = _raised(KeyError("a bug"))
    logging.getLogger("flwr").error("%s raised an exception", "ServerApp", exc_info=error)
    text = flower_log.getvalue()
    assert text.startswith("ServerApp raised an exception\nTraceback")
    assert text.rstrip().endswith("KeyError: 'a bug'")
