"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang and Zhang, "FedProto: Federated Prototype
Learning across Heterogeneous Clients", AAAI 2022, Algorithm 1), between Sheaf-FRL's
agents: encoders of any architecture with one latent dimension ``d``; no model
parameter leaves an agent.

Each round every agent receives the global prototypes ``C_bar^j`` (the mean latent of
class ``j`` over all agents, ``strategies/fedproto.py``; none in round 1) and trains its
whole model for the round's epochs on

    CE(head(z), y) + lambda mean ||z - C_bar^y||^2,    z = body(x),

over each mini-batch (the mean over the batch's samples and the latent's ``d``
entries, as the authors' ``nn.MSELoss``; samples of a class without a global prototype
add nothing). Then it sends its own prototypes ``C_i^j``, the mean eval-mode latent of
its training samples of class ``j``, and how many samples each holds. Steps are the
run's optimizer with Sheaf-FRL's gradient clip, as every agent of the family trains.
Agents are tested with their own head (private accuracy) and, after the last round,
aligned on the pilots as Sheaf-FRL's baselines are (communication accuracy).

The prototype term is masked tensor algebra (a batch without a sample of a class with a
prototype adds a term of 0): the same bits as adding no term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from fedpers import protocol, sheaf
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import PROTOTYPE_COUNTS, PROTOTYPES
from fedpers.settings import ConfigError, at_least, setting

if TYPE_CHECKING:
    from fedpers.agents_update import Agents
    from fedpers.cohort import Arrays, Cohort, Reply
    from fedpers.config import RunConfig
    from fedpers.training import Stack, View

# In rounds.jsonl under the trimmed mean: classes too few replies held, which kept their
# last prototype
CLASSES_UNCHANGED = "classes-unchanged"


@dataclass(frozen=True)
class FedProtoSettings:
    """The prototype regularizer of FedProto (the row `fedproto`)."""

    HEADING: ClassVar[str] = "fedproto"

    fedproto_lambda: float = setting(
        1.0,
        "FedProto: weight of the mean squared distance of each training latent to its "
        "class's global prototype, added to the cross-entropy (the paper's ld, 1)",
    )

    def check(self) -> None:
        at_least("fedproto-lambda", self.fedproto_lambda, 0.0)


def check_dimensions(run: RunConfig) -> None:
    """Class prototypes are averaged over the agents: one latent dimension."""
    dims = {spec.latent for spec in sheaf_family.run_agent_specs(run)}
    if len(dims) > 1:
        raise ConfigError(
            f"algorithm '{run.algorithm}' averages class prototypes of the agents' latents, "
            f"which needs equal latent dimensions, found {sorted(dims)}: set "
            "'sheaf-latent-dims' to one value per agent, all equal."
        )


def fit(cohort: Cohort) -> list[Reply]:
    """The round's epochs on the loss plus the prototype term; replies each agent's
    prototypes and the samples behind each."""
    from fedpers import agents_update

    local = agents_update.Agents(cohort)
    lam = cohort.run.group(FedProtoSettings).fedproto_lambda

    def one(group: list[int], stack: Stack) -> list[Reply]:
        received = [_targets(local, k) for k in group]
        inputs = {
            "targets": local.floats([t for t, _ in received]),
            "known": local.floats([known for _, known in received]),
        }
        steps = local.train(group, stack, objective(lam), inputs=inputs)
        local.keep(group, stack)
        latents = local.latents(stack, [local.data[k].x_train for k in group])
        replies: list[Reply] = []
        for k, z, s in zip(group, latents, steps, strict=True):
            means, counts = sheaf.class_means(z, local.data[k].y_train, local.run.num_classes)
            metrics = {protocol.NUM_EXAMPLES: float(len(local.data[k].y_train))}
            if s.seen:
                metrics[protocol.LOSS] = s.total / s.seen
            replies.append(
                ({PROTOTYPES: means.astype(np.float32), PROTOTYPE_COUNTS: counts}, metrics)
            )
        return replies

    replies = local.each(one, training=True)
    local.commit()
    return replies


def _targets(local: Agents, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Member ``k``'s global prototypes (classes x d) and which classes have one (1.0),
    from its message (none: zeros)."""
    arrays: Arrays = local.members[k].arrays
    classes, d = local.run.num_classes, local.spec(k).latent
    if PROTOTYPES not in arrays:
        return np.zeros((classes, d), dtype=np.float32), np.zeros(classes)
    known = (arrays[PROTOTYPE_COUNTS] > 0).astype(np.float64)
    return arrays[PROTOTYPES].astype(np.float32), known


def objective(lam: float) -> Any:
    """One agent's loss of a step: the mean cross-entropy plus ``lambda`` times the mean
    over the batch's samples of ``mean_d (z - C_bar^y)^2``, a sample of a class without
    a prototype counted as 0 (``nn.MSELoss`` over the batch); no penalty recorded."""
    import torch

    from fedpers import agents_update

    def loss_of(model: View, batch: tuple[Any, ...], inputs: Any) -> Any:
        x, y, weight, count, _ = batch
        z = model.part(protocol.BODY, x)
        loss = agents_update.mean_cross_entropy(model.part(protocol.HEAD, z), y, weight, count)
        if lam > 0:
            mask = inputs["known"][y] * weight
            apart = (z - inputs["targets"][y]).pow(2).mean(dim=1) * mask
            loss = loss + lam * (apart.sum() / count)
        return loss, torch.zeros_like(loss)

    return loss_of


ROWS = (
    AlgorithmSpec(
        name="fedproto",
        family=Family.SHEAF,
        shared=(),
        strategy="fedpers.strategies.fedproto:FedProto",
        settings=(FedProtoSettings,),
        checks=(check_dimensions,),
        wire=(CLASSES_UNCHANGED,),
        paper="Tan et al., AAAI 2022",
    ),
)
