"""Everything that runs on a device: the ClientApp and one client per algorithm.

``client_class`` maps the run's algorithm name (declared in ``fedpers.protocol``) to its
client; ``strategies`` does the same on the server side, and neither package imports
the other. Classes are imported on first use, so a numpy-only run never loads torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from fedpers.config import RunConfig
from fedpers.protocol import Algorithm

DEEP_CLIENTS: dict[Algorithm, str] = {
    Algorithm.FEDREP: "clients.fedrep:FedRepClient",
    Algorithm.FEDPER: "clients.fedper:FedPerClient",
    Algorithm.FEDAVG: "clients.fedavg:FedAvgClient",
    Algorithm.FEDAVG_FT: "clients.fedavg:FedAvgFTClient",
    Algorithm.LG_FEDAVG: "clients.lg_fedavg:LGFedAvgClient",
    Algorithm.LOCAL: "clients.local:LocalClient",
    Algorithm.FEDEM: "clients.fedem:FedEMClient",
    Algorithm.FEDGMM: "clients.fedgmm:FedGMMClient",
    Algorithm.SHEAF_FRL: "clients.sheaf:SheafClient",
    Algorithm.NON_COOPERATIVE: "clients.sheaf:NonCooperativeClient",
}

LINEAR_CLIENTS: dict[Algorithm, str] = {
    Algorithm.FEDREP: "clients.linear:LinearFedRepClient",
    Algorithm.FEDSGD: "clients.linear:FedSGDClient",
}


def client_class(run: RunConfig) -> Any:
    """The client class of ``run.algorithm`` (linear or deep variant)."""
    table = LINEAR_CLIENTS if run.is_linear else DEEP_CLIENTS
    module, name = table[Algorithm(run.algorithm)].split(":")
    return getattr(importlib.import_module(module), name)
