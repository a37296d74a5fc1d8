"""A Flower strategy as the server step of the shared parts (``server-strategy``,
``fedpers/server_step.py``), driven as Flower's own loop drives it: ``configure_train``
with the arrays sent to the round's sampled nodes (its messages are dropped: fedpers
sends its own), then ``aggregate_train`` with the replies that passed fedpers'
screening. Its arrays, in the state's dtypes, are the new shared state."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message

from fedpers import records
from fedpers.server_step import ServerStrategySettings, build


class SampledNodes:
    """The grid a wrapped strategy's ``configure_train`` samples from: the round's
    sampled nodes, all connected (its sampling then keeps all of them)."""

    def __init__(self, nodes: Sequence[int]) -> None:
        self.nodes = list(nodes)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)


class FlowerStep:
    """The configured Flower strategy and the two calls fedpers makes of it a round."""

    def __init__(self, settings: ServerStrategySettings) -> None:
        self.name = settings.server_strategy
        self.strategy = build(settings)

    def configure(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, nodes: Sequence[int]
    ) -> None:
        """Show the strategy the round's arrays (on a copy of ``config``: Flower writes
        ``server-round`` into it). A round that samples no node has nothing to
        aggregate and is not shown."""
        if nodes:
            with _quiet():
                self.strategy.configure_train(
                    server_round, arrays, ConfigRecord(dict(config)), SampledNodes(nodes)
                )

    def aggregate(
        self, server_round: int, replies: list[Message], reference: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The strategy's aggregate of ``replies``, each array in ``reference``'s dtype
        (the state's names, shapes and dtypes stay; the base checks the values).

        Raises
        ------
        RuntimeError
            If the strategy returns no arrays or others than the state's.
        """
        with _quiet():
            record, _ = self.strategy.aggregate_train(server_round, replies)
        names = sorted(record.keys()) if record is not None else []
        if names != sorted(reference):
            raise RuntimeError(
                f"server-strategy '{self.name}' returned arrays {names} for round "
                f"{server_round}, not the shared state's {sorted(reference)}"
            )
        assert record is not None
        return {
            name: np.asarray(records.values(record[name]), dtype=current.dtype)
            for name, current in reference.items()
        }


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Flower's INFO lines of these calls ("configure_train: Sampled 10 nodes", ...) left
    out of the run's log: fedpers logs its own round; warnings and errors still show."""
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)
