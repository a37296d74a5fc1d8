"""Shared fixtures, and a guard on how xdist groups the tests."""

import logging
from collections.abc import Iterator

import pytest

from fedpers.logs import PACKAGES
from tests.helpers import set_task_identity


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    set_task_identity()


@pytest.fixture(autouse=True)
def _package_loggers() -> Iterator[None]:
    """Each test starts with the project's loggers as the last one found them.

    A ServerApp or ClientApp run in process (``route_to_flower``) stops them
    propagating to the root logger, where ``caplog`` listens: a later test in the same
    worker then saw no log line (test_resume's damaged-snapshot test failed in a full
    run, and passed alone).
    """
    loggers = [logging.getLogger(name) for name in PACKAGES]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    yield
    for lg, (handlers, level, propagate) in zip(loggers, saved, strict=True):
        lg.handlers, lg.level, lg.propagate = handlers, level, propagate


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse to run when `--dist loadgroup` would not keep an xdist_group on one worker.

    xdist marks a grouped test by appending "@group" to its node id after collection; the
    scheduler keeps ids with the same suffix on one worker. pytest 9.2 no longer reads the
    attribute xdist 3.8 writes, so every group was silently spread over both workers (two
    namespace tests ran side by side and each saw the other's firewall rule). The tests
    that need a group would then fail by chance, not by a bug: stop before any runs.
    """
    if not getattr(config.option, "loadgroup", False):
        return
    lost = [
        item.nodeid
        for item in items
        if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid
    ]
    if lost:
        raise pytest.UsageError(
            f"--dist loadgroup did not group {len(lost)} tests (first: {lost[0]}): this "
            "pytest and pytest-xdist do not work together; install the versions of "
            "constraints.txt (`make install`)"
        )
