"""The run configuration: defaults parse; each bad value names its key and the fix."""

import json

import pytest

from fedpers import algorithms
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.config import (
    ConfigError,
    Partitioner,
    RunConfig,
    load_run_config,
    schema_defaults,
)
from fedpers.families import mixture
from fedpers.families.mixture import Embedding, GmmCovariance


def test_defaults_parse_and_round_trip() -> None:
    config = load_run_config()
    assert config.algorithm == "fedrep"
    assert config.model_name == "mnist1d-mlp"
    assert RunConfig.from_mapping(config.to_mapping()) == config
    assert set(config.to_mapping()) == set(schema_defaults())


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (
            {"algorithm": "fedrepp"},
            "'algorithm' = 'fedrepp' is not allowed; choose one of: fedrep",
        ),
        ({"algorithm": "fedrepp"}, "register your own with fedpers.algorithms.register"),
        ({"dataset": "imagenet"}, "'dataset' = 'imagenet' is not allowed"),
        (
            {"classes-per-client": 11},
            "'classes-per-client' = 11 must be between 1 and the 10",
        ),
        ({"num-rounds": 0}, "'num-rounds' = 0 must be at least 1"),
        ({"fraction-train": 0.0}, "'fraction-train' = 0.0 is outside (0, 1]"),
        ({"fraction-train": 1.5}, "'fraction-train' = 1.5 is outside (0, 1]"),
        ({"partitioner": "iid"}, "'partitioner' = 'iid' is not allowed"),
        ({"partitioner": 3}, "'partitioner' = 3 has type int; it must be str"),
        ({"device": "tpu"}, "'device' = 'tpu' is not allowed; choose one of: auto, cpu, cuda."),
        ({"model": "cifar10-cnn"}, "'model' = 'cifar10-cnn' does not take the inputs"),
        ({"lr": "fast"}, "'lr' = 'fast' has type str; it must be float"),
        ({"num-clients": 2.5}, "'num-clients' = 2.5 has type float; it must be int"),
        (
            {"dataset": "linear", "algorithm": "fedper"},
            "'fedper' has no linear variant; with dataset='linear' choose one of: fedrep, fedsgd.",
        ),
        ({"dataset": "linear", "algorithm": "fedgmm"}, "'fedgmm' has no linear variant"),
        ({"algorithm": "fedsgd"}, "'fedsgd' exists only for the linear model"),
        (
            {"dataset": "linear", "linear-rank": 11},
            "'linear-rank' = 11 exceeds 'linear-dim' = 10",
        ),
        ({"momentum": 1.0}, "'momentum' = 1.0 must be < 1"),
        ({"no-such-key": 1}, "unknown run-config key 'no-such-key'"),
        ({"joint-shift": True}, "'joint-shift' = true needs an image data set"),
        (
            {"unseen-fraction": 0.2},
            "needs an algorithm that can serve unseen clients "
            "(fedavg, fedavg-plus, fedem, fedgmm, fedprox, fedrod, ifca, moon)",
        ),
        ({"algorithm": "fedgmm", "gmm-embedding": "resnet18"}, "needs 'gmm-encoder-weights'"),
        (
            {"algorithm": "fedgmm", "gmm-embedding": "resnet18", "gmm-encoder-weights": "/no/file"},
            "'gmm-encoder-weights' = '/no/file' is not a file",
        ),
        (
            {"algorithm": "fedgmm", "dataset": "digits", "gmm-embedding-dim": 65},
            "'gmm-embedding-dim' = 65 exceeds the 64 input dimensions",
        ),
        ({"shift-transforms": "rot90+blur"}, "unknown image transform(s) ['blur']"),
        ({"gmm-covariance": "tied"}, "'gmm-covariance' = 'tied' is not allowed"),
        ({"joint-shift": 1}, "'joint-shift' = 1 has type int; it must be bool"),
        (
            {"fault-injection": "explode:1"},
            "'fault-injection': entry 'explode:1' is not kind[=value]:partitions[@round]",
        ),
        ({"sheaf-clip": -1.0}, "'sheaf-clip' = -1.0 must be at least 0.0"),
        ({"sheaf-density": 0.0}, "'sheaf-density' = 0.0 must be in (0, 1]"),
        ({"adapt-fraction": 1.0}, "'adapt-fraction' = 1.0 must be in (0, 1)"),
        ({"sheaf-latent-dims": "8,x"}, "'sheaf-latent-dims' = '8,x' must be comma-separated"),
        ({"sheaf-hidden": "8,8"}, "'sheaf-hidden' lists 2 values for num-clients = 100"),
        ({"algorithm": "sheaf-frl"}, "'dataset' = 'mnist1d' has no Sheaf-FRL agents"),
        (
            {"algorithm": "sheaf-frl", "dataset": "digits", "sheaf-variant": "private"},
            "'sheaf-variant' = 'private' needs equal latent dimensions",
        ),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(overrides: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_run_config(overrides)
    assert fragment in str(error.value)


def test_missing_key_is_named() -> None:
    values = schema_defaults()
    del values["seed"]
    with pytest.raises(ConfigError, match="lacks key\\(s\\): seed"):
        RunConfig.from_mapping(values)


def test_integral_float_is_accepted_for_int_keys() -> None:
    assert load_run_config({"num-rounds": 5.0}).num_rounds == 5


def test_modes_are_enums_equal_to_their_strings() -> None:
    config = load_run_config({"partitioner": "dirichlet", "gmm-covariance": "diag"})
    assert config.partitioner is Partitioner.DIRICHLET
    assert config.partitioner == "dirichlet"
    assert mixture.settings(config).gmm_covariance is GmmCovariance.DIAG
    # `auto` resolves by data set: PCA of the pixels, raw vectors of the mixtures
    assert mixture.embedding(config) is Embedding.PCA
    assert mixture.embedding(load_run_config({"dataset": "mixture"})) is Embedding.IDENTITY


def test_to_mapping_holds_plain_toml_values() -> None:
    mapping = load_run_config({"test-split": "per-client"}).to_mapping()
    assert type(mapping["test-split"]) is str
    assert type(mapping["partitioner"]) is str
    assert json.loads(json.dumps(mapping)) == mapping
    assert mapping == {**schema_defaults(), "test-split": "per-client"}


@pytest.mark.parametrize(
    ("overrides", "family", "run_family"),
    [
        ({}, Family.PERSONALIZED, "personalized"),
        ({"dataset": "linear"}, Family.PERSONALIZED, "linear"),  # the data set binds it
        ({"algorithm": "fedgmm"}, Family.MIXTURE, "mixture"),
        ({"algorithm": "sheaf-frl", "dataset": "digits"}, Family.SHEAF, "sheaf"),
    ],
)
def test_spec_is_the_algorithms_row(overrides: dict, family: Family, run_family: str) -> None:
    config = load_run_config(overrides)
    assert config.spec is algorithms.get(config.algorithm)
    assert config.spec.family == family
    assert config.family.name == run_family


def test_a_registered_algorithm_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(algorithms, "_TABLE", dict(algorithms._TABLE))
    algorithms.register(AlgorithmSpec(name="my-fedper", family=Family.PERSONALIZED, shared=()))
    config = load_run_config({"algorithm": "my-fedper"})
    assert config.spec.name == "my-fedper"
    with pytest.raises(ConfigError, match="'my-fedper' has no linear variant"):
        load_run_config({"algorithm": "my-fedper", "dataset": "linear"})


@pytest.mark.parametrize(
    ("round_timeout", "node_wait_timeout", "startup"),
    [(10.0, 120.0, 120.0), (600.0, 120.0, 600.0), (30.0, 30.0, 30.0)],
)
def test_a_start_up_query_waits_the_longer_of_the_two_timeouts(
    round_timeout: float, node_wait_timeout: float, startup: float
) -> None:
    # A node's first message also starts its ClientApp: a 10 s round-timeout on two busy
    # cores lost every node at query.initial (CI, stop 30), so start-up waits as long as
    # registration may.
    config = load_run_config(
        {"round-timeout": round_timeout, "node-wait-timeout": node_wait_timeout}
    )
    assert config.startup_timeout == startup
