"""Every script entry point through a real `flwr run`: its first run goes through Flower
on Ray (the session's local SuperLink, tests/simulations/conftest.py) and again in
process beside it; both must write the same results (floats to 1e-9). This is what lets the
scripts' own tests (test_fedgmm_scripts.py, test_reproduction_scripts.py,
test_sheaf_scripts.py, test_robustness_script.py, test_tune.py) run their experiments in
process: the double gives what Flower gives. The other runs of a script here run in
process, in the script's smallest form; simulations.scale measures Flower itself and
runs through it in test_scale_quick.py."""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import pytest

from fedpers.reports import read_config
from fedpers.simulations import (
    fedgmm_ood,
    fedgmm_synthetic,
    fedgmm_unseen,
    fedrep_images,
    fedrep_linear,
    robustness,
    sheaf_bottleneck,
    sheaf_shift,
    tune,
)
from fedpers.simulations.launch import LocalSimulation
from tests.simulations.conftest import (
    FirstRunThroughFlower,
    assert_same_run,
    simulations_in_process,
)

pytestmark = pytest.mark.flower

TWO_ROUNDS = ["--quick", "--rounds", "2"]
# Each script in its smallest form, and the family of its first run.
SCRIPTS: dict[str, tuple[ModuleType, list[str], str]] = {
    "fedrep_images": (fedrep_images, ["--quick", "--seeds", "1", "--methods", "fedrep"], "fedrep"),
    "fedrep_linear": (
        fedrep_linear,
        [
            *("--clients", "10", "--rounds", "2", "--new-rounds", "2"),
            *("--new-train-clients", "10", "--m-new", "4", "--new-clients", "5", "--seeds", "1"),
        ],
        "fedrep",
    ),
    "fedgmm_synthetic": (fedgmm_synthetic, [*TWO_ROUNDS, "--methods", "fedgmm"], "fedgmm"),
    "fedgmm_ood": (fedgmm_ood, TWO_ROUNDS, "fedgmm"),
    "fedgmm_unseen": (fedgmm_unseen, TWO_ROUNDS, "fedgmm"),
    "sheaf_shift": (sheaf_shift, TWO_ROUNDS, "sheaf-frl"),
    "sheaf_bottleneck": (sheaf_bottleneck, TWO_ROUNDS, "sheaf-frl"),
    "robustness": (robustness, ["--quick", "--skip-attacks", "--parallel", "1"], "fedrep"),
    "tune": (
        tune,
        [
            *("--key", "lr", "--values", "0.05", "--run-config"),
            "algorithm='fedavg' dataset='digits' num-clients=4 num-rounds=2 final-rounds=1",
        ],
        "fedavg",
    ),
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_the_first_run_through_flower_equals_its_run_in_process(
    name: str, simulation: LocalSimulation, tmp_path: Path
) -> None:
    script, argv, algorithm = SCRIPTS[name]
    through = functools.partial(FirstRunThroughFlower, simulation)
    with simulations_in_process(through) as made:
        summary = script.main(["--out", str(tmp_path / "out"), *argv])
    assert summary
    assert (tmp_path / "out" / "summary.json").is_file()
    (simulation,) = made
    assert isinstance(simulation, FirstRunThroughFlower)
    (real, twin), *_ = simulation.twins
    assert len(simulation.twins) == 1
    assert real.is_relative_to(tmp_path / "out")
    assert read_config(real)["algorithm"] == algorithm
    assert_same_run(real, twin)
    # What went through Flower: its log, without terminal codes or a NaN progress line
    log = (real / "flower.log").read_text()
    assert "\x1b[" not in log
    assert "accuracy nan" not in log
