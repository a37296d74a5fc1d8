"""Everything that runs on the server: the ServerApp and one strategy per algorithm.

``build_strategy`` maps the run's algorithm name (declared in ``fedpers.protocol``) to
its strategy; ``clients`` does the same on the device side, and neither package
imports the other.
"""

from __future__ import annotations

from fedpers.config import RunConfig
from fedpers.protocol import Algorithm
from strategies.base import FedpersStrategy
from strategies.fedavg import FedAvgFT, FederatedAveraging
from strategies.fedper import FedPer
from strategies.fedrep import FedRep, FedRepLinear
from strategies.fedsgd import FedSGD
from strategies.lg_fedavg import LGFedAvg
from strategies.local import Local

DEEP_STRATEGIES: dict[Algorithm, type[FedpersStrategy]] = {
    Algorithm.FEDREP: FedRep,
    Algorithm.FEDPER: FedPer,
    Algorithm.FEDAVG: FederatedAveraging,
    Algorithm.LG_FEDAVG: LGFedAvg,
    Algorithm.LOCAL: Local,
}


def build_strategy(config: RunConfig) -> FedpersStrategy:
    """The strategy of ``config.algorithm``, configured from the run config."""
    nodes, fraction, seed = config.num_clients, config.fraction_train, config.seed
    algorithm = Algorithm(config.algorithm)
    if config.is_linear:
        linear = {Algorithm.FEDREP: FedRepLinear, Algorithm.FEDSGD: FedSGD}[algorithm]
        return linear(
            rank=config.linear_rank,
            num_nodes=nodes,
            fraction_train=fraction,
            seed=seed,
            evaluate_nodes=False,
        )
    if algorithm is Algorithm.FEDAVG_FT:
        return FedAvgFT(
            finetune_epochs=config.finetune_epochs,
            num_nodes=nodes,
            fraction_train=fraction,
            seed=seed,
        )
    return DEEP_STRATEGIES[algorithm](num_nodes=nodes, fraction_train=fraction, seed=seed)
