"""Configurations that used to validate and then fail in the run (on the server after
Ray started, or on every client) are refused by the configuration check, naming the
keys and the fix; the valid ones around them still pass, unchanged."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedpers.config import ConfigError, RunConfig, load_run_config, schema_defaults
from fedpers.faults import parse_faults
from fedpers.simulations import check


def _refused(overrides: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as error:
        load_run_config(overrides)
    return str(error.value)


# ------------------------------------------------------------------------- seed
def test_a_negative_seed_is_refused() -> None:
    message = _refused({"seed": -1})
    assert "'seed' = -1" in message
    assert "0 or more" in message
    assert load_run_config({"seed": 0}).seed == 0


# ------------------------------------------------------------------ min-replies
@pytest.mark.parametrize(
    ("overrides", "sampled"),
    [
        ({"num-clients": 100, "fraction-train": 0.1, "min-replies": 11}, 10),
        ({"num-clients": 10, "fraction-train": 0.01, "min-replies": 2}, 1),  # max(1, ...)
        (
            {
                "algorithm": "fedgmm",
                "num-clients": 20,
                "fraction-train": 0.5,
                "unseen-fraction": 0.5,
                "min-replies": 6,
            },
            5,  # half of the 10 seen clients
        ),
    ],
)
def test_min_replies_above_the_clients_a_round_trains_is_refused(
    overrides: dict[str, Any], sampled: int
) -> None:
    message = _refused(overrides)
    assert f"'min-replies' = {overrides['min-replies']}" in message
    assert f"the {sampled} clients" in message
    assert "'fraction-train'" in message
    assert load_run_config({**overrides, "min-replies": sampled}).min_replies == sampled


def test_min_replies_counts_every_agent_where_the_family_trains_them_all() -> None:
    agents = {"algorithm": "sheaf-frl", "dataset": "digits", "num-clients": 10}
    # Sheaf-FRL trains every agent each round, whatever fraction-train says
    assert load_run_config({**agents, "min-replies": 10}).min_replies == 10
    assert "'min-replies' = 11" in _refused({**agents, "min-replies": 11})


# ---------------------------------------------------------------- unseen-fraction
@pytest.mark.parametrize(
    "overrides",
    [
        {"algorithm": "fedgmm", "num-clients": 1, "unseen-fraction": 0.6},
        {"algorithm": "fedgmm", "num-clients": 100, "unseen-fraction": 0.996},
    ],
)
def test_unseen_fraction_that_leaves_no_seen_client_is_refused(overrides: dict[str, Any]) -> None:
    message = _refused(overrides)
    assert "'unseen-fraction'" in message
    assert "no seen client" in message
    assert "'num-clients'" in message


# ------------------------------------------------------------- data set capacity
@pytest.mark.parametrize(
    ("overrides", "pool"),
    [
        ({"dataset": "digits", "num-clients": 1348}, 1347),  # the training split
        ({"dataset": "digits", "num-clients": 1798, "test-split": "per-client"}, 1797),
        ({"dataset": "mnist", "num-clients": 60001, "data-root": "/data"}, 60000),
        ({"dataset": "femnist", "num-clients": 48001, "data-root": "/data"}, 48000),
        ({"dataset": "cifar10", "num-clients": 60001, "test-split": "per-client"}, 60000),
    ],
)
def test_more_clients_than_the_data_set_has_samples_is_refused(
    overrides: dict[str, Any], pool: int
) -> None:
    message = _refused(overrides)
    assert f"'num-clients' = {overrides['num-clients']}" in message
    assert f"{pool} samples" in message
    assert load_run_config({**overrides, "num-clients": pool}).num_clients == pool


def test_the_declared_sizes_are_those_the_loader_gives(tmp_path: Path) -> None:
    from fedpers.data.registry import DATASETS
    from fedpers.data.sources import load_dataset

    digits = load_dataset("digits", root=str(tmp_path), seed=3, train_size=0)
    assert (len(digits.y_train), len(digits.y_test)) == (
        DATASETS["digits"].train_samples,
        DATASETS["digits"].test_samples,
    )


def test_data_sets_that_grow_with_the_run_have_no_client_bound() -> None:
    # MNIST-1D is generated for num-clients x samples-per-client; the mixtures per client
    assert load_run_config({"num-clients": 5000, "samples-per-client": 1}).num_clients == 5000
    assert load_run_config({"dataset": "mixture", "num-clients": 5000}).num_clients == 5000


# ------------------------------------------------------------------ fault ranges
def test_a_billion_partition_fault_range_is_checked_without_a_list() -> None:
    spec = "nan:0-999999999"
    tracemalloc.start()
    started = time.monotonic()
    try:
        message = _refused({"fault-injection": spec})
        (fault,) = parse_faults(spec)
        inside = fault.applies(999_999_999, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 5.0
    assert peak < 5_000_000  # bytes: nothing proportional to a billion
    assert inside
    assert "'fault-injection'" in message
    assert "999999999" in message
    assert "0..99" in message  # the partitions of num-clients = 100


@pytest.mark.parametrize("spec", ["nan:100", "raise:98+100", "sign-flip=2:50-100"])
def test_a_fault_on_a_partition_the_run_does_not_have_is_refused(spec: str) -> None:
    message = _refused({"fault-injection": spec})
    assert f"entry '{spec}'" in message
    assert "'num-clients' = 100" in message
    assert load_run_config({"fault-injection": spec, "num-clients": 101}).num_clients == 101


@pytest.mark.parametrize(
    "spec", ["nan:٣", "nan:²", "nan:1@²", "nan:" + "9" * 5000, "nan:0-" + "9" * 30]
)
def test_fault_ids_are_plain_bounded_decimal_numbers(spec: str) -> None:
    with pytest.raises(ValueError, match="is not kind"):
        parse_faults(spec)


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet="0123456789-+@", max_size=40),
    st.integers(min_value=1, max_value=1000),
)
def test_a_fault_range_is_refused_or_within_the_run(text: str, num_clients: int) -> None:
    spec = f"nan:{text}"
    values = {**schema_defaults(), "fault-injection": spec, "num-clients": num_clients}
    try:
        config = RunConfig.from_mapping(values)
    except ConfigError:
        return
    for fault in parse_faults(config.fault_injection):
        for part in fault.partitions:
            assert 0 <= part.start <= part.stop - 1 <= num_clients - 1


# ------------------------------------------------------------------- TOML shape
@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('tool = "flwr"\n', "'tool' is a str, not a table"),
        ("[tool]\nflwr = 3\n", "'tool.flwr' is an int, not a table"),
        ("[tool.flwr]\napp = [1, 2]\n", "'tool.flwr.app' is an array, not a table"),
        ('[tool.flwr.app]\nconfig = "x"\n', "'tool.flwr.app.config' is a str, not a table"),
    ],
)
def test_a_toml_file_of_the_wrong_shape_is_refused_naming_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, fragment: str
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)

    status = check.main(["--run-config", str(path)])

    assert status == 1
    error = capsys.readouterr().err
    assert fragment in error
    assert str(path) in error
    assert "[tool.flwr.app.config]" in error  # the fix: where the keys go


# ------------------------------------------------------------ both key spellings
def test_a_key_given_in_both_spellings_is_refused_naming_both() -> None:
    values = {**schema_defaults(), "num_clients": 5}
    with pytest.raises(ConfigError) as error:
        RunConfig.from_mapping(values)
    assert "'num-clients'" in str(error.value)
    assert "'num_clients'" in str(error.value)
    assert "once" in str(error.value)
    # one spelling, either one, is fine
    del values["num-clients"]
    assert RunConfig.from_mapping(values).num_clients == 5


# ------------------------------------------------------------------- NUL in a key
@pytest.mark.parametrize("key", ["data-root", "results-dir", "client-state-dir"])
def test_a_nul_character_in_a_string_key_is_refused(key: str) -> None:
    message = _refused({key: "/data\x00/x"})
    assert f"'{key}'" in message
    assert "NUL" in message
