"""Shared fixtures, and a guard on how xdist groups the tests."""

import logging
import os
from collections.abc import Iterator

import pytest

from fedpers.logs import PACKAGES
from fedpers.simulations.ray_cluster import RayHead
from tests.helpers import set_task_identity


@pytest.fixture(scope="session")
def ray_head() -> Iterator[RayHead]:
    """One Ray head for the session's real simulations on this xdist worker
    (``ray_cluster.RayHead``: each run would start and stop a Ray instance, 7 s of a
    small run's 17); checks that none of its processes is left after."""
    with RayHead(cpus=os.cpu_count() or 1) as head:
        yield head
    assert head.pids() == []


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
    """Tests that start Flower processes first; refuse to run when `--dist loadgroup`
    would not keep an xdist_group on one worker.

    The Flower tests take 20-110 s each, against seconds for almost all others, and
    xdist hands the tests out in this order (groups first), a few at a time to whichever
    worker is free: started first, they end while the short tests fill the other
    worker, and neither waits alone for a long test at the end (in file order they were
    spread over the second half of the files).

    xdist marks a grouped test by appending "@group" to its node id after collection; the
    scheduler keeps ids with the same suffix on one worker. pytest 9.2 no longer reads the
    attribute xdist 3.8 writes, so every group was silently spread over both workers (two
    namespace tests ran side by side and each saw the other's firewall rule). The tests
    that need a group would then fail by chance, not by a bug: stop before any runs.
    """
    # By file, so that a module's fixtures are set up once: files with a Flower test
    # first, each file's tests in their order (the sort is stable).
    flower_files = {item.path for item in items if item.get_closest_marker("flower")}
    items.sort(key=lambda item: item.path not in flower_files)
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
