"""Everything that runs on the server: the ServerApp and one strategy per algorithm.

``build_strategy`` maps the run's algorithm name (declared in ``fedpers.protocol``) to
its strategy; ``clients`` does the same on the device side, and neither package
imports the other.
"""

from __future__ import annotations

from typing import Any

from fedpers.config import RunConfig
from fedpers.protocol import Algorithm
from strategies.base import FedpersStrategy
from strategies.fedavg import FedAvgFT, FederatedAveraging
from strategies.fedem import FedEM
from strategies.fedgmm import FedGMM
from strategies.fedper import FedPer
from strategies.fedrep import FedRep, FedRepLinear
from strategies.fedsgd import FedSGD
from strategies.lg_fedavg import LGFedAvg
from strategies.local import Local
from strategies.peer_relay import PeerRelay

DEEP_STRATEGIES: dict[Algorithm, type[FedpersStrategy]] = {
    Algorithm.FEDREP: FedRep,
    Algorithm.FEDPER: FedPer,
    Algorithm.FEDAVG: FederatedAveraging,
    Algorithm.LG_FEDAVG: LGFedAvg,
    Algorithm.LOCAL: Local,
}


def build_strategy(config: RunConfig) -> FedpersStrategy:
    """The strategy of ``config.algorithm``, configured from the run config."""
    common: dict[str, Any] = {
        "num_nodes": config.num_clients,
        "fraction_train": config.fraction_train,
        "seed": config.seed,
        "unseen_fraction": config.unseen_fraction,
        "adapt_fraction": config.adapt_fraction,
        "lr_schedule": config.lr_schedule,
        "num_rounds": config.num_rounds,
        "min_replies": config.min_replies,
        "evaluate_every": config.evaluate_every,
        "final_rounds": config.final_rounds,
    }
    algorithm = Algorithm(config.algorithm)
    if config.is_linear:
        linear = {Algorithm.FEDREP: FedRepLinear, Algorithm.FEDSGD: FedSGD}[algorithm]
        return linear(rank=config.linear_rank, evaluate_nodes=False, **common)
    if algorithm is Algorithm.FEDAVG_FT:
        return FedAvgFT(finetune_epochs=config.finetune_epochs, **common)
    if algorithm is Algorithm.FEDEM:
        return FedEM(learners=config.mixture_learners, **common)
    if algorithm is Algorithm.FEDGMM:
        return FedGMM(
            learners=config.mixture_learners,
            components=config.gmm_components,
            covariance=config.gmm_covariance,
            ridge=config.gmm_ridge,
            aggregation=config.gmm_aggregation,
            embedding=config.embedding,
            embedding_dim=config.gmm_embedding_dim,
            **common,
        )
    if algorithm in (Algorithm.SHEAF_FRL, Algorithm.NON_COOPERATIVE):
        cooperative = algorithm is Algorithm.SHEAF_FRL
        return PeerRelay(
            edges=config.sheaf_graph(),
            variant=config.sheaf_variant,
            cooperative=cooperative,
            whitening_modes=("pilots",) if cooperative else ("train", "pilots"),
            **common,
        )
    return DEEP_STRATEGIES[algorithm](**common)
