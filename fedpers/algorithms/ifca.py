"""IFCA (Ghosh, Chung, Yin and Ramchandran, "An Efficient Framework for Clustered
Federated Learning", NeurIPS 2020, Algorithm 2 with model averaging).

The server keeps k models (the mixture family's ``mixture-learners``, seeded apart) and
sends all of them to every sampled client. The client estimates its cluster identity

    j = argmin_m  sum_i loss(f_m(x_i), y_i)

over its training samples, trains model ``j`` alone for the round's ``epochs`` of
local SGD from the received values, and replies. The server (``strategies/ifca.py``)
sets each model to the plain mean of the models trained on it this round (the paper's
``sum_i s_ij theta_i / sum_i s_ij``, unweighted); a model no client chose stays as it
was. A client is tested with the model it chooses with the final models, on its
training samples (an unseen client on its adaptation split): nothing is kept on the
device between rounds.

On the wire a reply carries what the paper's client sends back: model ``j`` alone, and
FedEM's ``gamma_c``, here one-hot (all of the client's samples on ``j``), which names
``j``. The server (``strategies/ifca.py``) completes it with the other k - 1 models as
it sent them, then screens and averages it as FedEM's exchange.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fedpers import protocol
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.protocol import MODEL_PARTS

if TYPE_CHECKING:
    from fedpers.cohort import Cohort, Metrics, Reply
    from fedpers.mixture_update import Mixture
    from fedpers.training import CohortData, Stack


def choice(log_probs: np.ndarray, y: np.ndarray) -> int:
    """The cluster identity: the model of least total loss on ``(x, y)`` (its
    ``log_probs``, (n, k, classes)); the first of equals; model 0 without samples."""
    if len(y) == 0:
        return 0
    return int(np.argmax(log_probs[np.arange(len(y)), :, y].sum(axis=0)))


def one_hot(j: int, k: int) -> np.ndarray:
    """Log-weights (1, k) that put the whole mixture on model ``j``."""
    log_weights = np.full((1, k), -np.inf)
    log_weights[0, j] = 0.0
    return log_weights


def fit(cohort: Cohort) -> list[Reply]:
    """Each member's choice of model, then that model's epochs; replies that model and
    the one-hot ``gamma_c`` that names it."""
    from fedpers import mixture_update
    from fedpers.families import mixture

    local = mixture_update.Mixture(cohort, mixture.NO_DENSITY)
    stack = local.stacked()
    data = local.train_data()
    every = local.log_probs(stack, data)
    chosen = [choice(lp, d.y_train) for lp, d in zip(every, local.data, strict=True)]
    _train_chosen(local, stack, data, chosen)
    trained = stack.arrays(MODEL_PARTS)
    k = local.learners
    replies = []
    for c, (lp, d, j) in enumerate(zip(every, local.data, chosen, strict=True)):
        n = len(d.y_train)
        learners = {
            mixture.learner_prefix(j) + name: value for name, value in trained[c * k + j].items()
        }
        gamma = np.zeros((1, k))
        gamma[0, j] = n
        own = lp[np.arange(n), j, d.y_train]
        loss = float(-np.mean(own)) if n else float("nan")
        replies.append(
            (
                {**learners, mixture.GAMMA: gamma},
                {
                    protocol.NUM_EXAMPLES: float(n),
                    protocol.LOSS: loss,
                    mixture.LOG_LIKELIHOOD: -loss,
                },
            )
        )
    return replies


def _train_chosen(local: Mixture, stack: Stack, data: CohortData, chosen: list[int]) -> None:
    """Model ``chosen[c]`` of each member ``c`` trains on its samples for the round's
    epochs, from the generator a client alone gives that model; the others stay."""
    import torch

    from fedpers import records, training

    k = local.learners
    index = torch.tensor([c * k + j for c, j in enumerate(chosen)])
    own = stack.select(index)
    generators = [local.generators("train", local.round, m) for m in range(k)]
    training.train(
        own,
        data,
        parts=MODEL_PARTS,
        epochs=records.config_int(local.config, protocol.EPOCHS),
        settings=local.sgd(),
        generators=[generators[j][c] for c, j in enumerate(chosen)],
        augment=local.augment,
    )
    with torch.no_grad():
        for name, tensor in own.tensors.items():
            stack.tensors[name][index] = tensor


def evaluate(cohort: Cohort) -> list[Metrics]:
    """Each member's test figures with the model it chooses on its training samples (an
    unseen member: on its adaptation split, tested on the rest)."""
    from fedpers import mixture_update, records
    from fedpers.data.client import adaptation_split
    from fedpers.families import mixture

    local = mixture_update.Mixture(cohort, mixture.NO_DENSITY)
    stack = local.stacked()
    if records.config_int(local.config, protocol.UNSEEN, default=0):
        fraction = records.config_float(local.config, protocol.ADAPT_FRACTION)
        splits = [
            adaptation_split(d, fraction, local.run.seed, m.partition)
            for d, m in zip(local.data, local.members, strict=True)
        ]
        chooses = [(s[0], s[1]) for s in splits]
        tests = [(s[2], s[3]) for s in splits]
    else:
        chooses = [(d.x_train, d.y_train) for d in local.data]
        tests = [(d.x_test, d.y_test) for d in local.data]
    on_own = local.log_probs(stack, local.cohort_data(*zip(*chooses, strict=True)))
    on_test = local.log_probs(stack, local.cohort_data(*zip(*tests, strict=True)))
    return [
        local.test(member, one_hot(choice(lp, y), local.learners), x, yt, tp)
        for member, lp, (_, y), (x, yt), tp in zip(
            local.members, on_own, chooses, tests, on_test, strict=True
        )
    ]


ROWS = (
    AlgorithmSpec(
        name="ifca",
        family=Family.MIXTURE,
        shared=MODEL_PARTS,
        strategy="fedpers.strategies.ifca:IFCA",
        unseen=True,
        personal_state=False,  # the choice is made again each time, from the models
        paper="Ghosh et al., NeurIPS 2020",
    ),
)
