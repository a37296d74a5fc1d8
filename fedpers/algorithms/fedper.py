"""FedPer (Arivazhagan, Aggarwal, Singh and Choudhary, "Federated Learning with
Personalization Layers", 2019, arXiv 1912.00818).

The server averages the base layers (``body``); each client keeps its personalization
layers (``head``) and trains both together for ``epochs``. The update is the
personalized family's; FedPer differs from FedRep only in training both parts at once.
"""

from __future__ import annotations

from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.protocol import BODY

ROWS = (
    AlgorithmSpec(
        name="fedper",
        family=Family.PERSONALIZED,
        shared=(BODY,),
        paper="Arivazhagan et al., 2019",
    ),
)
