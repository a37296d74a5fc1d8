"""simulations.paper_order: Kendall's tau and the flipped pairs against a count of
concordant and discordant pairs done here (hypothesis), the paired interval against
scipy's t interval, and its refusals."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from fedpers.simulations import paper_order
from fedpers.simulations.paper_order import PAPER_COLUMNS, compare

ROWS = list(PAPER_COLUMNS["fedrep-cifar10"])


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.floats(0, 100, allow_nan=False), min_size=len(ROWS), max_size=len(ROWS), unique=True
    ),
    st.lists(st.floats(0, 1, allow_nan=False), min_size=len(ROWS), max_size=len(ROWS), unique=True),
    st.integers(2, len(ROWS)),
)
def test_tau_and_flips_count_the_discordant_pairs(
    paper_values: list[float], our_values: list[float], count: int
) -> None:
    paper = dict(zip(ROWS, paper_values, strict=True))
    ours = dict(zip(ROWS[:count], our_values[:count], strict=True))
    result = compare(paper, ours)
    pairs = list(itertools.combinations(ROWS[:count], 2))
    discordant = sum((paper[a] > paper[b]) != (ours[a] > ours[b]) for a, b in pairs)
    concordant = len(pairs) - discordant  # no ties: the values are distinct
    assert result["kendall_tau"] == pytest.approx((concordant - discordant) / len(pairs))
    assert len(result["flips"]) == discordant
    for flip in result["flips"]:
        assert paper[flip["paper_above"]] > paper[flip["paper_below"]]
        assert ours[flip["paper_above"]] < ours[flip["paper_below"]]
        assert flip["paper_gap"] > 0 > flip["our_gap"]
    assert result["paper_order"] == sorted(ours, key=lambda r: -paper[r])
    assert result["our_order"] == sorted(ours, key=lambda r: -ours[r])


def test_a_flip_carries_the_paired_interval_over_seeds() -> None:
    paper = {"local": 89.79, "fedrep": 87.70, "fedavg": 42.65}
    per_seed = {"local": [0.80, 0.82, 0.81], "fedrep": [0.85, 0.88, 0.86], "fedavg": [0.5] * 3}
    ours = {k: float(np.mean(v)) for k, v in per_seed.items()}
    result = compare(paper, ours, per_seed)
    (flip,) = result["flips"]
    assert (flip["paper_above"], flip["paper_below"]) == ("local", "fedrep")
    differences = np.subtract(per_seed["local"], per_seed["fedrep"])
    expected = stats.t.interval(0.95, 2, loc=differences.mean(), scale=stats.sem(differences))
    assert flip["our_ci95"] == pytest.approx(list(expected))
    assert result["kendall_tau"] == pytest.approx(1 / 3)  # 2 concordant, 1 discordant
    text = paper_order.report(result, paper, ours)
    assert "local > fedrep" in text
    assert "(within noise)" not in text  # the interval lies below 0


def test_bad_summaries_are_refused_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "summary.json"
    broken.write_text("{not json")
    with pytest.raises(SystemExit):
        paper_order.main([str(broken)])
    assert "is not a summary.json of simulations.fedrep_images" in capsys.readouterr().err
    broken.write_text(json.dumps({"final_accuracy": {"fedrep": 0.8, "mine": 0.7}}))
    with pytest.raises(SystemExit):
        paper_order.main([str(broken)])
    assert "at least two are needed" in capsys.readouterr().err
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"final_accuracy": {"fedrep": 0.8, "fedavg": 0.5, "local": 0.9}}))
    out = tmp_path / "order.md"
    result = paper_order.main([str(good), "--paper", "fedrep-femnist", "--out", str(out)])
    assert result["kendall_tau"] == pytest.approx(1 / 3)  # only Local > FedRep flips
    assert "Kendall's tau-b over 3 rows" in out.read_text()
