"""CoMFed (Badi, Ben Issaid and Bennis, "Communication-Efficient and Robust Multi-Modal
Federated Learning via Latent-Space Consensus", IEEE WCL 2026, arXiv 2603.19067),
between Sheaf-FRL's agents of any architecture and latent dimension ``d_i``.

Agent ``i`` keeps a projection ``P_i`` (``d x d_i``, ``d`` = ``comfed-dim``,
Xavier-uniform from the run's seed) into a shared latent space. Each round it sends its
projected class prototypes ``u_im = P_i v_bar_im`` (the mean eval-mode latent of its
training samples of class ``m``; zeros and count 0 for a class it does not hold) to its
neighbours, and receives theirs. It then trains, over each mini-batch,

    CE(head(z), y) + lambda mean_m ||P_i v_bar_m(batch) - c_im||^2,   z = body(x),

the mean over the batch's classes that some neighbour holds, ``v_bar_m(batch)`` the
batch's mean latent of class ``m`` and ``c_im`` the mean of the neighbours' ``u_jm``
(held fixed), with one step of the run's optimizer on the model and one on ``P_i``
from the same gradient, each clipped at ``sheaf-clip`` (a batch without such a class
has no term, and ``P_i`` does not move in that step). This is the paper's objective
(eq. 7) with the concurrent steps (8)-(9) as the Sheaf-FRL authors' baseline takes
them; the paper's geometric-median (robust) consensus is not implemented: the mean is
the variant the Sheaf-FRL paper compares against. Neighbours' prototypes come from the
start of the round (one exchange a round).

The batch's class means are masked tensor algebra (a one-hot matrix of the batch's real
rows): the same terms as a loop over the batch's classes, summed in another order.

Agents are tested with their own head on ``z`` (private accuracy). A receiver ``j``
decodes a sender's latents through the learned maps, ``pinv(P_j) P_i z``, with no
post-hoc alignment (whitening mode ``projection``, the paper's), and also aligned on
the pilots as the other baselines are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from flwr.app import Array, ArrayRecord

from fedpers import protocol, records, sheaf
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import PROTOTYPE_COUNTS, PROTOTYPES, Whitening
from fedpers.seeding import rng
from fedpers.settings import at_least, setting

if TYPE_CHECKING:
    from fedpers.agents_update import Agents
    from fedpers.cohort import Arrays, Cohort, Metrics, Reply
    from fedpers.config import RunConfig
    from fedpers.training import Stack, View

STATE_PROJECTION = "comfed.projection"  # context.state: P_i, under this name
TENSOR = "projection"  # P_i beside the model's tensors while it trains


@dataclass(frozen=True)
class ComFedSettings:
    """The latent-space consensus of CoMFed (the row `comfed`)."""

    HEADING: ClassVar[str] = "comfed"

    comfed_lambda: float = setting(
        0.01,
        "CoMFed: weight of the squared distance of each projected class prototype to its "
        "neighbours' mean, added to the cross-entropy (chosen on validation; the paper's 0.4)",
    )
    comfed_dim: int = setting(
        0, "CoMFed: dimension d of the shared latent space (0: the smallest latent dimension)"
    )

    def check(self) -> None:
        at_least("comfed-lambda", self.comfed_lambda, 0.0)
        at_least("comfed-dim", self.comfed_dim, 0)


def comfed_dim(run: RunConfig) -> int:
    """The shared dimension: as set, or the smallest latent dimension."""
    return run.group(ComFedSettings).comfed_dim or min(
        s.latent for s in sheaf_family.run_agent_specs(run)
    )


def projection(local: Agents, k: int) -> np.ndarray:
    """Member ``k``'s ``P_i``: as it kept it, or drawn from the run's seed (float32)."""
    record = local.members[k].state.get(STATE_PROJECTION)
    if isinstance(record, ArrayRecord):
        return records.values(record[STATE_PROJECTION]).copy()
    d, own = comfed_dim(local.run), local.spec(k).latent
    bound = np.sqrt(6.0 / (d + own))  # Xavier-uniform, as the Sheaf-FRL authors'
    generator = rng(local.run.seed, "comfed-projection", local.members[k].partition)
    return generator.uniform(-bound, bound, size=(d, own)).astype(np.float32)


def _keep(local: Agents, k: int, value: np.ndarray) -> None:
    local.writes[k][STATE_PROJECTION] = ArrayRecord(
        {STATE_PROJECTION: Array(records.contiguous(value))}
    )


# ---------------------------------------------------------------------- exchanges
def prototypes_message(cohort: Cohort) -> list[Reply]:
    """``P_i v_bar_m`` for every class (float32, zeros where not held) and the training
    samples behind each (float64); the model and ``P_i`` kept."""
    from fedpers import agents_update

    local = agents_update.Agents(cohort)

    def one(group: list[int], stack: Stack) -> list[np.ndarray]:
        local.keep(group, stack)
        return local.latents(stack, [local.data[k].x_train for k in group])

    latents = local.each(one)
    replies: list[Reply] = []
    for k, z in enumerate(latents):
        means, counts = sheaf.class_means(z, local.data[k].y_train, local.run.num_classes)
        mine = projection(local, k)
        _keep(local, k, mine)
        projected = means @ mine.astype(np.float64).T
        replies.append(({PROTOTYPES: projected.astype(np.float32), PROTOTYPE_COUNTS: counts}, {}))
    local.commit()
    return replies


def targets(local: Agents, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``c_im``: per class, the mean of member ``k``'s neighbours' projected prototypes
    over those that hold the class (float32); and which classes have one (1.0)."""
    classes, d = local.run.num_classes, comfed_dim(local.run)
    total, held = np.zeros((classes, d)), np.zeros(classes)
    arrays = local.members[k].arrays
    for j in sheaf.neighbours(sheaf_family.run_graph(local.run), local.members[k].partition):
        name = sheaf_family.from_agent(PROTOTYPES, j)
        if name not in arrays:
            continue
        has = arrays[sheaf_family.from_agent(PROTOTYPE_COUNTS, j)] > 0
        total[has] += arrays[name][has].astype(np.float64)
        held += has
    means = total / np.maximum(held, 1.0)[:, None]
    return means.astype(np.float32), (held > 0).astype(np.float64)


# ------------------------------------------------------------------------ update
def fit(cohort: Cohort) -> list[Reply]:
    """The round's epochs on CE + lambda x the consensus term; one step on the model and
    one on ``P_i`` per mini-batch."""
    from fedpers import agents_update

    local = agents_update.Agents(cohort)
    lam = cohort.run.group(ComFedSettings).comfed_lambda

    def one(group: list[int], stack: Stack) -> list[Reply]:
        given = [targets(local, k) for k in group]
        inputs = {
            "targets": local.floats([t for t, _ in given]),
            "known": local.floats([known for _, known in given]),
        }
        trained = [agents_update.Trained(tuple(stack.names(protocol.MODEL_PARTS)))]
        if lam > 0:
            trained.append(agents_update.Trained((TENSOR,), active=reached(inputs["known"])))
        steps = local.train(
            group, stack, objective(lam, local.run.num_classes), inputs=inputs, trained=trained
        )
        local.keep(group, stack)
        for k, value in zip(group, stack.arrays((TENSOR,)), strict=True):
            _keep(local, k, value[TENSOR])
        replies: list[Reply] = []
        for k, s in zip(group, steps, strict=True):
            metrics: Metrics = {protocol.NUM_EXAMPLES: float(len(local.data[k].y_train))}
            if s.seen:
                metrics[protocol.LOSS] = s.total / s.seen
                metrics[sheaf_family.PENALTY] = s.penalty_total / s.seen
            replies.append(({}, metrics))
        return replies

    replies = local.each(one, training=True, extra=lambda k: {TENSOR: projection(local, k)})
    local.commit()
    return replies


def reached(known: Any) -> Any:
    """Which members' consensus term a step has (K bools): a real row of a class one
    of its neighbours holds."""

    def active(batch: Any) -> Any:
        hit = known.gather(1, batch.y) > 0
        return (hit & (batch.weight > 0)).any(dim=1)

    return active


def objective(lam: float, classes: int) -> Any:
    """One agent's loss of a step: the mean cross-entropy plus ``lambda`` times the mean
    over the batch's classes with a target of ``||P v_bar_m - c_m||^2``; and that mean
    (the penalty; 0 without such a class)."""
    import torch

    from fedpers import agents_update

    def loss_of(model: View, batch: tuple[Any, ...], inputs: Any) -> Any:
        x, y, weight, count, _ = batch
        z = model.part(protocol.BODY, x)
        loss = agents_update.mean_cross_entropy(model.part(protocol.HEAD, z), y, weight, count)
        if lam == 0:
            return loss, torch.zeros_like(loss)
        labels = torch.arange(classes, device=y.device)
        rows = (y[:, None] == labels[None, :]).to(z.dtype) * weight[:, None]
        held = rows.sum(dim=0)
        means = (rows.T @ z) / held.clamp(min=1.0)[:, None]
        squared = ((means @ model[TENSOR].T - inputs["targets"]) ** 2).sum(dim=1)
        present = (held > 0).to(z.dtype) * inputs["known"]
        consensus = (squared * present).sum() / present.sum().clamp(min=1.0)
        return loss + lam * consensus, consensus

    return loss_of


# -------------------------------------------------------------------------- tests
def latents_message(cohort: Cohort) -> list[Reply]:
    """With whitening ``projection``: pilots and test latents through ``P_i`` (the
    paper's); otherwise as every agent of the family."""
    from fedpers import agents_update

    if str(cohort.config.get(sheaf_family.WHITENING, "")) != Whitening.PROJECTION:
        return agents_update.latents_message(cohort)
    local = agents_update.Agents(cohort)

    def one(group: list[int], stack: Stack) -> list[Reply]:
        pilots = local.latents(stack)
        tests = local.latents(stack, [local.data[k].x_test for k in group])
        replies: list[Reply] = []
        for k, p, t in zip(group, pilots, tests, strict=True):
            mine = projection(local, k).astype(np.float64)
            arrays: Arrays = {
                sheaf_family.PILOTS: p @ mine.T,
                sheaf_family.LATENTS: t @ mine.T,
                sheaf_family.LABELS: local.data[k].y_test.astype(np.int64),
            }
            replies.append((arrays, {}))
        return replies

    return local.each(one)


def evaluate(cohort: Cohort) -> list[Metrics]:
    """With whitening ``projection`` and ``communication = 1``: decode each neighbour's
    ``P_j z`` as ``pinv(P_i) P_j z`` with this agent's head; otherwise as every agent
    of the family."""
    from fedpers import agents_update

    mode = str(cohort.config.get(sheaf_family.WHITENING, ""))
    communication = records.config_int(cohort.config, sheaf_family.COMMUNICATION, default=0)
    if not communication or mode != Whitening.PROJECTION:
        return agents_update.evaluate(cohort)
    local = agents_update.Agents(cohort)

    def one(group: list[int], stack: Stack) -> list[Metrics]:
        out = []
        for i, k in enumerate(group):
            inverse = np.linalg.pinv(projection(local, k).astype(np.float64))
            arrays = local.members[k].arrays

            def decode(sender: int, inverse: np.ndarray = inverse, arrays: Arrays = arrays) -> Any:
                return arrays[sheaf_family.from_agent(sheaf_family.LATENTS, sender)] @ inverse.T

            head = agents_update.head(local, stack, i)
            out.append(agents_update.decoding_metrics(arrays, sheaf_family.LATENTS, decode, head))
        return out

    return local.each(one)


ROWS = (
    AlgorithmSpec(
        name="comfed",
        family=Family.SHEAF,
        shared=(),
        strategy="fedpers.strategies.comfed:ComFed",
        settings=(ComFedSettings,),
        paper="Badi et al., IEEE WCL 2026",
    ),
)
