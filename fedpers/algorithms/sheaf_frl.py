"""Sheaf-FRL (Sheaf-based Federated Representation Learning, 2026): agents of different
architectures whose latent spaces are glued along a graph by restriction maps learned on
shared pilot samples; the whole model stays in ``context.state``.

A round of the default (heterogeneous) protocol:
1. ``query.pilots``: refit the whitening on the current pilot latents, send the
   whitened pilot matrix ``A_i`` (the only thing that leaves the agent; the family's
   ``pilots_message``);
2. ``train``: receive the neighbours' pilot matrices, refit every incident restriction
   map in closed form (Procrustes; both endpoints compute the same map from the same
   two matrices), then train on the private loss plus ``lambda`` times the gluing
   penalty of those edges on pilot batches, neighbours' pilots held fixed.

Variants with equal latent dimensions: ``homogeneous`` (the edge's source computes the
one SVD of the edge, ``query.maps``, and sends its pilots already transported; its raw
latents never leave it) and ``private`` (every agent only ever sends pilots transported
into its neighbour's coordinates with the current map, ``query.transport``; both
endpoints correct the map by a Procrustes step on what they receive, which lands both
on the same optimum). ``non-cooperative`` (``fedpers.algorithms.non_cooperative``)
trains with lambda = 0 and exchanges nothing.

The gluing penalty of a step is computed on a batch of pilots that each agent draws
from its training generator (after the step's batch order), with all pilots through
its encoder in evaluation mode (the maps were fitted on evaluation-mode latents),
whitened by their own statistics with gradient (``fedpers.models.agents.
pilot_whitening``). An agent without an edge trains on its private loss alone and
draws no pilots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, ArrayRecord

from fedpers import protocol, records, sheaf
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import SheafVariant

if TYPE_CHECKING:
    import torch

    from fedpers.agents_update import Agents
    from fedpers.cohort import Arrays, Cohort, Reply
    from fedpers.training import Stack, View

STATE_MAPS = "sheaf.maps"  # context.state: the maps of the agent's edges, by neighbour
STATE_NEIGHBOUR_PILOTS = "sheaf.neighbour-pilots"  # homogeneous: owned edges' targets' pilots

Edge = tuple[np.ndarray, np.ndarray | None]
"""An edge's term: ``(target, restriction)``, the penalty comparing ``own @ restriction``
(or ``own`` where None) with ``target``, one row per pilot."""


def fit(cohort: Cohort) -> list[Reply]:
    """Refit the incident maps, then the round's epochs on the private loss plus
    ``lambda`` times the gluing penalty (with lambda = 0: the private loss alone)."""
    from fedpers import agents_update

    lam = sheaf_family.settings(cohort.run).sheaf_lambda
    if lam == 0:
        return agents_update.fit(cohort)
    local = agents_update.Agents(cohort)

    def one(group: list[int], stack: Stack) -> list[Reply]:
        own = local.own_pilots(stack)
        edges = [edge_targets(local, k, mine) for k, mine in zip(group, own, strict=True)]
        steps = glued(local, group, stack, edges, lam)
        local.keep(group, stack)
        return [
            (
                {},
                {
                    protocol.NUM_EXAMPLES: float(len(local.data[k].y_train)),
                    protocol.LOSS: s.last_loss,
                    sheaf_family.PENALTY: s.mean_penalty,
                },
            )
            for k, s in zip(group, steps, strict=True)
        ]

    replies = local.each(one, training=True)
    local.commit()
    return replies


# ------------------------------------------------------------------------ edges
def edge_targets(local: Agents, k: int, own: np.ndarray) -> list[Edge]:
    """Member ``k``'s incident edges, each the neighbour's pilots in its frame of
    reference (``Edge``), from what it was sent (as its variant relays them) and its own
    whitened pilots ``own``; the maps it keeps written to ``local.writes``."""
    variant = sheaf_family.settings(local.run).sheaf_variant
    if variant == SheafVariant.HETEROGENEOUS:
        return _heterogeneous(local, k, own)
    if variant == SheafVariant.HOMOGENEOUS:
        return _homogeneous(local, k)
    return _private(local, k, own)


def _heterogeneous(local: Agents, k: int, own: np.ndarray) -> list[Edge]:
    agent, dims = local.members[k].partition, local.dims
    edges: list[Edge] = []
    fitted: dict[str, Array] = {}
    for name, theirs in sorted(local.members[k].arrays.items()):
        _, neighbour = sheaf_family.agent_of(name)
        restriction = sheaf_family.restriction(agent, neighbour, own, theirs, dims)
        fitted[str(neighbour)] = Array(restriction)
        if sheaf.orient(agent, neighbour, dims)[0] == agent:
            edges.append((sheaf.transport_down(theirs, restriction), None))  # small side
        else:
            edges.append((theirs, restriction))  # large side: own @ V vs their pilots
    local.writes[k][STATE_MAPS] = ArrayRecord(fitted)
    return edges


def _homogeneous(local: Agents, k: int) -> list[Edge]:
    member = local.members[k]
    maps = _stored(member.state, STATE_MAPS)  # owned edges' maps (set by maps_message)
    kept = _stored(member.state, STATE_NEIGHBOUR_PILOTS)
    edges: list[Edge] = [
        (kept[key], maps[key].T)
        for key in sorted(kept, key=int)  # own O^T vs theirs
    ]
    for name, received in sorted(member.arrays.items()):
        kind, agent = sheaf_family.agent_of(name)
        key = str(agent)
        if kind == sheaf_family.MAP:  # the owner's map of our edge, relayed
            maps[key] = received
        else:  # the owner's pilots, already transported into this frame
            edges.append((received, None))
    local.writes[k][STATE_MAPS] = ArrayRecord({key: Array(v) for key, v in maps.items()})
    return edges


def _private(local: Agents, k: int, own: np.ndarray) -> list[Edge]:
    member = local.members[k]
    current = _stored(member.state, STATE_MAPS)
    updated: dict[str, Array] = {}
    edges: list[Edge] = []
    for name, received in sorted(member.arrays.items()):
        key = str(sheaf_family.agent_of(name)[1])
        # `received` = their pilots through their map to me, W_j M_ji. The best
        # correction R (received R^T ~ own) makes M_ji R^T the optimal map, and my
        # map to them its transpose R M_ij; the neighbour, correcting from the other
        # side, reaches the same optimum (Procrustes is unique).
        correction = sheaf.procrustes(received, own)
        updated[key] = Array(correction @ current.get(key, np.eye(own.shape[1])))
        edges.append((received @ correction.T, None))
    local.writes[k][STATE_MAPS] = ArrayRecord(updated)
    return edges


def _stored(state: Any, key: str) -> dict[str, np.ndarray]:
    record = state.get(key)
    if not isinstance(record, ArrayRecord):
        return {}
    return {k: records.values(v) for k, v in record.items()}


# ---------------------------------------------------------------------- penalty
@dataclass(frozen=True)
class Slot:
    """The ``e``-th edge of every member of a group (members' edges differ in number
    and shape): whether any has a map (the others' is the identity, an exact product),
    whether some member has no ``e``-th edge (then masked), and the penalty's divisor
    ``2 B d_t`` where all members share it (else a tensor input)."""

    restricted: bool
    partial: bool
    divisor: int | None


def slots(
    local: Agents, edges: list[list[Edge]], rows: int, latent: int
) -> tuple[list[Slot], list[dict[str, torch.Tensor]]]:
    """The group's edges slot by slot (``latent``: its agents' dimension, ``rows``: the
    pilots of a step): the objective's static ``Slot``s and its inputs, per slot each
    member's target pilots, map, presence and divisor, stacked (a missing edge zeros;
    targets and maps padded with zero columns to the slot's widest target)."""
    found, inputs = [], []
    for e in range(max(len(own) for own in edges)):
        mine = [own[e] if e < len(own) else None for own in edges]
        present = [m for m in mine if m is not None]
        wide = max(t.shape[1] for t, _ in present)
        divisors = {2 * rows * t.shape[1] for t, _ in present}
        partial = len(present) < len(mine)
        slot = Slot(
            restricted=any(r is not None for _, r in present),
            partial=partial,
            divisor=divisors.pop() if len(divisors) == 1 and not partial else None,
        )
        found.append(slot)
        inputs.append(_slot_inputs(local, mine, slot, (rows, wide, latent)))
    return found, inputs


def _slot_inputs(
    local: Agents, mine: list[Edge | None], slot: Slot, shape: tuple[int, int, int]
) -> dict[str, torch.Tensor]:
    rows, wide, latent = shape
    count = len(local.pilots[1])
    targets, maps, present, divisors = [], [], [], []
    for edge in mine:
        target, restriction = edge if edge is not None else (np.zeros((count, wide)), None)
        targets.append(_pad(target, wide))
        if restriction is None:
            restriction = np.eye(latent) if edge is not None else np.zeros((latent, wide))
        maps.append(_pad(restriction, wide))
        present.append(1.0 if edge is not None else 0.0)
        divisors.append(float(2 * rows * target.shape[1]) if edge is not None else 1.0)
    given = {"target": local.floats(targets)}
    if slot.restricted:
        given["restriction"] = local.floats(maps)
    if slot.partial:
        given["present"] = local.floats(present)
    if slot.divisor is None:
        given["divisor"] = local.floats(divisors)
    return given


def _pad(values: np.ndarray, width: int) -> np.ndarray:
    """``values`` with zero columns up to ``width``."""
    if values.shape[1] == width:
        return values
    return np.pad(values, ((0, 0), (0, width - values.shape[1])))


def gluing(lam: float, pilots: torch.Tensor, found: list[Slot]) -> Any:
    """One agent's loss of a step: the mean cross-entropy plus ``lambda`` times the gluing
    penalty of its edges (``fedpers.sheaf.gluing_penalty_torch``'s terms, in its edges'
    order, on the step's pilot batch ``batch[4]``), and the penalty."""
    import torch

    from fedpers import training
    from fedpers.models.agents import pilot_whitening

    def objective(model: View, batch: tuple[Any, ...], inputs: Any) -> Any:
        loss = training.cross_entropy(model, batch, None)
        index = batch[4]
        with training.training_mode(model.template, False):
            whitened, _, _ = pilot_whitening(model.part(protocol.BODY, pilots))
        own = whitened[index]
        total = torch.zeros((), dtype=own.dtype, device=own.device)
        for slot, given in zip(found, inputs, strict=True):
            mine = own @ given["restriction"] if slot.restricted else own
            residual = mine - given["target"][index]
            divisor = given["divisor"] if slot.divisor is None else slot.divisor
            term = residual.pow(2).sum() / divisor
            total = total + (term * given["present"] if slot.partial else term)
        return loss + lam * total, total

    return objective


def glued(
    local: Agents, group: list[int], stack: Stack, edges: list[list[Edge]], lam: float
) -> list[Any]:
    """The group's epochs on the private loss plus ``lambda`` times the gluing penalty
    of each member's ``edges``; a member without any draws no pilots."""
    import torch

    from fedpers import agents_update

    if not any(edges):
        return local.train(group, stack, agents_update.private)
    pilots = local.pilot_tensor
    batch = sheaf_family.settings(local.run).sheaf_pilot_batch
    count = len(pilots)

    def draw(generator: torch.Generator) -> torch.Tensor:
        return torch.randperm(count, generator=generator)[:batch]

    found, inputs = slots(local, edges, min(batch, count), local.spec(group[0]).latent)
    draws = [draw if own else None for own in edges]
    return local.train(group, stack, gluing(lam, pilots, found), inputs=inputs, draws=draws)


# ---------------------------------------------------------------------- queries
def maps_message(cohort: Cohort) -> list[Reply]:
    """Homogeneous variant, edge source: one SVD per owned edge (kept, with the
    target's pilots); replies its own pilots transported into each owned neighbour's
    coordinates and the map (its raw pilots never leave it)."""
    from fedpers import agents_update

    local = agents_update.Agents(cohort)
    own = local.each(lambda group, stack: local.own_pilots(stack))
    replies: list[Reply] = [(_maps(local, k, own[k]), {}) for k in range(local.size)]
    local.commit()
    return replies


def _maps(local: Agents, k: int, own: np.ndarray) -> Arrays:
    agent, dims = local.members[k].partition, local.dims
    maps, kept, out = {}, {}, {}
    for name, theirs in local.members[k].arrays.items():
        _, neighbour = sheaf_family.agent_of(name)
        restriction = sheaf_family.restriction(agent, neighbour, own, theirs, dims)
        maps[str(neighbour)] = Array(restriction)
        kept[str(neighbour)] = Array(theirs)
        out[sheaf_family.from_agent(sheaf_family.TRANSPORTED, neighbour)] = (
            sheaf_family.to_neighbour(agent, neighbour, own, restriction, dims)
        )
        out[sheaf_family.from_agent(sheaf_family.MAP, neighbour)] = restriction
    local.writes[k][STATE_MAPS] = ArrayRecord(maps)
    local.writes[k][STATE_NEIGHBOUR_PILOTS] = ArrayRecord(kept)
    return out


def transport_message(cohort: Cohort) -> list[Reply]:
    """Private variant: each agent's own pilots in each neighbour's coordinates (the
    message's ``neighbours``), through its current maps (the identity before any)."""
    from fedpers import agents_update

    local = agents_update.Agents(cohort)
    own = local.each(lambda group, stack: local.own_pilots(stack))
    replies: list[Reply] = []
    for k, member in enumerate(local.members):
        neighbours = [int(n) for n in member.arrays.get(sheaf_family.NEIGHBOURS, np.zeros(0))]
        maps = _stored(member.state, STATE_MAPS)
        eye = np.eye(own[k].shape[1])
        sent = {
            sheaf_family.from_agent(sheaf_family.TRANSPORTED, j): own[k] @ maps.get(str(j), eye)
            for j in neighbours
        }
        replies.append((sent, {}))
    return replies


ROWS = (
    AlgorithmSpec(
        name="sheaf-frl",
        family=Family.SHEAF,
        shared=(),
        strategy="fedpers.strategies.peer_relay:PeerRelay",
        paper="Sheaf-FRL, 2026",
    ),
)
