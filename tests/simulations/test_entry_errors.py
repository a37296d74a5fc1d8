"""Issue 46's entry points and configuration that ended in a traceback, validated and
failed later, or were ignored: each now one line naming the problem and the fix, before
anything is written. A regression suite of the inputs found; the generated cases are in
``test_run_config_items_are_taken_whole_or_refused``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedpers.atomic import save_npz
from fedpers.checkpoint import ResumeError
from fedpers.config import ConfigError, load_run_config
from fedpers.results import RunRecorder
from fedpers.simulations import check, cli
from fedpers.simulations.flags import run_config_values

CONF = Path(__file__).resolve().parents[2] / "conf" / "fedrep_table1.toml"


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


def test_out_that_is_a_file_or_cannot_be_made_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(SystemExit, match="is a file, not a folder; choose another --out"):
        cli.main(["run", str(CONF), "--out", str(afile)])
    assert afile.read_text() == "mine"
    blocked = tmp_path / "ro"
    blocked.mkdir()
    blocked.chmod(0o500)
    try:
        target = blocked / "sub" / "out"
        if os.access(blocked, os.W_OK):  # root writes anywhere: a path under a file then
            target = afile / "out"
        with pytest.raises(SystemExit, match="cannot be made or written"):
            cli.main(["run", str(CONF), "--out", str(target)])
    finally:
        blocked.chmod(0o700)


def test_check_of_a_binary_file_says_it_is_not_text(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    binary = tmp_path / "image.toml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    assert check.main([str(binary)], prog="fedpers check") == 1
    assert "not a text file (TOML is UTF-8 text)" in _one_line_error(capsys)


def test_a_top_level_key_beside_the_config_table_is_refused(tmp_path: Path) -> None:
    mixed = tmp_path / "mixed.toml"
    mixed.write_text('seed = 3\n[tool.flwr.app.config]\nalgorithm = "fedavg"\n')
    with pytest.raises(SystemExit, match=r"top-level key\(s\) \['seed'\] beside"):
        run_config_values([str(mixed)])
    # a pyproject.toml's other tables are not run config
    project = tmp_path / "pyproject.toml"
    project.write_text('[project]\nname = "x"\n[tool.flwr.app.config]\nseed = 3\n')
    assert run_config_values([str(project)]) == {"seed": 3}


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("num-rounds", r"\['num-rounds'\] not of the form key=value"),
        ("num-rounds=3 garbage", r"\['garbage'\] not of the form key=value"),
        ("/", "is a directory"),
    ],
)
def test_run_config_words_flower_would_drop_are_refused(item: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        run_config_values([item])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["num-rounds", "seed", "lr"]), st.integers(1, 99)),
        min_size=1,
        max_size=3,
        unique_by=lambda pair: pair[0],  # a key twice: Flower's TOML refuses it, clearly
    ),
    st.lists(st.text("abcxyz-_", min_size=1, max_size=6), max_size=2),
)
def test_run_config_items_are_taken_whole_or_refused(
    pairs: list[tuple[str, int]], words: list[str]
) -> None:
    """Generated ``key=value`` strings with stray words mixed in: every pair is taken,
    or, with any stray word, the item is refused."""
    parts = [f"{k}={v}" for k, v in pairs] + words
    item = " ".join(parts)
    if words:
        with pytest.raises(SystemExit, match="not of the form key=value"):
            run_config_values([item])
    else:
        assert run_config_values([item]) == dict(pairs)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"num-rounds": 2**63}, "does not fit a signed 64-bit integer"),
        ({"seed": -(2**63) - 1}, "does not fit a signed 64-bit integer"),
        ({"algorithm": "pfedme", "pfedme-beta": 1e300}, "'pfedme-beta' = 1e\\+300 must be"),
        ({"algorithm": "scaffold", "scaffold-server-lr": 1e300}, "at most 1000"),
        ({"dp": "central", "dp-server-lr": 1e300}, "'dp-server-lr'"),
        ({"lr": 5e3}, "'lr' = 5000.0 must be greater than 0 and at most 1000"),
        (
            {"algorithm": "clustered-fl", "num-clients": 4, "clustered-fl-max-clusters": 100000},
            "more clusters than 4 clients can form; give at most 16",
        ),
    ],
)
def test_settings_the_run_cannot_act_on_are_refused_before_it(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_run_config(values)


def test_the_largest_settings_still_accepted() -> None:
    assert load_run_config({"num-rounds": 2**63 - 1}).num_rounds == 2**63 - 1
    assert load_run_config({"lr": 1000.0}).lr == 1000.0
    load_run_config(
        {"algorithm": "clustered-fl", "num-clients": 40, "clustered-fl-max-clusters": 40}
    )


def test_arrays_named_like_numpys_options_are_saved(tmp_path: Path) -> None:
    """np.savez took 'file' for its argument (TypeError) and 'allow_pickle' for its
    option (the array silently left out: a checkpoint that could never be resumed)."""
    arrays = {"file": np.arange(3.0), "allow_pickle": np.ones((2, 2), np.float32)}
    save_npz(tmp_path / "a.npz", arrays)
    with np.load(tmp_path / "a.npz") as stored:
        assert sorted(stored.files) == ["allow_pickle", "file"]
        for name, value in arrays.items():
            assert np.array_equal(stored[name], value)
            assert stored[name].dtype == value.dtype


@pytest.mark.parametrize("text", ["[1, 2]", "{not json", '"a string"'])
def test_a_config_json_that_is_not_an_object_refuses_the_resume(tmp_path: Path, text: str) -> None:
    directory = tmp_path / "run"
    recorder = RunRecorder(
        directory, {"a": 1}, name="r", total_rounds=3, progress_metric="evaluate.accuracy"
    )
    recorder.release()
    (directory / "config.json").write_text(text)
    with pytest.raises(ResumeError, match=r"config\.json"):
        RunRecorder(
            directory,
            {"a": 1},
            name="r",
            total_rounds=3,
            progress_metric="evaluate.accuracy",
            resume_after=0,
        )
    failure = json.loads((directory / "failure.json").read_text())
    assert "config.json" in failure["reason"]
