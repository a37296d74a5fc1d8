"""Everything that runs on the server: the ServerApp and the strategies.

``build_strategy`` looks the run's algorithm up in the algorithm table
(``fedpers.algorithms``) and builds the strategy class its row names; ``clients``
does the same on the device side, and neither package imports the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedpers.config import RunConfig

if TYPE_CHECKING:
    from fedpers.strategies.base import FedpersStrategy


def build_strategy(config: RunConfig) -> FedpersStrategy:
    """The strategy of ``config.algorithm`` (its linear variant for linear runs)."""
    from fedpers.strategies.base import FedpersStrategy

    cls = config.spec.strategy_class(family=config.family.name)
    if not (isinstance(cls, type) and issubclass(cls, FedpersStrategy)):
        raise TypeError(
            f"algorithm '{config.algorithm}' names strategy {cls!r}, which is not a "
            "subclass of strategies.base.FedpersStrategy"
        )
    return cls(config)
