"""Where a deployed exchange's time goes on a device: tests/deployment/compose.py reads it
from a SuperNode's timestamped log (the Docker test records it in the deploy-test
summary); here against a log in Flower 1.42's format, without Docker."""

from __future__ import annotations

import pytest

from tests.deployment.compose import exchange_steps

# A SuperNode's `docker logs -t`, as Flower 1.42 writes it (colour codes included)
SUPERNODE_LOG = """\
2026-12-05T06:34:05.282308522Z \x1b[92mINFO \x1b[0m:      Receiving: query.info message (ID: a)
2026-12-05T06:34:05.500000000Z \x1b[92mINFO \x1b[0m:      Start `flwr-clientapp` process
2026-12-05T06:34:06.000000000Z \x1b[92mINFO \x1b[0m:      Sent successfully
2026-12-05T06:34:43.883421475Z \x1b[92mINFO \x1b[0m:      Receiving: train message (ID: b)
2026-12-05T06:34:43.900000000Z \x1b[92mINFO \x1b[0m:      Received successfully
2026-12-05T06:34:44.883421475Z \x1b[92mINFO \x1b[0m:      Start `flwr-clientapp` process
2026-12-05T06:34:47.383421475Z \x1b[92mINFO \x1b[0m:      Sent successfully
2026-12-05T06:34:48.000000000Z \x1b[92mINFO \x1b[0m:      Receiving: evaluate message (ID: c)
2026-12-05T06:34:48.250000000Z \x1b[92mINFO \x1b[0m:      Start `flwr-clientapp` process
2026-12-05T06:34:49.000000000Z \x1b[92mINFO \x1b[0m:      Sent successfully
2026-12-05T06:35:00.000000000Z \x1b[92mINFO \x1b[0m:      Receiving: train message (ID: d)
"""


def test_exchange_steps_reads_a_supernode_log() -> None:
    """Receipt -> launch -> reply for each train and evaluate message; a query message
    and a message without its reply yet are not counted."""
    steps = exchange_steps(SUPERNODE_LOG)
    assert set(steps) == {"train", "evaluate"}
    assert steps["train"]["launch"] == pytest.approx([1.0])
    assert steps["train"]["clientapp"] == pytest.approx([2.5])
    assert steps["evaluate"]["launch"] == pytest.approx([0.25])
    assert steps["evaluate"]["clientapp"] == pytest.approx([0.75])
