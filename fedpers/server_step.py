"""A Flower strategy as the server step of a personalized row (``server-strategy``).

Flower 1.42 ships server optimizers (FedAvgM, FedAdam, FedYogi, FedAdagrad) and robust
aggregations (Krum, Multi-Krum, Bulyan, the median, the trimmed mean) as
``flwr.serverapp.strategy`` classes. With ``server-strategy`` set, a row whose server
step is the base strategy's aggregation (FedRep, FedPer, FedAvg, FedProx, LG-FedAvg,
Ditto, FedBABU, ...) combines its shared parts with that class instead: each round the
strategy's ``configure_train`` sees the arrays sent (as in Flower's own loop, so it keeps
what it keeps between rounds) and its ``aggregate_train`` gets the round's replies that
passed fedpers' screening (record types, bounded weights and update norms); its arrays
are the new shared state. ``server-strategy-args`` gives its constructor's keywords.

The name is one of ``FLOWER_STRATEGIES`` or ``"package.module:Class"`` for any other
Flower ``Strategy`` (a user's own). Nothing here imports Flower at module level.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fedpers.settings import ConfigError, setting

if TYPE_CHECKING:
    from fedpers.config import RunConfig

# run-config value -> class of flwr.serverapp.strategy
FLOWER_STRATEGIES = {
    "fedavgm": "FedAvgM",
    "fedadam": "FedAdam",
    "fedyogi": "FedYogi",
    "fedadagrad": "FedAdagrad",
    "krum": "Krum",
    "multikrum": "MultiKrum",
    "bulyan": "Bulyan",
    "fedmedian": "FedMedian",
    "fedtrimmedavg": "FedTrimmedAvg",
}
# fedpers samples the clients and counts the replies (fraction-train, min-replies); the
# strategy's own sampling only runs on the round's sampled nodes, so these are fixed.
FIXED = {
    "fraction_train": 1.0,
    "fraction_evaluate": 0.0,
    "min_train_nodes": 1,
    "min_evaluate_nodes": 1,
    "min_available_nodes": 1,
}
BASE_STRATEGY = "fedpers.strategies.base:FedpersStrategy"


@dataclass(frozen=True)
class ServerStrategySettings:
    """A Flower strategy as the server step of the shared parts."""

    HEADING: ClassVar[str] = "server-strategy"

    server_strategy: str = setting(
        "",
        "empty: the run's `aggregation`; else a Flower strategy that combines the screened "
        "replies: " + ", ".join(FLOWER_STRATEGIES) + ", or 'package.module:Class'",
    )
    server_strategy_args: str = setting(
        "",
        "the strategy's constructor keywords, 'name=value,...' (numbers, true/false), for "
        "example 'eta=0.01,beta_1=0.9' or 'num_malicious_nodes=1'",
    )


def strategy_class(name: str) -> type:
    """The class ``name`` stands for (``FLOWER_STRATEGIES`` or ``module:Class``).

    Raises
    ------
    ConfigError
        Naming the value and what it may be.
    """
    known = ", ".join(FLOWER_STRATEGIES)
    if name in FLOWER_STRATEGIES:
        module, attribute = "flwr.serverapp.strategy", FLOWER_STRATEGIES[name]
    elif ":" in name:
        module, _, attribute = name.partition(":")
    else:
        raise ConfigError(
            f"run-config key 'server-strategy' = '{name}' is not a strategy: choose one of "
            f"{known}, or 'package.module:Class' for another Flower strategy"
        )
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as error:
        raise ConfigError(
            f"run-config key 'server-strategy' = '{name}' cannot be loaded ({error}): check "
            "the module and class names, and that the package is installed"
        ) from None
    from flwr.serverapp.strategy import Strategy

    if not (isinstance(found, type) and issubclass(found, Strategy)):
        raise ConfigError(
            f"run-config key 'server-strategy' = '{name}' is not a Flower Strategy "
            "(flwr.serverapp.strategy.Strategy): name a subclass of it"
        )
    return found


def parse_args(text: str) -> dict[str, Any]:
    """``"eta=0.01,flag=true"`` -> ``{"eta": 0.01, "flag": True}`` (ints stay ints).

    Raises
    ------
    ConfigError
        For a part that is not ``name=value`` or a value that is not a number or a bool.
    """
    out: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not name.isidentifier():
            raise ConfigError(
                f"run-config key 'server-strategy-args' has '{part}', not 'name=value': "
                "write keywords as 'eta=0.01,beta_1=0.9'"
            )
        out[name] = _value(name, value)
    return out


def _value(name: str, value: str) -> Any:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    raise ConfigError(
        f"run-config key 'server-strategy-args' gives {name} = '{value}', not a number or "
        "true/false"
    )


def build(settings: ServerStrategySettings) -> Any:
    """The configured strategy, constructed (``FIXED`` over its sampling keywords)."""
    cls = strategy_class(settings.server_strategy)
    kwargs = parse_args(settings.server_strategy_args)
    taken = sorted(set(kwargs) & set(FIXED))
    if taken:
        raise ConfigError(
            f"run-config key 'server-strategy-args' sets {taken}: fedpers samples the clients "
            "itself; set fraction-train and min-replies instead"
        )
    accepted = inspect.signature(cls).parameters
    fixed = {k: v for k, v in FIXED.items() if k in accepted}
    try:
        return cls(**fixed, **kwargs)
    except (TypeError, ValueError) as error:
        keywords = ", ".join(n for n in accepted if n not in FIXED)
        raise ConfigError(
            f"run-config key 'server-strategy-args' = '{settings.server_strategy_args}' does "
            f"not make a {cls.__name__} ({error}); its keywords: {keywords}"
        ) from None


def check(run: RunConfig) -> None:
    """The strategy loads and takes its arguments, and the run can use it: a row whose
    server step is the plain aggregation, no DP, ``aggregation = "mean"`` (the strategy
    aggregates), and no resume (its state between rounds is not in the checkpoint)."""
    settings = run.group(ServerStrategySettings)
    if not settings.server_strategy:
        if settings.server_strategy_args:
            raise ConfigError(
                "run-config key 'server-strategy-args' is set without 'server-strategy': "
                "name the strategy, or leave the arguments empty"
            )
        return
    build(settings)
    name = settings.server_strategy
    if run.spec.strategy != BASE_STRATEGY or run.family.name != "personalized":
        raise ConfigError(
            f"run-config key 'server-strategy' = '{name}' replaces the plain aggregation of a "
            f"personalized row; '{run.algorithm}' has its own server step: choose a row such "
            "as fedrep, fedavg or fedprox, or leave server-strategy empty"
        )
    from fedpers.privacy import DpMode, PrivacySettings

    conflicts = {
        "aggregation": str(run.aggregation) != "mean",
        "dp": run.group(PrivacySettings).dp is not DpMode.NONE,
        "resume": run.resume,
    }
    for key, clash in conflicts.items():
        if clash:
            raise ConfigError(
                f"run-config key 'server-strategy' = '{name}' cannot run with '{key}' set: "
                + _WHY[key]
            )


_WHY = {
    "aggregation": "the strategy aggregates the replies itself; set aggregation = 'mean'",
    "dp": "client-level DP releases its own noised mean; set dp = 'none'",
    "resume": "what the strategy keeps between rounds (momentum, moments) is not in the "
    "checkpoint; start the run afresh",
}
