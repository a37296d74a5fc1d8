"""FedEM (Marfoq, Neglia, Bellet, Kameni and Vidal, "Federated Multi-Task Learning under
a Mixture of Distributions", NeurIPS 2021).

Every client holds the M2 shared learners and its personal mixture weights ``pi_c``
(in ``context.state``). Each round: an E-step over its training samples
(responsibilities ``q_i(m) ~ pi_c(m) P_m(y_i | x_i)``), the M-step
``pi_c = mean_i q_i``, then every learner trains on the responsibility-weighted loss.
It replies with the learners and ``gamma_c = sum_i q_i``; the server
(``strategies/fedem.py``) averages each learner by the clients' ``gamma``. Prediction:
``sum_m p(m | x) softmax(f_m(x))``. An unseen client first adapts ``pi`` on its
adaptation split.

The update is the mixture family's (``fedpers.mixture_update``: ``fit``,
``evaluate``, ``initial_arrays``) with no density on ``x`` (one cell per learner,
``log N = 0``); FedGMM (``fedpers.algorithms.fedgmm``) adds Gaussian components over an
embedding of ``x``.
"""

from __future__ import annotations

from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.protocol import MODEL_PARTS

ROWS = (
    AlgorithmSpec(
        name="fedem",
        family=Family.MIXTURE,
        shared=MODEL_PARTS,
        strategy="fedpers.strategies.fedem:FedEM",
        unseen=True,
        paper="Marfoq et al., NeurIPS 2021",
    ),
)
