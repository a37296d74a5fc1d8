"""Route fedpers' loggers through Flower's, so `flwr run --stream` shows them."""

from __future__ import annotations

import logging

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
