"""The sheaf family: Sheaf-FRL, its non-cooperative baseline, FedProto, Sheaf-FMTL,
FedMuscle and CoMFed. No shared model.

Agents with different architectures and latent dimensions sit on a graph; each keeps
its whole model on the device and aligns its latent space with its neighbours' through
restriction maps learned from shared pilot samples. The server only relays pilots
between neighbours (``strategies/peer_relay.py``; the math is ``fedpers.sheaf``). This
module holds the family's settings, its checks, the agents and the graph of a run, its
wire names, the relay queries, the communication test's result and the summary; it
never imports torch. The family's local update, what every agent does whatever its row
(``fit``: its whole model, kept in ``context.state``, trained on its private loss;
``evaluate``: its private accuracy, or its neighbours' latents decoded; the pilot and
latent exchanges), is ``fedpers.agents_update``, which the family names as its update
module (``FamilySpec.update``) and the ClientApp imports on the device; each row's
module (``fedpers.algorithms.sheaf_frl``, ``fedproto``, ``sheaf_fmtl``, ``fedmuscle``,
``comfed``, ``non_cooperative``) holds what its agents do differently.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np

from fedpers import families, protocol, sheaf
from fedpers.data.client import DataConfig, PilotSplit
from fedpers.data.partition import target_classes
from fedpers.families import Faults, QuerySpec, RunSummary
from fedpers.faults import FaultTargets
from fedpers.protocol import FinalTestResult
from fedpers.results import final_mean
from fedpers.settings import ConfigError, at_least, int_list, positive, setting, within
from fedpers.sheaf import AgentSpec, agent_specs, class_overlap_graph, parameter_count

if TYPE_CHECKING:
    from fedpers.config import RunConfig

NAME = "sheaf"
DATASETS = ("digits", "mnist")  # the data sets with Sheaf-FRL agents


class SheafVariant(StrEnum):
    """How Sheaf-FRL's agents exchange pilots (``sheaf-variant``)."""

    HETEROGENEOUS = "heterogeneous"
    HOMOGENEOUS = "homogeneous"
    PRIVATE = "private"


class Whitening(StrEnum):
    """Statistics that whiten latents before they are compared across agents."""

    PILOTS = "pilots"  # Sheaf-FRL's: the pilots' own statistics
    TRAIN = "train"  # the paper's baseline: statistics of the training latents
    PROJECTION = "projection"  # CoMFed's own maps, no whitening: P_i z out, pinv(P_j) in


@dataclass(frozen=True)
class SheafSettings:
    """The Sheaf-FRL algorithms: sheaf-frl and its baseline, non-cooperative."""

    sheaf_shift: float = setting(0.9, "distribution shift s of the agents' data (0: uniform)")
    sheaf_lambda: float = setting(0.1, "weight of the gluing penalty")
    sheaf_pilot_fraction: float = setting(0.1, "share of the data held out as pilots, by all")
    sheaf_pilot_batch: int = setting(64, "pilots K per step")
    sheaf_density: float = setting(0.4, "edge density of the communication graph")
    sheaf_variant: SheafVariant = setting(
        SheafVariant.HETEROGENEOUS, "`homogeneous` and `private` need equal latent dimensions"
    )
    sheaf_latent_dims: str = setting(
        "",
        "comma-separated latent dimension per agent (empty: the paper's x `sheaf-latent-scale`)",
    )
    sheaf_hidden: str = setting(
        "", "comma-separated encoder width per agent (empty: the paper's x `sheaf-latent-scale`)"
    )
    sheaf_latent_scale: float = setting(
        0.125, "scale of the paper's latent dimensions (128...256 -> 16...32)"
    )
    sheaf_clip: float = setting(1.0, "gradient-norm clip of an agent's step (0: none)")

    def check(self) -> None:
        within("sheaf-shift", self.sheaf_shift, "[0, 1]")
        within("sheaf-pilot-fraction", self.sheaf_pilot_fraction, "(0, 1)")
        within("sheaf-density", self.sheaf_density, "(0, 1]")
        at_least("sheaf-lambda", self.sheaf_lambda, 0.0)
        at_least("sheaf-pilot-batch", self.sheaf_pilot_batch, 1)
        positive("sheaf-latent-scale", self.sheaf_latent_scale)
        at_least("sheaf-clip", self.sheaf_clip, 0.0)
        for key, text in (
            ("sheaf-latent-dims", self.sheaf_latent_dims),
            ("sheaf-hidden", self.sheaf_hidden),
        ):
            try:
                values = int_list(text)
            except ValueError as error:
                raise ConfigError(
                    f"run-config key '{key}' = '{text}' must be comma-separated integers."
                ) from error
            if any(v < 1 for v in values):
                raise ConfigError(f"run-config key '{key}' = '{text}' must be positive.")


def settings(run: RunConfig) -> SheafSettings:
    """The run's Sheaf-FRL settings, typed."""
    return run.group(SheafSettings)


def pilot_split(run: DataConfig) -> PilotSplit:
    """The agents' data: pilots held out for all, the rest split by the shift ``s``."""
    agents = run.group(SheafSettings)
    return PilotSplit(shift=agents.sheaf_shift, fraction=agents.sheaf_pilot_fraction)


def applies(run: RunConfig) -> bool:
    """True for the runs of this family."""
    return run.family.name == NAME


def run_agent_specs(run: RunConfig) -> list[AgentSpec]:
    """The heterogeneous agents of a run."""
    values = settings(run)
    return agent_specs(
        run.num_clients,
        scale=values.sheaf_latent_scale,
        latent_dims=int_list(values.sheaf_latent_dims) or None,
        hidden=int_list(values.sheaf_hidden) or None,
    )


def parameter_counts(run: RunConfig) -> list[int]:
    """Each agent's number of trainable parameters (no torch needed)."""
    return [parameter_count(spec, run.dataset, run.num_classes) for spec in run_agent_specs(run)]


def run_graph(run: RunConfig) -> list[tuple[int, int]]:
    """The agents' communication graph (oriented edges), the same on every party."""
    return class_overlap_graph(
        target_classes(run.num_clients, run.num_classes, run.seed),
        [spec.latent for spec in run_agent_specs(run)],
        settings(run).sheaf_density,
    )


# ---- Wire names ----------------------------------------------------------------------
WHITENING = "whitening"  # config: whiten with statistics of "pilots" or "train" latents
COMMUNICATION = "communication"  # config: 1: evaluate decoding neighbours' transported latents
PENALTY = "penalty"  # metric: mean gluing penalty of a round's steps
TEST_EXAMPLES = "test-examples"  # metric: test samples behind an agent's accuracy
PILOTS = "pilots"  # an agent's own whitened pilot latents (P x d)
LATENTS = "latents"  # an agent's whitened test latents
LABELS = "labels"  # the labels of those test samples
TRANSPORTED = "transported"  # pilots transported into a neighbour's coordinates
MAP = "map"  # an edge's restriction map, relayed from the endpoint that computed it
NEIGHBOURS = "neighbours"  # query.transport: the agent's neighbours (int64 array)
PROTOTYPES = "prototypes"  # FedProto, CoMFed: class prototypes (classes x d)
PROTOTYPE_COUNTS = "prototype-counts"  # FedProto, CoMFed: the samples behind each prototype
# The relayed arrays of Sheaf-FMTL and FedMuscle, here because the family's relay fault
# injection aims at them (``FamilySpec.fault_targets``)
PROJECTION = "projection"  # Sheaf-FMTL: P_ij theta_i, an agent's parameters on an edge
REPRESENTATIONS = "representations"  # FedMuscle: unit-norm latents of the round's pilots
STATE_MODEL = "sheaf.model"  # context.state: an agent's whole model


class SheafQuery(StrEnum):
    """The relay's queries (``query.<name>``)."""

    PILOTS = "pilots"  # an agent's whitened pilot latents
    MAPS = "maps"  # edge owners' maps -> transported pilots (homogeneous variant)
    TRANSPORT = "transport"  # pilots transported to each neighbour (private variant)
    LATENTS = "latents"  # whitened test latents, for communication accuracy
    PROJECTIONS = "projections"  # Sheaf-FMTL: P_ij theta_i for each neighbour j
    REPRESENTATIONS = "representations"  # FedMuscle: unit-norm latents of a pilot batch
    PROTOTYPES = "prototypes"  # CoMFed: projected class prototypes and their counts


QUERY_PILOTS = protocol.query_type(SheafQuery.PILOTS)
QUERY_MAPS = protocol.query_type(SheafQuery.MAPS)
QUERY_TRANSPORT = protocol.query_type(SheafQuery.TRANSPORT)
QUERY_LATENTS = protocol.query_type(SheafQuery.LATENTS)
QUERY_PROJECTIONS = protocol.query_type(SheafQuery.PROJECTIONS)
QUERY_REPRESENTATIONS = protocol.query_type(SheafQuery.REPRESENTATIONS)
QUERY_PROTOTYPES = protocol.query_type(SheafQuery.PROTOTYPES)


def edge_metric(sender: int) -> str:
    """Metric of the accuracy of decoding ``sender``'s transported latents: ``edge.3``."""
    return f"edge.{sender}"


EDGE_METRIC = r"edge\.(0|[1-9][0-9]{0,8})"  # an ``edge_metric`` key: ASCII digits, no sign


def edge_sender(key: str) -> int | None:
    """The sender of an ``edge_metric`` key, or None for any other metric (``edge.²``,
    ``edge.03`` and ``edge.-1`` are other metrics: ``str.isdigit`` accepts the first)."""
    match = re.fullmatch(EDGE_METRIC, key, re.ASCII)
    return int(match.group(1)) if match else None


def from_agent(name: str, agent: int) -> str:
    """``pilots`` of agent 3 as relayed to a neighbour: ``pilots.3``."""
    return f"{name}.{agent}"


def agent_of(name: str) -> tuple[str, int]:
    """``pilots.3`` -> ``("pilots", 3)``: the inverse of ``from_agent``."""
    kind, _, agent = name.rpartition(".")
    return kind, int(agent)


# ------------------------------------------------------------------ restriction maps
def restriction(
    agent: int, neighbour: int, own: np.ndarray, theirs: np.ndarray, dims: list[int]
) -> np.ndarray:
    """The map ``V`` (d_large x d_small) of the edge between ``agent`` and ``neighbour``,
    from their pilots (``own``: ``agent``'s, ``theirs``): both endpoints compute the same."""
    a, _ = sheaf.orient(agent, neighbour, dims)
    return sheaf.procrustes(own, theirs) if a == agent else sheaf.procrustes(theirs, own)


def to_neighbour(
    agent: int, neighbour: int, latents: np.ndarray, edge: np.ndarray, dims: list[int]
) -> np.ndarray:
    """``agent``'s latents in ``neighbour``'s coordinates, through the edge's map."""
    if sheaf.orient(agent, neighbour, dims)[0] == agent:
        return sheaf.transport_up(latents, edge)
    return sheaf.transport_down(latents, edge)


def from_neighbour(
    agent: int, neighbour: int, latents: np.ndarray, edge: np.ndarray, dims: list[int]
) -> np.ndarray:
    """``neighbour``'s latents in ``agent``'s coordinates, through the edge's map."""
    if sheaf.orient(agent, neighbour, dims)[0] == agent:
        return sheaf.transport_down(latents, edge)
    return sheaf.transport_up(latents, edge)


@dataclass(frozen=True)
class CommunicationTest(FinalTestResult):
    """Sheaf-FRL's communication accuracy: per whitening, the mean over receivers, and
    per directed edge ``(sender, receiver)``; and every agent's last private accuracy."""

    by_whitening: dict[str, float] = field(default_factory=dict)
    edges: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    private: dict[int, float] = field(default_factory=dict)


# ------------------------------------------------------------------------- checks
def check_agents(run: RunConfig) -> None:
    """One latent dimension and one width per agent (or none); for the family's runs, a
    data set with agents, two agents at least, and equal dimensions where the variant
    needs them."""
    values = settings(run)
    for key, text in (
        ("sheaf-latent-dims", values.sheaf_latent_dims),
        ("sheaf-hidden", values.sheaf_hidden),
    ):
        count = len(int_list(text))
        if count and count != run.num_clients:
            raise ConfigError(
                f"run-config key '{key}' lists {count} values for num-clients = "
                f"{run.num_clients} agents; give one per agent or leave it empty."
            )
    if not applies(run):
        return
    if run.dataset not in DATASETS:
        raise ConfigError(
            f"run-config key 'dataset' = '{run.dataset}' has no Sheaf-FRL agents; "
            f"choose one of: {', '.join(DATASETS)}."
        )
    if run.num_clients < 2:
        raise ConfigError("Sheaf-FRL needs num-clients >= 2 agents on a graph.")
    dims = {spec.latent for spec in run_agent_specs(run)}
    if values.sheaf_variant != SheafVariant.HETEROGENEOUS and len(dims) > 1:
        raise ConfigError(
            f"run-config key 'sheaf-variant' = '{values.sheaf_variant}' needs equal latent "
            f"dimensions, found {sorted(dims)}; set 'sheaf-latent-dims' or use 'heterogeneous'."
        )


def every_agent(run: RunConfig) -> int:
    """The agents a round trains: all of them (``strategies/peer_relay.py``)."""
    return run.num_clients


def summary(done: RunSummary) -> dict[str, object]:
    """Private accuracy (mean over agents, last rounds), communication accuracy per
    whitening, per agent and per directed edge, and bytes per round."""
    run = done.run
    test = done.final if isinstance(done.final, CommunicationTest) else CommunicationTest()
    return {
        "private_accuracy": final_mean(done.records, "evaluate.accuracy", run.final_rounds),
        "communication_accuracy": dict(test.by_whitening),
        "edge_accuracy": {
            f"{mode}.{sender}->{receiver}": value
            for mode, edges in test.edges.items()
            for (sender, receiver), value in edges.items()
        },
        "agent_private_accuracy": {str(agent): v for agent, v in test.private.items()},
        "bytes_per_round": final_mean(done.records, "server.bytes", run.num_rounds),
        "edges": [list(e) for e in run_graph(run)],
        "latent_dims": [s.latent for s in run_agent_specs(run)],
    }


# ------------------------------------------------------------------- local update
FAMILY = families.register(
    families.FamilySpec(
        name=NAME,
        summary=summary,
        groups=(SheafSettings,),
        checks=(check_agents,),
        metric_ranges=(
            (EDGE_METRIC, 0.0, 1.0),
            (PENALTY, 0.0, math.inf),
            (TEST_EXAMPLES, 0.0, math.inf),
        ),
        clients_per_round=every_agent,
        pools_splits=True,
        pilot_split=pilot_split,
        fault_targets=FaultTargets(
            relayed=(PILOTS, REPRESENTATIONS, PROTOTYPES, TRANSPORTED + ".", PROJECTION + ".")
        ),
        queries=(
            QuerySpec(
                SheafQuery.PILOTS,
                faults=Faults.RELAY,
                doc="Sheaf-FRL: refit the whitening on the pilots, send the whitened pilots",
                function="pilots_message",
            ),
            QuerySpec(
                SheafQuery.MAPS,
                faults=Faults.RELAY,
                doc="Sheaf-FRL (homogeneous): owned edges' maps, transported pilots",
                function="maps_message",
            ),
            QuerySpec(
                SheafQuery.TRANSPORT,
                faults=Faults.RELAY,
                doc="Sheaf-FRL (private): own pilots in each neighbour's frame",
                function="transport_message",
            ),
            QuerySpec(
                SheafQuery.PROJECTIONS,
                faults=Faults.RELAY,
                doc="Sheaf-FMTL: the agent's parameters through each incident restriction map",
                function="projections_message",
            ),
            QuerySpec(
                SheafQuery.REPRESENTATIONS,
                faults=Faults.RELAY,
                doc="FedMuscle: the agent's unit-norm latents of the round's pilot batch",
                function="representations_message",
            ),
            QuerySpec(
                SheafQuery.PROTOTYPES,
                faults=Faults.RELAY,
                doc="CoMFed: the agent's class prototypes through its projection",
                function="prototypes_message",
            ),
            QuerySpec(
                SheafQuery.LATENTS,
                faults=Faults.NONE,
                doc="Sheaf-FRL: whitened pilots and test latents, for communication accuracy",
                function="latents_message",
            ),
        ),
        wire=(
            WHITENING,
            COMMUNICATION,
            PENALTY,
            TEST_EXAMPLES,
            PILOTS,
            LATENTS,
            LABELS,
            TRANSPORTED,
            MAP,
            NEIGHBOURS,
            PROTOTYPES,
            PROTOTYPE_COUNTS,
            PROJECTION,
            REPRESENTATIONS,
        ),
        update="fedpers.agents_update",
    )
)
