"""The run configuration: defaults parse; each bad value names its key and the fix."""

import pytest

from fedpers.config import ConfigError, RunConfig, default_run_config, load_run_config


def test_defaults_parse_and_round_trip() -> None:
    config = load_run_config()
    assert config.algorithm == "fedrep"
    assert config.model_name == "mnist1d-mlp"
    assert config.clients_per_round == 10
    assert RunConfig.from_mapping(config.to_mapping()) == config
    assert set(config.to_mapping()) == set(default_run_config())


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (
            {"algorithm": "fedrepp"},
            "'algorithm' = 'fedrepp' is not allowed; choose one of: fedrep",
        ),
        ({"dataset": "imagenet"}, "'dataset' = 'imagenet' is not allowed"),
        (
            {"classes-per-client": 11},
            "'classes-per-client' = 11 must be between 1 and the 10",
        ),
        ({"num-rounds": 0}, "'num-rounds' = 0 must be at least 1"),
        ({"fraction-train": 0.0}, "'fraction-train' = 0.0 is outside (0, 1]"),
        ({"fraction-train": 1.5}, "'fraction-train' = 1.5 is outside (0, 1]"),
        ({"partitioner": "iid"}, "'partitioner' = 'iid' is not allowed"),
        ({"model": "cifar10-cnn"}, "'model' = 'cifar10-cnn' does not take the inputs"),
        ({"lr": "fast"}, "'lr' = 'fast' has type str; it must be float"),
        ({"num-clients": 2.5}, "'num-clients' = 2.5 has type float; it must be int"),
        ({"dataset": "linear", "algorithm": "fedper"}, "'fedper' has no linear variant"),
        ({"algorithm": "fedsgd"}, "'fedsgd' exists only for the linear model"),
        (
            {"dataset": "linear", "linear-rank": 11},
            "'linear-rank' = 11 exceeds 'linear-dim' = 10",
        ),
        ({"momentum": 1.0}, "'momentum' = 1.0 must be < 1"),
        ({"no-such-key": 1}, "unknown run-config key 'no-such-key'"),
        ({"joint-shift": True}, "'joint-shift' = true needs an image data set"),
        ({"unseen-fraction": 0.2}, "needs an algorithm that can serve unseen clients"),
        ({"algorithm": "fedgmm", "gmm-embedding": "resnet18"}, "needs 'gmm-encoder-weights'"),
        (
            {"algorithm": "fedgmm", "gmm-embedding": "resnet18", "gmm-encoder-weights": "/no/file"},
            "'gmm-encoder-weights' = '/no/file' is not a file",
        ),
        ({"shift-transforms": "rot90+blur"}, "unknown image transform(s) ['blur']"),
        ({"gmm-covariance": "tied"}, "'gmm-covariance' = 'tied' is not allowed"),
        ({"joint-shift": 1}, "'joint-shift' = 1 has type int; it must be bool"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(overrides: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_run_config(overrides)
    assert fragment in str(error.value)


def test_missing_key_is_named() -> None:
    values = default_run_config()
    del values["seed"]
    with pytest.raises(ConfigError, match="lacks key\\(s\\): seed"):
        RunConfig.from_mapping(values)


def test_integral_float_is_accepted_for_int_keys() -> None:
    assert load_run_config({"num-rounds": 5.0}).num_rounds == 5
