"""How a settings group is declared: the one mechanism for every run-config key.

A group is a frozen dataclass whose fields are declared with ``setting`` (default and
one-line description); its own checks are a method ``check(self)``. The core groups live
in ``fedpers.config``; a family module (``fedpers.families``) or a row of the algorithm
table (``fedpers.algorithms``) declares its own groups, and ``RunConfig.group(Cls)``
returns a run's instance of one, typed. Nothing here imports the configuration, so a
family module can declare its groups without a cycle.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

_T = TypeVar("_T")
DESCRIPTION = "fedpers.description"
CHOICES = "fedpers.choices"


class ConfigError(ValueError):
    """A run-config value that cannot work; the message names the key and the fix."""


def setting(
    default: _T,
    description: str,
    *,
    choices: Callable[[], Sequence[str]] | None = None,
) -> _T:
    """Declare a run-config key: its default and what it means, in one line.

    The key is the attribute name with ``_`` replaced by ``-``, its type the attribute's
    annotation, its group the class that declares it. ``choices`` restricts a plain
    ``str`` key to a list that lives elsewhere and may grow (the registered data sets
    and models); keys with a fixed set of values are ``StrEnum``s instead.
    """
    metadata = {DESCRIPTION: description, CHOICES: choices}
    return dataclasses.field(default=default, metadata=metadata)


def summary(group: type) -> str:
    """The first line of a group's docstring: its heading in the docs and pyproject."""
    return (group.__doc__ or "").strip().splitlines()[0]


def check_group(group: object) -> None:
    """Run a group's own checks (its ``check`` method, if it has one)."""
    check = getattr(group, "check", None)
    if check is not None:
        check()


# ------------------------------------------------------------- checks of one key
def int_list(text: str) -> list[int]:
    """``"16,32"`` -> ``[16, 32]``; empty parts are skipped."""
    return [int(part) for part in text.split(",") if part.strip()]


def within(key: str, value: float, interval: str) -> None:
    """Check ``value`` against an interval written ``[0, 1)``, ``(0, 1]``, ..."""
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    above = value >= low if interval[0] == "[" else value > low
    below = value <= high if interval[-1] == "]" else value < high
    if not (above and below):
        raise ConfigError(f"run-config key '{key}' = {value} must be in {interval}.")


def at_least(key: str, value: float, low: float) -> None:
    """Check ``value >= low`` (NaN is not)."""
    if not value >= low:
        raise ConfigError(f"run-config key '{key}' = {value} must be at least {low}.")


def finite(key: str, value: float, low: float, *, strict: bool = False, note: str = "") -> None:
    """Check ``value`` finite and at least ``low`` (greater than it with ``strict``);
    ``note`` ends the message (what a value means, say)."""
    if math.isfinite(value) and (value > low if strict else value >= low):
        return
    bound = f"greater than {low:g}" if strict else f"at least {low:g}"
    raise ConfigError(f"run-config key '{key}' = {value} must be finite and {bound}{note}.")


STEP_LIMIT = 1e3  # the largest step size (learning rate, server step) a key accepts


def step_size(key: str, value: float, *, zero: bool = False) -> None:
    """Check a step size: finite, greater than 0 (at least 0 with ``zero``) and at most
    ``STEP_LIMIT``. A larger step makes every update overflow or void the model (1e300
    was accepted before and voided every round); the runs here use 0.01 to 1."""
    low_ok = value >= 0 if zero else value > 0
    if math.isfinite(value) and low_ok and value <= STEP_LIMIT:
        return
    low = "at least 0" if zero else "greater than 0"
    raise ConfigError(
        f"run-config key '{key}' = {value} must be {low} and at most {STEP_LIMIT:g} (a "
        "step size; larger ones overflow the model)."
    )


def positive(key: str, value: float) -> None:
    """Check ``value > 0``."""
    if not value > 0:
        raise ConfigError(f"run-config key '{key}' = {value} must be greater than 0.")
