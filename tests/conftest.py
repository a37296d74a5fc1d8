"""Shared fixtures."""

import pytest

from tests.helpers import set_task_identity


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    set_task_identity()
