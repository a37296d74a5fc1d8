"""FedRoD (Chen and Chao, "On Bridging Generic and Personalized Federated Learning for
Image Classification", ICLR 2022).

Each client's model has a body ``f``, a generic head ``h_G`` (body and generic head are
shared: the server runs FedAvg on them) and a personal head ``h_P`` of the same shape,
kept in ``context.state``. On each of its mini-batches, for the round's ``epochs``, a
sampled client takes one SGD step on

    BSM(h_G(z), y) + CE(h_G(z).detach() + h_P(z.detach()), y),     z = f(x):

the balanced softmax (the cross-entropy of ``h_G(z) + log n_c``, ``n_c`` the client's
training samples of class ``c``) trains the body and the generic head toward a
class-balanced (generic) model; the second term trains the personal head alone, on top
of the generic prediction. Both terms' parameters are disjoint, so one step of their
sum is the two optimizers of the authors' code with the same learning rate. A client
predicts with ``h_G(z) + h_P(z)``; an unseen client, which has no personal head, with
the generic model ``h_G(f(x))`` (the paper's generic accuracy).

What differs from the paper, and why: ``h_P`` starts as a copy of the seeded generic
head (as PFLlib's FedRoD does; the paper leaves it open), and the hypernetwork variant
of ``h_P`` is not built. A class with no training sample gets ``log n_c = -10^4`` in
place of ``-inf`` (its probability underflows to zero either way), so that a padded
row of a cohort's batch stays finite.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.protocol import BODY, HEAD, MODEL_PARTS

if TYPE_CHECKING:
    import torch

    from fedpers.cohort import Arrays, Cohort, Metrics, Reply
    from fedpers.training import View
    from fedpers.update import Personalized

PERSONAL_HEAD = "phead"  # the personal head's part in the cohort's stack
STATE_HEAD = "fedpers.fedrod.head"  # a client's h_P, in context.state
ABSENT_CLASS = -1.0e4  # log n_c of a class without a training sample


@cache
def _two_heads() -> type:
    """The module a FedRoD cohort trains: body, generic head, personal head; its
    forward is the personal prediction ``h_G(f(x)) + h_P(f(x))``."""
    import copy

    from torch import nn

    class TwoHeads(nn.Module):
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.body: nn.Module = model.body
            self.head: nn.Module = model.head
            self.phead: nn.Module = copy.deepcopy(model.head)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            z = self.body(x)
            return self.head(z) + self.phead(z)

    return TwoHeads


def objective(model: View, batch: tuple[Any, ...], inputs: Any) -> torch.Tensor:
    """One client's step: the balanced softmax of the generic head (``inputs``: the
    client's ``log n_c``) plus the personal head's cross-entropy on top of the detached
    generic logits (the module's note)."""
    import torch.nn.functional as F

    x, y, weight, count, _ = batch
    z = model.part(BODY, x)
    generic = model.part(HEAD, z)
    balanced = F.cross_entropy(generic + inputs, y, reduction="none")
    personal = F.cross_entropy(
        generic.detach() + model.part(PERSONAL_HEAD, z.detach()), y, reduction="none"
    )
    return ((balanced + personal) * weight).sum() / count


def _log_counts(local: Personalized) -> torch.Tensor:
    """Every member's ``log n_c`` (K, classes), ``ABSENT_CLASS`` where ``n_c = 0``."""
    import torch

    classes = local.run.num_classes
    counts = np.stack([np.bincount(d.y_train, minlength=classes) for d in local.data])
    logs = np.where(counts > 0, np.log(np.maximum(counts, 1)), ABSENT_CLASS)
    return torch.as_tensor(logs, dtype=local.dtype or torch.float32, device=local.device)


def _models(local: Personalized) -> Any:
    """Every member's body and generic head as received, and its personal head as
    kept (the seeded generic head before its first round)."""
    from fedpers import update

    template = _two_heads()(local.model)
    seeded = {
        PERSONAL_HEAD + k[len(HEAD) :]: v
        for k, v in template.state_dict().items()
        if k.startswith(HEAD + ".")
    }
    arrays = []
    for member, received in zip(local.members, local.received(), strict=True):
        kept = update.kept(member, STATE_HEAD)
        arrays.append({**received, **(kept or {k: v.numpy() for k, v in seeded.items()})})
    return local.stack(template, arrays)


def fit(cohort: Cohort) -> list[Reply]:
    """Each member's epochs on the two-headed objective; replies the body and generic
    head, keeps the personal head."""
    from fedpers import protocol, records, training, update

    local = update.Personalized(cohort)
    stack = _models(local)
    stats = training.train(
        stack,
        local.train_data(),
        parts=(*MODEL_PARTS, PERSONAL_HEAD),
        epochs=records.config_int(local.config, protocol.EPOCHS),
        settings=local.sgd(),
        generators=local.generators("train", local.round),
        augment=local.augment,
        objective=objective,
        inputs=_log_counts(local),
    )
    for member, heads, s in zip(local.members, stack.arrays((PERSONAL_HEAD,)), stats, strict=True):
        if s.steps:
            member.state[STATE_HEAD] = update.to_record(heads)
    return update.fit_replies(stack.arrays(MODEL_PARTS), stats)


def evaluate(cohort: Cohort) -> list[Metrics]:
    """Each member's test figures with ``h_G + h_P`` on the global body; an unseen
    member (config ``unseen``) with the generic model alone."""
    from fedpers import protocol, records, training, update

    local = update.Personalized(cohort)
    if records.config_int(local.config, protocol.UNSEEN, default=0):
        fraction = records.config_float(local.config, protocol.ADAPT_FRACTION)
        tests = training.evaluate(local.models(), local.adaptation_data(fraction)[1])
        return [update.test_metrics(s) for s in tests]
    stack = _models(local)
    return [update.test_metrics(s) for s in training.evaluate(stack, local.test_data())]


def personal_head(arrays: Arrays) -> Arrays:
    """A kept ``h_P`` by the model's head names (for tests and tools)."""
    return {HEAD + k[len(PERSONAL_HEAD) :]: v for k, v in arrays.items()}


ROWS = (
    AlgorithmSpec(
        name="fedrod",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        unseen=True,
        personal_state=True,  # h_P
        paper="Chen and Chao, ICLR 2022",
    ),
)
