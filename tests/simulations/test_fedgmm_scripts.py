"""FedGMM's reproduction scripts in --quick form, against the issue's bounds. Their runs run
in process, each message through Flower's encoding (``on_the_wire``); the unseen-clients
script's first run also goes through a real `flwr run` and again in process, and both must
write the same results (``through_flower``, tests/simulations/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpers.simulations import fedgmm_ood, fedgmm_synthetic, fedgmm_unseen
from tests.simulations.conftest import (
    InProcessSimulation,
    assert_on_the_wire,
    assert_through_flower,
)


@pytest.mark.script
def test_synthetic_table(tmp_path: Path, on_the_wire: list[InProcessSimulation]) -> None:
    summary = fedgmm_synthetic.main(["--out", str(tmp_path), "--quick"])
    final = summary["final_accuracy"]
    baselines = ("fedavg", "fedprox", "fedavg-plus", "clustered-fl", "pfedme-fedem", "pfedme")
    assert set(final) == {"fedgmm", "fedem", "local", *baselines}
    assert final["fedgmm"] >= final["fedem"] + 0.05
    # quick form, 2026-12-04: Clustered FL 49.77 % (eps2 3.2: no split in its rounds, one
    # cluster trained as FedAvg; tests/strategies/test_clustered.py checks the split),
    # pFedMe 58.52 %
    for baseline in baselines:
        assert final["fedgmm"] >= final[baseline] + 0.15
    # FedProx's mu = 0.001 is near FedAvg; adapting before the test helps on this data
    # (quick form, 2026-12-04: 49.77 / 49.73 / 52.39 %).
    assert abs(final["fedprox"] - final["fedavg"]) <= 0.05
    assert final["fedavg-plus"] >= final["fedavg"] + 0.01
    assert (tmp_path / "table.md").read_text().count("| fed") == 5
    assert_on_the_wire(on_the_wire, tmp_path)


@pytest.mark.script
def test_ood_detection(tmp_path: Path, on_the_wire: list[InProcessSimulation]) -> None:
    summary = fedgmm_ood.main(["--out", str(tmp_path), "--quick"])
    auroc = summary["auroc"]
    for transform in ("rot90", "invert"):
        assert auroc[transform]["fedgmm"] >= 0.9
        assert auroc[transform]["fedgmm"] > auroc[transform]["fedavg"]
    for metric in ("auroc", "ap", "max_f1"):
        assert set(summary[metric]) == {"rot90", "invert", "flip"}
        assert set(summary[metric]["flip"]) == {
            "fedgmm",
            "fedgmm-px",
            "fedem",
            "fedavg",
            "fedprox",
            "fedavg-plus",
        }
    for transform in ("rot90", "invert"):  # the global-model baselines score as FedAvg
        for baseline in ("fedprox", "fedavg-plus"):
            assert 0.3 <= auroc[transform][baseline] <= 1
            assert auroc[transform]["fedgmm"] > auroc[transform][baseline]
    assert (tmp_path / "scores.png").stat().st_size > 1000
    assert_on_the_wire(on_the_wire, tmp_path)


@pytest.mark.flower
@pytest.mark.twin
def test_unseen_clients(tmp_path: Path, through_flower: list[tuple[Path, Path]]) -> None:
    summary = fedgmm_unseen.main(["--out", str(tmp_path), "--quick"])
    seen, unseen = summary["seen_accuracy"], summary["unseen_accuracy"]
    assert set(seen) == set(unseen) == {"fedgmm", "fedem", "fedavg"}
    # 5 unseen clients in the quick form: a looser band than the full run's 5 points.
    assert abs(unseen["fedgmm"] - seen["fedgmm"]) <= 0.10
    assert unseen["fedgmm"] > unseen["fedavg"]
    assert_through_flower(through_flower, tmp_path)
