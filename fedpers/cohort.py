"""A cohort: the clients of one run that a local update trains together.

An algorithm's local update is written once, for a cohort of K clients: what each was
sent, each one's personal state (``context.state``), its data and its seed in, their
replies out (``fedpers.algorithms``: ``fit(cohort)`` and ``evaluate(cohort)``). A device
runs it with K = 1 (``clients/client_app.py``); a simulation's batched engine with
whole cohorts (``fedpers.simulations.batched``). Each client keeps its own random
streams, so its result does not depend on the cohort it trains in.

No torch here: the server imports the algorithm modules (for their rows and settings),
and they import this module; the tensors are built in ``fedpers.update``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ConfigRecord, RecordDict

if TYPE_CHECKING:
    from fedpers.config import RunConfig

Arrays = dict[str, np.ndarray]
Metrics = dict[str, float]
Reply = tuple[Arrays, Metrics]


@dataclass
class Member:
    """One client of a cohort.

    Parameters
    ----------
    partition : int
        Its partition id.
    state : RecordDict
        Its node's ``context.state``: what persists between rounds (read and written by
        the update).
    arrays : dict of str to numpy.ndarray
        What the server sent it in this message.
    """

    partition: int
    state: RecordDict
    arrays: Arrays = field(default_factory=dict)


@dataclass
class Cohort:
    """K clients of one run, sent the same round settings.

    Parameters
    ----------
    run : RunConfig
        The run configuration (typed, validated).
    config : ConfigRecord
        The round's settings every member was sent (round, lr, epochs, ...).
    members : list of Member
        The clients, in the order their replies are returned.
    threads : int or None
        Torch threads to use (a device's ``client-threads``); None leaves the process's
        setting, which a batched engine chooses.
    dtype : str or None
        ``"float64"`` to compute in double precision (the equality tests); None keeps
        the models' own.
    """

    run: RunConfig
    config: ConfigRecord
    members: list[Member]
    threads: int | None = None
    dtype: str | None = None

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def partitions(self) -> list[int]:
        return [m.partition for m in self.members]

    def with_members(self, members: list[Member]) -> Cohort:
        """The same cohort's settings for other members (a sub-cohort)."""
        return Cohort(self.run, self.config, members, self.threads, self.dtype)
