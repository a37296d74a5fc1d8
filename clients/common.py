"""What every client shares; no torch, so numpy-only clients start fast.

- ``ClientBase``: the run configuration (read once, typed), the partition and the
  node's ``context.state``; torch clients add threads, device and data
  (``clients.base.TorchClient``).
- Typed interfaces (``typing.Protocol``) of what the ClientApp's handlers call: every
  client trains and evaluates, and seeds the initial arrays; the interfaces of a
  family's own queries are the family's (``fedpers.families``).
- Reading the server's per-round settings from a message (``config_int``,
  ``config_float``, from ``fedpers.records``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
from flwr.app import ConfigRecord, RecordDict

from fedpers.config import RunConfig
from fedpers.records import config_float, config_int

__all__ = ["Arrays", "Client", "ClientBase", "Metrics", "SeedsModel", "config_float", "config_int"]

Arrays = dict[str, np.ndarray]
Metrics = dict[str, float]


class ClientBase:
    """A client of one partition: the typed run configuration and the node's state.

    Parameters
    ----------
    run : RunConfig
        The run configuration, parsed once by the ClientApp.
    partition_id : int
        This client's partition.
    state : RecordDict
        ``context.state`` of the node: what persists across rounds on the device.
    """

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        self.run = run
        self.partition_id = partition_id
        self.state = state


class Client(Protocol):
    """What every client does: one round of training, one evaluation."""

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """Train from the server's arrays; reply arrays and metrics."""
        ...

    def evaluate(self, arrays: Arrays, config: ConfigRecord) -> Metrics:
        """Test with the server's arrays and the client's own parts."""
        ...


@runtime_checkable
class SeedsModel(Protocol):
    """A client that can build the seeded initial shared arrays (``query.initial``)."""

    def initial_arrays(self) -> Arrays:
        """The round-0 shared arrays."""
        ...
