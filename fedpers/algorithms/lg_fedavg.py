"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov and Morency,
"Think Locally, Act Globally: Federated Learning with Local and Global Representations",
2020, arXiv 2001.01523).

The mirror image of FedPer: the server averages the head (the global layers) and each
client keeps its body (its local representation), both trained together for
``epochs``. The update is the personalized family's.
"""

from __future__ import annotations

from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.protocol import HEAD

ROWS = (
    AlgorithmSpec(
        name="lg-fedavg",
        family=Family.PERSONALIZED,
        shared=(HEAD,),
        paper="Liang et al., 2020",
    ),
)
