"""simulations.step_cost runs its three ways and prints one row each (the figures
themselves are the benchmark's, not asserted); bad flags are refused before any work."""

from __future__ import annotations

import pytest

from fedpers.simulations import step_cost


def test_step_cost_prints_a_row_per_way_and_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    step_cost.main(["--reps", "1", "--cohort", "3", "--epochs", "1", "--samples", "25"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("digits-mlp, 25 samples, 1 epochs of batches of 10 (3 steps)")
    rows = {line[:16].strip(): line[16:].split() for line in out[2:5]}
    assert list(rows) == ["torch loop", "cohort of 1", "cohort of 3"]
    for values in rows.values():
        median, fastest, per_step = map(float, values)
        assert 0 < fastest <= median
        assert per_step > 0
    assert out[5].startswith("cohort of 1 / torch loop: ")


@pytest.mark.parametrize("flag", ["--reps", "--cohort", "--samples"])
def test_step_cost_refuses_a_count_below_one(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        step_cost.main([flag, "0"])
    assert f"{flag} must be at least 1" in capsys.readouterr().err
