"""The ``fedpers`` command's help and errors: each subcommand's usage names it, ``run``
does not offer the ``--quick`` it refuses, a CONFIG.toml that is not there is named as
what it is (not as a --run-config item), an unknown command says which, and nothing is
written before an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpers.simulations import check, cli

CONF = Path(__file__).resolve().parents[2] / "conf" / "fedrep_table1.toml"


def test_each_subcommands_help_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("run", "check"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--help"])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: fedpers {command} [-h]"), out[:80]
        assert "CONFIG.toml" in out


def test_run_does_not_offer_quick_but_says_why_it_refuses_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert "--quick" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", str(CONF), "--out", str(tmp_path / "out"), "--quick"])
    assert exit_.value.code == 2
    assert "set num-rounds (and num-clients) to shrink it" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["run", "check"])
def test_a_missing_config_file_is_named_as_a_config_file(
    command: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = [command, str(tmp_path / "nosuch.toml"), "nosuch"]
    if command == "run":
        argv += ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"fedpers {command}: error: CONFIG.toml '{tmp_path / 'nosuch.toml'}', 'nosuch': " in err
    assert "no such file (relative paths are read from" in err
    assert "--run-config nosuch" not in err
    assert not (tmp_path / "out").exists()


def test_check_reads_positional_files_before_run_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main([str(CONF), "--run-config", "num-rounds=7"], prog="fedpers check") == 0
    out = capsys.readouterr().out
    assert "num-rounds = 7\n" in out
    assert 'algorithm = "fedrep"\n' in out


@pytest.mark.parametrize(("argv", "code"), [([], 2), (["frob"], 2), (["--help"], 0)])
def test_the_top_level_usage_lists_the_commands(
    argv: list[str], code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == code
    captured = capsys.readouterr()
    text = captured.out if code == 0 else captured.err
    assert "fedpers run CONFIG.toml ... --out DIR" in text
    assert "fedpers check CONFIG.toml ..." in text
    if argv == ["frob"]:
        assert "unknown command 'frob'; use run or check" in text
