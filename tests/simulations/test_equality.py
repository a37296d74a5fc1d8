"""A client's result does not depend on its cohort: every row (and every deep row's linear
variant, ``<row>-linear``), one round (two where state carries over), the batched
engine's cohort against the per-client path (each client alone, what a device runs), in
float64: the global state, every client's personal state and every metric equal to 1e-5
(relative). Each comparison is shown to fail when two clients' seeds, or data, are
swapped in the cohort (``simulations.equality``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpers.simulations import equality


@pytest.mark.parametrize("row", equality.rows())
def test_a_cohort_gives_each_client_its_result_alone(row: str, tmp_path: Path) -> None:
    overrides = {**equality.case(row), "run-name": row}
    alone = equality.outcome(overrides, tmp_path / "alone", cohort_size=1, dtype="float64")
    together = equality.outcome(overrides, tmp_path / "together", dtype="float64")
    assert equality.difference(alone, together) < equality.TOLERANCE
    for what in ("seed", "data"):
        with equality.swapped(what):
            control = equality.outcome(overrides, tmp_path / what, dtype="float64")
        assert equality.difference(alone, control) > equality.TOLERANCE, what
