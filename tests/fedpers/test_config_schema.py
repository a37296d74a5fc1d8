"""One schema: pyproject.toml, docs/configuration.md and the scripts' --help say what it
declares."""

import argparse
import dataclasses
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fedpers.config import (
    GROUPS,
    RunConfig,
    core_schema,
    declared_groups,
    default_run_config,
    markdown_reference,
    pyproject_table,
    schema,
    schema_defaults,
)
from fedpers.simulations.flags import config_help

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
REFERENCE = PYPROJECT.parent / "docs" / "configuration.md"
START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"


def test_every_key_is_in_exactly_one_group() -> None:
    per_group = [f.name for group in GROUPS.values() for f in dataclasses.fields(group)]
    assert len(per_group) == len(set(per_group))  # inheritance would merge a duplicate
    fields = [f.name for f in dataclasses.fields(RunConfig) if f.name != "groups"]
    assert per_group == fields
    assert [s.attribute for s in core_schema().values()] == per_group
    # the groups of families and rows: each key once across every group, and in the schema
    every = [f.name for group in declared_groups().values() for f in dataclasses.fields(group)]
    assert len(every) == len(set(every))
    assert [s.attribute for s in schema().values()] == every
    assert all(s.description and "\n" not in s.description for s in schema().values())


def test_the_defaults_are_the_dataclass_defaults_and_valid() -> None:
    defaults = RunConfig.from_mapping(schema_defaults())
    assert defaults == RunConfig(groups=defaults.groups)
    assert RunConfig().to_mapping() == schema_defaults()  # unparsed: every group's defaults
    assert defaults.to_mapping() == schema_defaults()


def test_pyproject_holds_the_schema_defaults_in_group_order() -> None:
    table = default_run_config(PYPROJECT)
    expected = schema_defaults()
    assert [(k, type(v), v) for k, v in table.items()] == [
        (k, type(v), v) for k, v in expected.items()
    ]
    # The whole table, group comments included, is what `python -m fedpers.config
    # pyproject` prints: regenerate it with that command.
    assert pyproject_table() in PYPROJECT.read_text()


def test_pyproject_table_parses_to_the_defaults() -> None:
    parsed = tomllib.loads(pyproject_table())["tool"]["flwr"]["app"]["config"]
    assert list(parsed.items()) == list(schema_defaults().items())


def test_docs_hold_the_configuration_reference() -> None:
    text = REFERENCE.read_text()
    assert text.count(START) == 1
    assert text.count(END) == 1
    between = text.split(START)[1].split(END)[0]
    # Regenerate with `python -m fedpers.config markdown` and paste between the markers.
    assert between.strip("\n") == markdown_reference().strip("\n")


def test_reference_has_a_row_per_key_with_enum_values() -> None:
    reference = markdown_reference()
    for key, setting in schema().items():
        (row,) = [line for line in reference.splitlines() if line.startswith(f"| `{key}` |")]
        assert f"| `{setting.toml_default}` |" in row
        assert all(f"`{choice}`" in row for choice in setting.choices)
    assert '| `partitioner` | str | `"classes"` | `classes`, `dirichlet`,' in reference


@pytest.mark.parametrize(
    ("command", "render"), [("pyproject", pyproject_table), ("markdown", markdown_reference)]
)
def test_command_prints_the_rendering(command: str, render: object) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fedpers.config", command],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert callable(render)
    assert result.stdout == render()


def test_config_help_shows_description_values_and_default() -> None:
    assert config_help("num-rounds") == (
        "communication rounds (run-config key 'num-rounds'; default 100)"
    )
    assert 'one of classes, dirichlet, lognormal, generated; default "classes")' in (
        config_help("partitioner")
    )
    with pytest.raises(KeyError, match="'rounds' is not a run-config key"):
        config_help("rounds")


def test_config_help_is_valid_argparse_help_for_every_key() -> None:
    parser = argparse.ArgumentParser()
    for key in schema():
        parser.add_argument(f"--{key}", help=config_help(key))
    text = " ".join(parser.format_help().split())
    assert "seconds to wait for a round's replies (run-config key 'round-timeout'" in text
