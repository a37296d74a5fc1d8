"""What every script shares, without Flower: seeds and their statistics, the ways to set
a key and their order, bad input refused before anything starts, clean error lines."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fedpers.logs import one_line, strip_ansi
from fedpers.simulations import (
    conf,
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
from fedpers.simulations.flags import (
    add_key_flags,
    output_parser,
    parse_seeds,
    run_config_values,
    seeds_of,
    settings,
)
from fedpers.simulations.stats import add_statistics, percentile, seed_statistics

SCRIPTS = (
    fedrep_images,
    fedrep_linear,
    fedgmm_synthetic,
    fedgmm_ood,
    fedgmm_unseen,
    sheaf_shift,
    sheaf_bottleneck,
    robustness,
    tune,
)


def test_seeds_are_a_count_or_a_list() -> None:
    assert parse_seeds("3") == [0, 1, 2]
    assert parse_seeds("0,2,5") == [0, 2, 5]
    assert parse_seeds("7,") == [7]
    for bad, message in (
        ("0", "runs no seed"),
        ("-2", "runs no seed"),
        ("1,1", "distinct"),
        ("-1,", "non-negative"),
        ("a", "neither a count"),
        (",", "distinct"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse_seeds(bad)


def test_seed_statistics_agree_with_scipy() -> None:
    values = [0.8123, 0.8471, 0.8302]
    mean, std, (low, high) = seed_statistics(values)
    assert mean == pytest.approx(np.mean(values), rel=1e-14)
    assert std == pytest.approx(np.std(values, ddof=1), rel=1e-12)
    expected = stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
    assert (low, high) == pytest.approx(expected, rel=1e-12)
    one = seed_statistics([0.5])
    assert one[0] == 0.5
    assert math.isnan(one[1])
    assert all(math.isnan(b) for b in one[2])
    assert seed_statistics([None, 0.25, float("nan"), 0.75])[0] == 0.5  # missing left out


def test_statistics_keep_the_nesting_of_the_figures() -> None:
    summary: dict[str, object] = {}
    add_statistics(summary, "auroc", {"rot90": {"fedgmm": [0.9, 1.0]}}, per_seed_key=None)
    assert summary["auroc"] == {"rot90": {"fedgmm": pytest.approx(0.95)}}
    assert summary["auroc_std"] == {"rot90": {"fedgmm": pytest.approx(np.std([0.9, 1], ddof=1))}}
    assert len(summary["auroc_ci95"]["rot90"]["fedgmm"]) == 2  # type: ignore[index]
    assert summary["auroc_per_seed"] == {"rot90": {"fedgmm": [0.9, 1.0]}}
    assert percentile([0.1, 0.2, 0.3, 0.4], 10) == pytest.approx(
        np.percentile([0.1, 0.2, 0.3, 0.4], 10)
    )


def _parser(script: dict[str, object]) -> argparse.ArgumentParser:
    parser = output_parser("test")
    add_key_flags(
        parser, ["num-rounds", "lr", "joint-shift"], script, aliases={"num-rounds": "rounds"}
    )
    return parser


def test_a_later_way_of_setting_a_key_wins(tmp_path: Path) -> None:
    file = tmp_path / "x.toml"
    file.write_text("# a comment\nlr = 0.2\nnum-rounds = 7\nfraction-train = 0.5\n")
    script = {"lr": 0.01, "num-rounds": 100, "epochs": 3}
    args = _parser(script).parse_args(
        [
            "--out",
            "o",
            "--quick",
            "--run-config",
            str(file),
            "--run-config",
            "lr=0.3",
            "--rounds",
            "9",
        ]
    )
    values = settings(args, script, {"num-rounds": 4, "epochs": 1})
    # script < --quick < --run-config (in order) < flags named after the key
    assert values == {"lr": 0.3, "num-rounds": 9, "epochs": 1, "fraction-train": 0.5}
    args = _parser(script).parse_args(["--out", "o", "--joint-shift", "true"])
    assert settings(args, script)["joint-shift"] is True


def test_seeds_from_flags_the_run_config_or_the_scripts_default() -> None:
    parser = output_parser("test", seeds="3", quick_seeds="1")
    assert seeds_of(parser.parse_args(["--out", "o"])) == [0, 1, 2]
    assert seeds_of(parser.parse_args(["--out", "o", "--quick"])) == [0]
    assert seeds_of(parser.parse_args(["--out", "o", "--seeds", "4,5"])) == [4, 5]
    assert seeds_of(parser.parse_args(["--out", "o", "--seed", "9"])) == [9]
    assert seeds_of(parser.parse_args(["--out", "o", "--run-config", "seed=6"])) == [6]


def test_bad_run_config_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(
        SystemExit, match="'num-round' is not a run-config key; did you mean 'num-rounds'"
    ):
        run_config_values(["num-round=3"])
    with pytest.raises(SystemExit, match="not Flower's"):
        run_config_values(["lr=='x"])
    with pytest.raises(SystemExit, match=r"missing\.toml"):
        run_config_values([str(tmp_path / "missing.toml")])
    nested = tmp_path / "pyproject-like.toml"
    nested.write_text('[tool.flwr.app.config]\nalgorithm = "fedper"\n')
    assert run_config_values([str(nested)]) == {"algorithm": "fedper"}


def test_a_long_inline_run_config_is_parsed_not_taken_for_a_file_name() -> None:
    # Longer than a file name may be (255 bytes): the file check must not raise
    # ENAMETOOLONG before the string is read as Flower's "key=value ..."
    given = {"algorithm": "fedrep", "num-clients": 1000, "lr": 0.05, "run-name": "r" * 250}
    text = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in given.items())
    assert len(text) > 255
    assert run_config_values([text]) == given


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_script_takes_the_common_flags(
    script: object, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--help"])  # type: ignore[attr-defined]
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--seeds", "--run-config", "--gpus-per-client", "--cpus-per-client", "--quick"):
        assert flag in text


def test_bad_input_fails_before_anything_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit):  # argparse: --seeds 0 runs nothing (was a KeyError)
        sheaf_shift.main(["--out", str(out), "--seeds", "0"])
    with pytest.raises(SystemExit, match="data-root '/nonexistent/root' is not a directory"):
        fedrep_images.main(
            ["--out", str(out), "--dataset", "mnist", "--data-root", "/nonexistent/root"]
        )
    with pytest.raises(SystemExit, match="'data-root' is empty"):
        fedrep_images.main(["--out", str(out), "--dataset", "cifar10"])
    with pytest.raises(SystemExit, match="gpus-per-client must be 0 or more"):
        fedgmm_synthetic.main(["--out", str(out), "--gpus-per-client", "-1"])
    with pytest.raises(SystemExit, match="is not a run-config key"):
        fedgmm_unseen.main(["--out", str(out), "--run-config", "sheaf-lamda=0.1"])
    with pytest.raises(SystemExit, match="is not a float"):
        tune.main(["--out", str(out), "--key", "lr", "--values", "0.1,fast"])
    assert not out.exists()


def test_tune_picks_the_best_finite_score_and_reads_dotted_metrics() -> None:
    assert tune.choose({"0.1": 0.5, "0.3": 0.7, "1": float("nan")}, minimize=False) == "0.3"
    assert tune.choose({"0.1": 0.5, "0.3": 0.5}, minimize=False) == "0.1"  # first listed
    assert tune.choose({"a": 0.2, "b": 0.1}, minimize=True) == "b"
    summary = {"communication_accuracy": {"pilots": 0.6}, "final_accuracy": None}
    assert tune.metric_of(summary, "communication_accuracy.pilots") == 0.6
    assert math.isnan(tune.metric_of(summary, "final_accuracy"))
    assert math.isnan(tune.metric_of(summary, "nothing.here"))
    assert tune.parse_values("sheaf-lambda", "0.01, 0.1") == [0.01, 0.1]
    with pytest.raises(SystemExit, match="not a setting to tune"):
        tune.parse_values("seed", "1,2")


def test_the_paper_configurations_are_generated_from_the_scripts() -> None:
    # conf/*.toml equal what the scripts run (a change to SETTINGS must regenerate them)
    assert conf.main(["--check"]) == 0
    for name in conf.EXPERIMENTS:
        assert (conf.CONF / f"{name}.toml").read_text() == conf.render(name)


def test_client_errors_become_one_clean_line() -> None:
    # the two ways Flower 1.42 wraps a ClientApp's exception (deployment, simulation)
    assert one_line("<class 'ZeroDivisionError'>:<'division by zero'>") == (
        "ZeroDivisionError: division by zero"
    )
    wrapped = (
        "<class 'flwr.clientapp.client_app.ClientAppException'>:<'\n"
        "Exception ClientAppException occurred. Message: partition 3 has no data'>"
    )
    assert one_line(wrapped) == "partition 3 has no data"
    trace = (
        'Traceback (most recent call last):\n  File "x.py", line 1\n\x1b[91mValueError: bad\x1b[0m'
    )
    assert one_line(trace) == "ValueError: bad"
    assert one_line("x" * 1000, limit=50) == "x" * 47 + "..."
    assert one_line(None) == ""
    assert strip_ansi("\x1b[92mINFO \x1b[0m: ok\x1b[?25h") == "INFO : ok"


def test_check_names_a_bad_key_and_prints_a_good_configuration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fedpers.simulations import check

    table2 = str(conf.CONF / "fedgmm_table2.toml")
    assert check.main(["--run-config", table2, "--run-config", "lr=2.0"]) == 0
    out = capsys.readouterr().out
    assert "lr = 2.0\n" in out
    assert 'num-supernodes=300"' in out
    assert check.main(["--run-config", "algorithm='fedrep' num-round=3"]) == 1
    assert "did you mean 'num-rounds'" in capsys.readouterr().err
    assert check.main(["--run-config", "num-rounds=0"]) == 1
    assert "'num-rounds'" in capsys.readouterr().err


def test_run_all_gives_the_directories_in_the_order_of_the_runs() -> None:
    # The scripts attach each directory to its method and seed by position: runs that
    # finish in another order (here the first finishes last) must not change that.
    import time

    from fedpers.simulations.launch import LocalSimulation

    names = ["run-d", "run-b", "run-c", "run-a"]  # neither sorted nor finishing in order

    class Timed(LocalSimulation):
        def run(self, overrides, **kwargs):  # type: ignore[no-untyped-def,override]
            time.sleep(0.05 * (3 - names.index(overrides["run-name"])))
            return Path(overrides["run-name"])

    runs = [{"run-name": name, "num-rounds": 1} for name in names]
    expected = [Path(name) for name in names]
    assert Timed().run_all(runs, parallel=4) == expected
    assert Timed().run_all(runs, parallel=1) == expected
