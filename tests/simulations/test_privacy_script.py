"""simulations.privacy --quick: the privacy-utility grid's summary, checked against the
runs it read, a second accountant (Opacus' PRV) and scipy; its first run's configuration
goes through a real flwr run, the rest run in process (``through_flower``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fedpers.reports import read_summary
from fedpers.simulations import privacy
from tests.simulations.conftest import assert_through_flower


@pytest.mark.flower
@pytest.mark.twin
def test_privacy_quick(tmp_path: Path, through_flower: list[tuple[Path, Path]]) -> None:
    from opacus.accountants import PRVAccountant

    # Execute: two methods at epsilon 2 and without DP, Local as the floor, two seeds
    out = tmp_path / "privacy"
    summary = privacy.main(
        ["--out", str(out), "--quick", "--seeds", "2", "--methods", "fedrep,fedavg,local",
         "--epsilons", "2,inf"]
    )  # fmt: skip
    assert_through_flower(through_flower, tmp_path)
    # Assert: the summary's shape, as written
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert (out / "privacy.png").stat().st_size > 0
    assert "paired fedrep-local" in (out / "table.md").read_text()
    methods, epsilons = ["fedrep", "fedavg", "local"], ["2", "inf"]
    for m in methods:
        assert set(summary["final_accuracy"][m]) == set(epsilons)
        for e in epsilons:
            per_seed = summary["per_seed"][m][e]
            run = "inf" if m == "local" else e
            runs = [read_summary(out / "runs" / f"{m}-eps{run}-seed{s}") for s in (0, 1)]
            # Oracle: the run summaries, numpy
            assert per_seed == [r["final_accuracy"] for r in runs]
            assert summary["final_accuracy"][m][e] == pytest.approx(np.mean(per_seed), rel=1e-12)
            assert 0.0 <= summary["client_p10"][m][e] <= 1.0
    # Local runs once per seed and costs nothing at any epsilon
    assert summary["per_seed"]["local"]["2"] == summary["per_seed"]["local"]["inf"]
    assert summary["epsilon_spent"]["local"] == {"2": 0.0, "inf": 0.0}
    assert summary["mechanism"]["local"] == {"2": None, "inf": None}
    for m in ("fedrep", "fedavg"):
        # no DP at inf; at 2 the calibrated noise spends 2 (to the calibration's 0.1%)
        assert summary["mechanism"][m]["inf"] is None
        assert summary["epsilon_spent"][m]["inf"] == 0.0
        spent = summary["epsilon_spent"][m]["2"]
        assert 2.0 * 0.98 <= spent <= 2.0
        # the one-run audit beside the accountant (200 canaries): never above it
        assert 0.0 <= summary["audit_epsilon_lower"][m]["2"] <= spent
        assert summary["audit_epsilon_lower"][m]["inf"] is None
        mechanism = summary["mechanism"][m]["2"]
        assert mechanism["sampling"] == "poisson"
        assert mechanism["neighboring"] == "add-or-remove-one"
        assert (mechanism["population"], mechanism["sampling_rate"]) == (20, 0.5)
        assert mechanism["rounds"] == 3
        assert mechanism["delta"] == pytest.approx(20**-1.1)
        # Oracle: a second accountant recomputes the guarantee from the record alone
        accountant = PRVAccountant()
        accountant.history = [
            (mechanism["noise_multiplier"], mechanism["sampling_rate"], mechanism["rounds"])
        ]
        assert accountant.get_epsilon(delta=mechanism["delta"]) == pytest.approx(spent, rel=0.05)
    # Paired differences and their interval: numpy and scipy
    pairs = [("fedrep", "fedavg"), ("fedrep", "local"), ("fedavg", "local")]
    assert list(summary["paired"]) == [f"{a}-{b}" for a, b in pairs]
    for a, b in pairs:
        for e in epsilons:
            paired = summary["paired"][f"{a}-{b}"][e]
            difference = np.subtract(summary["per_seed"][a][e], summary["per_seed"][b][e])
            assert paired["per_seed"] == pytest.approx(difference.tolist(), rel=1e-12)
            low, high = stats.t.interval(
                0.95, 1, loc=difference.mean(), scale=stats.sem(difference)
            )
            assert paired["ci95"] == pytest.approx([low, high])
    for m in ("fedrep", "fedavg"):
        above = summary["paired"][f"{m}-local"]["2"]["ci95"][0] > 0
        assert summary["smallest_epsilon_above_local_by_method"][m] == ("2" if above else None)
    assert (
        summary["smallest_epsilon_above_local"]
        == (summary["smallest_epsilon_above_local_by_method"]["fedrep"])
    )


def test_bad_epsilons_are_refused_before_any_run(tmp_path: Path) -> None:
    for text, words in [
        ("0,inf", "above 0"),
        ("2,x", "not a number"),
        ("2,2", "twice"),
        (",", "empty"),
    ]:
        with pytest.raises(SystemExit, match=words):
            privacy.main(["--out", str(tmp_path / "p"), "--epsilons", text])
    assert not (tmp_path / "p").exists()


@pytest.mark.script  # the script's --quick form: make test, not make check
@pytest.mark.usefixtures("no_superlink")
def test_in_process_flag_runs_the_grid_without_flower(tmp_path: Path) -> None:
    from fedpers.simulations import launch, runs
    from fedpers.simulations.inprocess import InProcessSimulation

    # Execute: the non-private grid (only those runs repeat: DP noise is secret)
    out = tmp_path / "privacy"
    summary = privacy.main(
        ["--out", str(out), "--quick", "--seeds", "1", "--methods", "fedrep,local",
         "--epsilons", "inf", "--in-process", "--parallel", "2"]
    )  # fmt: skip
    # Oracle: the same configuration run in this process by InProcessSimulation
    config = json.loads((out / "runs" / "fedrep-epsinf-seed0" / "config.json").read_text())
    again = InProcessSimulation().run(
        {**config, "results-dir": str(tmp_path / "again"), "run-name": "fedrep"}
    )
    expected = read_summary(again)["final_accuracy"]
    assert summary["per_seed"]["fedrep"]["inf"] == [pytest.approx(expected, rel=1e-12)]
    # a run that fails ends the grid with its name (or, keeping going, is None)
    failing = [{**config, "results-dir": str(tmp_path / "f"), "run-name": "bad", "num-rounds": 0}]
    with pytest.raises(launch.FlowerRunError, match="'bad' did not finish"):
        runs.run_in_process_pool(failing, 1, keep_going=False)
    assert runs.run_in_process_pool(failing, 1, keep_going=True) == [None]
