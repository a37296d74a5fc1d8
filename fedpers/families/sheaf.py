"""The sheaf family: Sheaf-FRL, its non-cooperative baseline, FedProto, Sheaf-FMTL,
FedMuscle and CoMFed. No shared model.

Agents with different architectures and latent dimensions sit on a graph; each keeps
its whole model on the device and aligns its latent space with its neighbours' through
restriction maps learned from shared pilot samples. The server only relays pilots
between neighbours (``strategies/peer_relay.py``, ``clients/sheaf.py``; the math is
``fedpers.sheaf``). This module holds the family's settings, its checks, the agents and
the graph of a run, its wire names, the relay queries, the communication test's result
and the summary.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np
from flwr.app import ConfigRecord

from fedpers import families, protocol
from fedpers.data.client import DataConfig, PilotSplit
from fedpers.data.partition import target_classes
from fedpers.families import Arrays, Faults, Metrics, QuerySpec, RunSummary
from fedpers.faults import FaultTargets
from fedpers.protocol import FinalTestResult
from fedpers.results import final_mean
from fedpers.settings import ConfigError, at_least, int_list, positive, setting, within
from fedpers.sheaf import (
    AgentSpec,
    agent_specs,
    class_overlap_graph,
    interaction_dim,
    parameter_count,
)

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


@dataclass(frozen=True)
class SheafFMTLSettings:
    """The restriction maps of Sheaf-FMTL between parameter spaces (the row `sheaf-fmtl`)."""

    HEADING: ClassVar[str] = "sheaf-fmtl"

    sheaf_fmtl_lambda: float = setting(
        0.001,
        "Sheaf-FMTL: weight of the sheaf penalty sum ||P_ij theta_i - P_ji theta_j||^2 "
        "over an agent's edges (the authors' 0.001)",
    )
    sheaf_fmtl_gamma: float = setting(
        0.005,
        "Sheaf-FMTL: an edge's interaction space has floor(gamma x the smaller agent's "
        "parameter count) dimensions (chosen on validation; the authors' 0.01)",
    )
    sheaf_fmtl_map_lr: float = setting(
        1e-5,
        "Sheaf-FMTL: step size eta of the restriction maps (chosen on validation; the "
        "authors' 1e-4)",
    )

    def check(self) -> None:
        at_least("sheaf-fmtl-lambda", self.sheaf_fmtl_lambda, 0.0)
        within("sheaf-fmtl-gamma", self.sheaf_fmtl_gamma, "(0, 1]")
        at_least("sheaf-fmtl-map-lr", self.sheaf_fmtl_map_lr, 0.0)


@dataclass(frozen=True)
class FedMuscleSettings:
    """The Muscle loss of FedMuscle (the row `fedmuscle`)."""

    HEADING: ClassVar[str] = "fedmuscle"

    fedmuscle_tau: float = setting(
        0.2,
        "FedMuscle: temperature of the anchor's similarities to the other agents' "
        "representations (the paper's tau^(N), 0.2)",
    )
    fedmuscle_tau_others: float = setting(
        0.15,
        "FedMuscle: temperature tau^(N-1) among the other agents' representations, which "
        "weighs each negative tuple (the paper's 0.15; unused with two agents)",
    )
    fedmuscle_others: int = setting(
        3, "FedMuscle: other agents M whose representations an agent is sent each round"
    )

    def check(self) -> None:
        positive("fedmuscle-tau", self.fedmuscle_tau)
        positive("fedmuscle-tau-others", self.fedmuscle_tau_others)
        at_least("fedmuscle-others", self.fedmuscle_others, 1)
        if not self.fedmuscle_tau_others < self.fedmuscle_tau:
            raise ConfigError(
                f"run-config key 'fedmuscle-tau-others' = {self.fedmuscle_tau_others} must be "
                f"below 'fedmuscle-tau' = {self.fedmuscle_tau}: the Muscle loss weighs each "
                "negative tuple by exp(-gamma ...), gamma = 1/tau-others - 1/tau, which must "
                "be positive; lower 'fedmuscle-tau-others'."
            )


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
    """CoMFed's shared dimension: as set, or the smallest latent dimension."""
    return run.group(ComFedSettings).comfed_dim or min(s.latent for s in run_agent_specs(run))


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


def interaction_dims(run: RunConfig) -> dict[tuple[int, int], int]:
    """Sheaf-FMTL: the interaction-space dimension of each edge, both orientations."""
    counts = parameter_counts(run)
    gamma = run.group(SheafFMTLSettings).sheaf_fmtl_gamma
    dims = {}
    for a, b in run_graph(run):
        dims[a, b] = dims[b, a] = interaction_dim(counts[a], counts[b], gamma)
    return dims


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
PROTOTYPES = "prototypes"  # FedProto: class prototypes (classes x d), both ways
PROTOTYPE_COUNTS = "prototype-counts"  # FedProto: the samples behind each prototype
# FedProto, in rounds.jsonl under the trimmed mean: classes too few replies held, which
# kept their last prototype
CLASSES_UNCHANGED = "classes-unchanged"
PROJECTION = "projection"  # Sheaf-FMTL: P_ij theta_i, an agent's parameters on an edge
REPRESENTATIONS = "representations"  # FedMuscle: unit-norm latents of the round's pilots


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


@dataclass(frozen=True)
class CommunicationTest(FinalTestResult):
    """Sheaf-FRL's communication accuracy: per whitening, the mean over receivers, and
    per directed edge ``(sender, receiver)``; and every agent's last private accuracy."""

    by_whitening: dict[str, float] = field(default_factory=dict)
    edges: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    private: dict[int, float] = field(default_factory=dict)


@runtime_checkable
class PilotAgent(Protocol):
    """A Sheaf-FRL agent's relay queries."""

    def pilots_message(self, config: ConfigRecord) -> Arrays:
        """Its whitened pilot latents."""
        ...

    def maps_message(self, arrays: Arrays) -> Arrays:
        """Owned edges' maps and transported pilots (homogeneous variant)."""
        ...

    def transport_message(self, neighbours: list[int]) -> Arrays:
        """Own pilots in each neighbour's coordinates (private variant)."""
        ...

    def latents_message(self, config: ConfigRecord) -> Arrays:
        """Whitened pilots and test latents, for communication accuracy."""
        ...


@runtime_checkable
class ProjectionAgent(Protocol):
    """A Sheaf-FMTL agent's relay query."""

    def projections_message(self, config: ConfigRecord) -> Arrays:
        """Its parameters through each incident restriction map, ``P_ij theta_i``."""
        ...


@runtime_checkable
class RepresentationAgent(Protocol):
    """A FedMuscle agent's relay query."""

    def representations_message(self, config: ConfigRecord) -> Arrays:
        """Its unit-norm latents of the round's pilot batch."""
        ...


def _representations(
    client: Any, run: RunConfig, arrays: Arrays, config: ConfigRecord
) -> tuple[Arrays, Metrics]:
    return client.representations_message(config), {}


@runtime_checkable
class PrototypeAgent(Protocol):
    """A CoMFed agent's relay query."""

    def prototypes_message(self, config: ConfigRecord) -> Arrays:
        """Its projected class prototypes ``P_i v_bar_m`` and the samples behind each."""
        ...


def _prototypes(
    client: Any, run: RunConfig, arrays: Arrays, config: ConfigRecord
) -> tuple[Arrays, Metrics]:
    return client.prototypes_message(config), {}


def _projections(
    client: Any, run: RunConfig, arrays: Arrays, config: ConfigRecord
) -> tuple[Arrays, Metrics]:
    return client.projections_message(config), {}


def _pilots(
    client: Any, run: RunConfig, arrays: Arrays, config: ConfigRecord
) -> tuple[Arrays, Metrics]:
    return client.pilots_message(config), {}


def _maps(
    client: Any, run: RunConfig, arrays: Arrays, config: ConfigRecord
) -> tuple[Arrays, Metrics]:
    return client.maps_message(arrays), {}


def _transport(
    client: Any, run: RunConfig, arrays: Arrays, config: ConfigRecord
) -> tuple[Arrays, Metrics]:
    neighbours = [int(n) for n in arrays.get(NEIGHBOURS, np.zeros(0))]
    return client.transport_message(neighbours), {}


def _latents(
    client: Any, run: RunConfig, arrays: Arrays, config: ConfigRecord
) -> tuple[Arrays, Metrics]:
    return client.latents_message(config), {}


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
    if FedProtoSettings in run.spec.settings and len(dims) > 1:
        raise ConfigError(
            f"algorithm '{run.algorithm}' averages class prototypes of the agents' latents, "
            f"which needs equal latent dimensions, found {sorted(dims)}: set "
            "'sheaf-latent-dims' to one value per agent, all equal."
        )
    if FedMuscleSettings in run.spec.settings:
        check_muscle(run, dims)
    if SheafFMTLSettings in run.spec.settings:
        check_map_memory(run)
    if values.sheaf_variant != SheafVariant.HETEROGENEOUS and len(dims) > 1:
        raise ConfigError(
            f"run-config key 'sheaf-variant' = '{values.sheaf_variant}' needs equal latent "
            f"dimensions, found {sorted(dims)}; set 'sheaf-latent-dims' or use 'heterogeneous'."
        )


MUSCLE_TUPLES_LIMIT = 2**26  # logits of one FedMuscle step: batch^(others + 1)


def check_muscle(run: RunConfig, dims: set[int]) -> None:
    """FedMuscle compares latents across agents (one dimension), and its loss sums over
    every tuple of the other agents' pilots: at most ``MUSCLE_TUPLES_LIMIT`` of them."""
    if len(dims) > 1:
        raise ConfigError(
            f"algorithm '{run.algorithm}' compares the agents' latents directly, which needs "
            f"equal latent dimensions, found {sorted(dims)}: set 'sheaf-latent-dims' to one "
            "value per agent, all equal."
        )
    others = min(run.group(FedMuscleSettings).fedmuscle_others, run.num_clients - 1)
    batch = settings(run).sheaf_pilot_batch
    if batch ** (others + 1) > MUSCLE_TUPLES_LIMIT:
        raise ConfigError(
            f"FedMuscle's loss with 'sheaf-pilot-batch' = {batch} and {others} other agents "
            f"sums {batch}^{others + 1} terms per step, more than {MUSCLE_TUPLES_LIMIT}: "
            "lower 'fedmuscle-others' or 'sheaf-pilot-batch'."
        )


MAP_BYTES_LIMIT = 2**30  # the restriction maps one Sheaf-FMTL agent may hold (float32)


def check_map_memory(run: RunConfig) -> None:
    """Sheaf-FMTL's maps ``P_ij`` are ``d_ij x n_i`` floats per edge: refuse a run whose
    largest agent would hold more than ``MAP_BYTES_LIMIT`` of them, before anything
    starts (the parameter spaces' size is the method's known cost)."""
    counts = parameter_counts(run)
    held = [0] * run.num_clients
    for (i, _), d in interaction_dims(run).items():
        held[i] += 4 * d * counts[i]
    largest = max(range(run.num_clients), key=lambda agent: held[agent])
    if held[largest] > MAP_BYTES_LIMIT:
        raise ConfigError(
            f"Sheaf-FMTL's restriction maps of agent {largest} ({counts[largest]} "
            f"parameters) would take {held[largest] / 2**30:.1f} GiB, more than "
            f"{MAP_BYTES_LIMIT / 2**30:.0f} GiB: lower 'sheaf-fmtl-gamma' (now "
            f"{run.group(SheafFMTLSettings).sheaf_fmtl_gamma}) or the agents' widths."
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
                PilotAgent,
                _pilots,
                Faults.RELAY,
                "Sheaf-FRL: refit the whitening on the pilots, send the whitened pilots",
            ),
            QuerySpec(
                SheafQuery.MAPS,
                PilotAgent,
                _maps,
                Faults.RELAY,
                "Sheaf-FRL (homogeneous): owned edges' maps, transported pilots",
            ),
            QuerySpec(
                SheafQuery.TRANSPORT,
                PilotAgent,
                _transport,
                Faults.RELAY,
                "Sheaf-FRL (private): own pilots in each neighbour's frame",
            ),
            QuerySpec(
                SheafQuery.PROJECTIONS,
                ProjectionAgent,
                _projections,
                Faults.RELAY,
                "Sheaf-FMTL: the agent's parameters through each incident restriction map",
            ),
            QuerySpec(
                SheafQuery.REPRESENTATIONS,
                RepresentationAgent,
                _representations,
                Faults.RELAY,
                "FedMuscle: the agent's unit-norm latents of the round's pilot batch",
            ),
            QuerySpec(
                SheafQuery.PROTOTYPES,
                PrototypeAgent,
                _prototypes,
                Faults.RELAY,
                "CoMFed: the agent's class prototypes through its projection",
            ),
            QuerySpec(
                SheafQuery.LATENTS,
                PilotAgent,
                _latents,
                Faults.NONE,
                "Sheaf-FRL: whitened pilots and test latents, for communication accuracy",
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
    )
)
