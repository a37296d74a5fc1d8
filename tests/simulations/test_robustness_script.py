"""simulations.robustness in --quick form: the fuzz sweep's verdicts and the attack table's
shape, read from what the script wrote. Its runs run in process, each message through
Flower's encoding (``on_the_wire``, tests/simulations/conftest.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedpers.simulations import robustness
from tests.simulations.conftest import InProcessSimulation, assert_on_the_wire

pytestmark = pytest.mark.script


def test_robustness_quick(tmp_path: Path, on_the_wire: list[InProcessSimulation]) -> None:
    summary = robustness.main(["--out", str(tmp_path), "--quick", "--parallel", "3"])
    fuzz = summary["fuzz"]
    cases = json.loads((tmp_path / "cases.json").read_text())["cases"]
    assert fuzz["cases"] == len(cases) >= 20
    assert fuzz["families"] == ["fedavg", "fedgmm", "fedrep", "sheaf-frl"]
    assert fuzz["runs_crashed"] == 0
    assert fuzz["corrupt_states_adopted"] == 0
    # Every malformed reply was left out with a reason; the other attacks were accepted,
    # capped, or (the sign flip x100) left out by the update bound
    assert fuzz["malformed_not_rejected"] == []
    assert fuzz["unexpectedly_rejected"] == []
    expected = [c for c in cases if c["expect"] == "rejected"]
    bounded = [c for c in cases if c["expect"] == "bounded" and c["rejected"]]
    assert fuzz["replies_rejected"] == len(expected) + len(bounded)
    assert all(c["reason"] for c in expected)
    flips = [c for c in cases if c["kind"].startswith("sign-flip")]
    assert flips
    assert all(c["reason"].startswith("update norm") for c in flips if c["rejected"])
    assert all("capped at" in c["reason"] for c in cases if c["expect"] == "capped")
    # The reply sweep: 10 generated replies per family and phase, none breaking a
    # property; the run's flwr runs after it still finished (runs_crashed above)
    sweep = summary["sweep"]
    # 28 phases (training and evaluation of 14 federations: SCAFFOLD's, FedDyn's,
    # L2GD's, Fed-MTL's, FedAMP's, pFedHN's, pFedMe's, Clustered FL's, IFCA's and
    # FedProto's among them), 3 votes, FedGMM's 3 start-up statistics queries
    assert sweep["replies"] == len(sweep["by_case"]) * 10 == 340
    assert sweep["exceptions"] == 0
    assert sweep["violations"] == dict.fromkeys(sweep["violations"], 0)
    assert len(sweep["violations"]) == 4
    assert 0 < sweep["kept"] < sweep["replies"]
    assert set(summary["attack"]) == {"4", "10"}
    # 4 replies a round: the trimmed mean now cuts one value at each end
    assert set(summary["attack"]["4"]) == {"fedrep"}
    assert set(summary["attack"]["4"]["fedrep"]["sign-flip"]) == {"trimmed-mean"}
    attack = summary["attack"]["10"]
    for algorithm in ("fedrep", "fedavg"):
        entry = attack[algorithm]
        assert 0.0 < entry["clean"] <= 1.0
        robust = {"mean", "trimmed-mean"} if algorithm == "fedrep" else {"mean"}
        assert set(entry["sign-flip"]) == robust
        assert all(math.isfinite(v) for v in entry["sign-flip"].values())
    # The size cap: honest updates with inflated sizes weigh what they hold, so the
    # plain mean is the clean run's, to the bit.
    assert attack["fedrep"]["inflate-examples"] == {"mean": attack["fedrep"]["clean"]}
    # The attack over a run, quick form: SCAFFOLD, client 0 of 10 flipping every round
    scaffold = summary["exchanges"]["scaffold"]
    assert set(summary["exchanges"]) == {"scaffold"}
    assert (scaffold["num_rounds"], scaffold["stopped"]) == (2, [])
    for part in ("clean", "sign-flip"):
        assert scaffold[part]["rounds"] == {"mean": 2, "median": 2}
        assert all(0 < v <= 1 for v in scaffold[part]["accuracy"].values())
    # the flip reached the server's state under both
    assert scaffold["state_changed"] == {"mean": True, "median": True}
    table = (tmp_path / "table.md").read_text()
    assert "# Attacks over a run" in table
    assert table.startswith("# Fuzz sweep")
    assert "# Reply sweep (generated replies)" in table
    assert "| 4 | fedrep | sign-flip |" in table
    assert_on_the_wire(on_the_wire, tmp_path)
