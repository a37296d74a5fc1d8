"""Local training only: each client trains its own whole model and shares nothing; the
server averages nothing. The update is the personalized family's with no shared part.

Two budgets (``local-all-clients``): only when sampled, ``epochs`` in the rounds a client
is drawn (the default: the other rows' budget, about 10 of 100 rounds at 10 %), or every
client in every round, which is the papers' Local (each client trained alone to
convergence: the FedRep authors' ``main_local.py``); FedRep's Table 1 scripts run that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.privacy import DpMode, PrivacySettings
from fedpers.settings import ConfigError, setting

if TYPE_CHECKING:
    from fedpers.config import RunConfig


@dataclass(frozen=True)
class LocalSettings:
    """Which clients Local trains (the row `local`)."""

    HEADING: ClassVar[str] = "local"

    local_all_clients: bool = setting(
        False,
        "Local: every client trains alone in every round (the papers' Local, trained to "
        "convergence; FedRep's Table 1 sets it); false: only the round's sampled clients, "
        "the other rows' budget",
    )


def check_all_clients(run: RunConfig) -> None:
    """Refuse every-client Local under DP: the accountant counts the run's sampling rate."""
    if (
        run.group(LocalSettings).local_all_clients
        and run.group(PrivacySettings).dp is not DpMode.NONE
    ):
        raise ConfigError(
            f"run-config key 'local-all-clients' = true trains every client every round, "
            f"which 'dp' = '{run.group(PrivacySettings).dp}' does not account for (it counts "
            "fraction-train's sample): set local-all-clients = false, or dp = 'none'."
        )


ROWS = (
    AlgorithmSpec(
        name="local",
        family=Family.PERSONALIZED,
        shared=(),
        strategy="fedpers.strategies.local:Local",
        settings=(LocalSettings,),
        checks=(check_all_clients,),
        paper="local training only",
    ),
)
