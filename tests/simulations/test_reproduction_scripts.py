"""The reproduction scripts in their --quick form: what they write, against the bounds the
issue states (loosened only where the quick form trains less). Their runs run in process,
each message through Flower's encoding (``on_the_wire``); the linear script's first run
also goes through a real `flwr run` and again in process, and both must write the same
results (``through_flower``, tests/simulations/conftest.py); the image table's through
Flower is tests/simulations/test_interrupt.py's, interrupted and resumed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats

from fedpers.data.registry import DATASETS, FASHION_MNIST_SYSTEM_DIR
from fedpers.reports import read_clients, read_rounds, read_summary
from fedpers.simulations import fedrep_images, fedrep_linear
from tests.simulations.conftest import (
    InProcessSimulation,
    assert_on_the_wire,
    assert_through_flower,
    script_runs,
)


@pytest.fixture(scope="module")
def linear_summary(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("linear")
    with script_runs(request) as twins:
        summary = fedrep_linear.main(["--out", str(out), "--quick"])
    assert (out / "figure4.png").exists()
    assert (out / "figure3_n100.png").exists()
    assert_through_flower(twins, out)
    # Each curve of FedRep's Figure 3 is the algorithm its legend names: FedRep with
    # exact heads, 1 or 10 head gradient steps, and FedSGD (the paper's, not the script's
    # table); Figure 4's two methods likewise.
    expected = {
        "fedrep": ("fedrep", 0),
        "gd-gd": ("fedrep", 1),
        "10gd-gd": ("fedrep", 10),
        "fedsgd": ("fedsgd", 0),
    }
    runs = sorted(p.parent for p in (out / "runs").glob("*/config.json"))
    assert len(runs) == 10, [r.name for r in (out / "runs").iterdir()]  # 4 x 2 n + 2, a seed
    for run in runs:
        config = json.loads((run / "config.json").read_text())
        figure, method = run.name.split("-")[0], run.name.split("-")[1]
        method = "10gd-gd" if method == "10gd" else "gd-gd" if method == "gd" else method
        if figure == "figure3":
            assert (config["algorithm"], config["linear-head-steps"]) == expected[method]
        else:
            assert config["algorithm"] == method
    return summary


# The three tests of the linear script share one run of it: on one worker.
linear = pytest.mark.xdist_group("linear")


@pytest.mark.flower
@pytest.mark.twin
@linear
def test_linear_fedrep_reaches_0_01_at_n_100(linear_summary: dict[str, Any]) -> None:
    first = linear_summary["rounds_to_0.01"]["fedrep"]["100"]
    assert first is not None
    assert math.isfinite(first)  # NaN: no seed reached it
    assert first <= 60
    assert linear_summary["principal_angle_distance"]["fedrep"]["100"] < 1e-2


@pytest.mark.flower
@pytest.mark.twin
@linear
def test_fedsgd_stays_10x_farther_than_fedrep(linear_summary: dict[str, Any]) -> None:
    # At n = 100. With n = 10 one client trains per round: FedRep needs the full 200
    # rounds (not the quick 60) to reach its noise floor; the full run checks every n.
    distance = linear_summary["principal_angle_distance"]
    assert distance["fedsgd"]["100"] >= 10 * distance["fedrep"]["100"]
    assert distance["fedsgd"]["10"] > distance["fedrep"]["10"]


@pytest.mark.flower
@pytest.mark.twin
@linear
def test_new_clients_need_few_samples_with_the_fedrep_representation(
    linear_summary: dict[str, Any],
) -> None:
    mse = linear_summary["new_client_mse"]
    for m_new in ("4", "10"):  # 2k <= m_new <= d/2 with d = 20, k = 2
        assert 30 * mse["fedrep"][m_new] <= mse["local"][m_new]
        assert 30 * mse["fedrep"][m_new] <= mse["fedsgd"][m_new]


@pytest.mark.script
def test_image_table_quick(tmp_path: Path, on_the_wire: list[InProcessSimulation]) -> None:
    out = tmp_path / "images"
    # Four of the table's rows, two seeds (the other rows run in process against the
    # real ClientApp in tests/strategies/test_faults.py and tests/clients).
    methods = ["fedrep", "fedavg", "fedavg-ft", "local"]
    summary = fedrep_images.main(
        ["--out", str(out), "--quick", "--seeds", "2", "--methods", ",".join(methods)]
    )
    final = summary["final_accuracy"]
    assert set(final) == set(methods)
    assert summary["seeds"] == [0, 1]
    assert all(0.0 <= v <= 1.0 for v in final.values())
    assert final["fedrep"] > 0.2
    # Fine-tuning the head on a client's 2 classes helps even after 4 rounds.
    assert final["fedavg-ft"] > final["fedavg"] + 0.1
    for m in methods:
        run = "fedavg-ft" if m == "fedavg" else m  # FedAvg's figures: before fine-tuning
        runs = [read_summary(out / "runs" / f"{run}-seed{s}") for s in (0, 1)]
        key = "final_accuracy" if m != "fedavg" else "final_accuracy_before_finetune"
        per_seed = [r[key] for r in runs]
        # Oracles: the run summaries, numpy and scipy
        assert summary["per_seed"][m] == per_seed
        assert final[m] == pytest.approx(np.mean(per_seed), rel=1e-12)
        assert summary["final_accuracy_std"][m] == pytest.approx(np.std(per_seed, ddof=1))
        low, high = stats.t.interval(0.95, 1, loc=np.mean(per_seed), scale=stats.sem(per_seed))
        assert summary["final_accuracy_ci95"][m] == pytest.approx([low, high])
        clients = summary["per_client"][m]
        assert len(clients) == 20  # every client of the first seed
        assert summary["client_p10"][m] == pytest.approx(np.percentile(list(clients.values()), 10))
        assert summary["megabytes_total"][m] >= 0
    # the last evaluated round's per-client accuracies average to the run's last figure
    rounds = read_rounds(out / "runs" / "fedrep-seed0")
    rows = read_clients(out / "runs" / "fedrep-seed0")
    last = rows[-1]["clients"]
    weights = np.array([v["num-examples"] for v in last.values()])
    values = np.array([v["accuracy"] for v in last.values()])
    assert float(weights @ values / weights.sum()) == pytest.approx(
        rounds[-1].evaluate["accuracy"], rel=1e-12
    )
    # FedRep sends only its body; Local sends nothing to train
    assert summary["megabytes_total"]["local"] < summary["megabytes_total"]["fedrep"]
    assert summary["megabytes_total"]["fedrep"] < summary["megabytes_total"]["fedavg"]
    table = (out / "table.md").read_text()
    assert all(f"| {m} |" in table for m in methods)
    assert " ± " in table
    assert "95% interval" in table
    for plot in ("accuracy.png", "clients.png"):
        assert (out / plot).stat().st_size > 1000
    assert_on_the_wire(on_the_wire, out)


@pytest.mark.script
@pytest.mark.skipif(
    not Path(FASHION_MNIST_SYSTEM_DIR).is_dir(),
    reason="Debian's dataset-fashion-mnist is not installed (.ci/run installs it)",
)
def test_image_table_quick_on_fashion_mnist(tmp_path: Path) -> None:
    """The real-image table's quick form on the batched engine (the loader, partition and
    MLP are the Flower path's: the same ClientApp runs in process)."""
    out = tmp_path / "fashion"
    flags = ["--quick", "--dataset", "fashion-mnist", "--engine", "batched", "--seed", "0"]
    summary = fedrep_images.main(["--out", str(out), *flags, "--methods", "fedrep"])
    config = json.loads((out / "runs" / "fedrep-seed0" / "config.json").read_text())
    assert (config["dataset"], config["model"]) == ("fashion-mnist", "auto")
    assert DATASETS["fashion-mnist"].default_model == "femnist-mlp"  # what "auto" builds
    assert (summary["clients"], summary["classes_per_client"]) == (100, 2)
    rounds = read_rounds(out / "runs" / "fedrep-seed0")
    assert [r.sampled for r in rounds] == [5, 5, 5]
    # Every client evaluated every round on its own 2 kinds of clothing; after 15 client
    # updates (5 of 100 a round, 3 rounds) the clients that trained their head (10
    # epochs on 600 images) hold it at 80 % or more, the others near chance or below.
    last = read_clients(out / "runs" / "fedrep-seed0")[-1]["clients"]
    assert len(last) == 100
    assert sum(v["accuracy"] >= 0.8 for v in last.values()) >= 10
    assert sum(v["num-examples"] for v in last.values()) == 10000  # the whole test split
    assert (out / "accuracy.png").stat().st_size > 1000


def test_bad_arguments_fail_before_anything_runs(tmp_path: Path) -> None:
    out = tmp_path / "kept"
    out.mkdir()
    (out / "precious.txt").write_text("results of an earlier run")
    with pytest.raises(SystemExit, match="not empty; pass --overwrite"):
        fedrep_images.main(["--out", str(out), "--quick"])
    with pytest.raises(SystemExit, match="'classes-per-client' = 11 must be between 1 and the 10"):
        fedrep_images.main(["--out", str(tmp_path / "new"), "--classes-per-client", "11"])
    assert (out / "precious.txt").read_text() == "results of an earlier run"
    assert not (tmp_path / "new").exists()


def test_overwrite_deletes_only_a_folder_a_script_made(tmp_path: Path) -> None:
    from fedpers.simulations.runs import MARKER, prepare_output

    foreign = tmp_path / "checkout"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("precious")
    with pytest.raises(SystemExit, match="deletes only an output directory"):
        prepare_output(foreign, overwrite=True)
    assert (foreign / "keep.txt").read_text() == "precious"
    made = prepare_output(tmp_path / "out", overwrite=False)
    assert (made / MARKER).is_file()
    (made / "old.json").write_text("{}")
    again = prepare_output(made, overwrite=True)
    assert not (again / "old.json").exists()
