"""What crosses the wire between a ServerApp and a ClientApp, declared once.

`strategies` and `clients` never import each other; both import these names: message
types, record names, the keys of the configs and metrics that travel, the names of the
arrays, and the results of the final tests. A test (tests/test_wire_contract.py) fails on
any record key written as a quoted literal under ``strategies/`` or ``clients/``.
Which algorithm shares which model parts is the algorithm table's
(``fedpers.algorithms``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

# The model is split into a `body` (representation) and a `head`; an algorithm shares
# a subset of these parts with the server and keeps the rest personal.
BODY = "body"
HEAD = "head"
MODEL_PARTS: tuple[str, ...] = (BODY, HEAD)


class Query(StrEnum):
    """Queries beyond Flower's TRAIN / EVALUATE: the handler is ``@app.query(Query.X)``,
    the message type ``query_type(Query.X)`` (``"query.<name>"``)."""

    INFO = "info"  # partition id and sizes of a node
    INITIAL = "initial"  # the seeded initial shared arrays
    MOMENTS = "moments"  # Method-of-Moments statistics (linear FedRep)
    PCA = "pca"  # moment statistics of the GMM's embedding inputs (FedGMM)
    SUMMARY = "summary"  # local k-means centroids for k-means++ (FedGMM)
    ASSIGN = "assign"  # statistics of hard assignments to initial means (FedGMM)
    PILOTS = "pilots"  # an agent's whitened pilot latents (Sheaf-FRL)
    MAPS = "maps"  # edge owners' maps -> transported pilots (homogeneous Sheaf-FRL)
    TRANSPORT = "transport"  # pilots transported to each neighbour (private Sheaf-FRL)
    LATENTS = "latents"  # whitened test latents, for communication accuracy


def query_type(query: Query) -> str:
    """The message type of ``query``: Flower routes ``query.<name>`` to its handler."""
    return f"query.{query.value}"


# ---- Message types beyond Flower's plain TRAIN / EVALUATE -------------------------
QUERY_INFO = query_type(Query.INFO)
QUERY_INITIAL = query_type(Query.INITIAL)
QUERY_MOMENTS = query_type(Query.MOMENTS)
QUERY_PCA = query_type(Query.PCA)
QUERY_SUMMARY = query_type(Query.SUMMARY)
QUERY_ASSIGN = query_type(Query.ASSIGN)
QUERY_PILOTS = query_type(Query.PILOTS)
QUERY_MAPS = query_type(Query.MAPS)
QUERY_TRANSPORT = query_type(Query.TRANSPORT)
QUERY_LATENTS = query_type(Query.LATENTS)

# ---- Record names inside a message's RecordDict ----------------------------------
ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"

# ---- Keys of the ConfigRecord the server sends ------------------------------------
# Only what the server may change per round travels here; every other setting a client
# reads once from its own typed run configuration (``fedpers.config.RunConfig``).
ROUND = "server-round"
EPOCHS = "epochs"
HEAD_EPOCHS = "head-epochs"
FINETUNE_EPOCHS = "finetune-epochs"
LR = "lr"
UNSEEN = "unseen"  # 1: the node is an unseen client: adapt, then test
ADAPT_FRACTION = "adapt-fraction"
WHITENING = "whitening"  # Sheaf-FRL: whiten with statistics of "pilots" or "train" latents
COMMUNICATION = "communication"  # 1: evaluate decoding the neighbours' transported latents
RUN_TOKEN = "run-token"  # a fresh run's identity, kept by its resumption (snapshot names)

# ---- Keys of the MetricRecord a client replies with -------------------------------
NUM_EXAMPLES = "num-examples"
NUM_TRAIN = "num-train-examples"
NUM_TEST = "num-test-examples"
PARTITION_ID = "partition-id"
LOSS = "loss"
ACCURACY = "accuracy"
LOG_LIKELIHOOD = "log-likelihood"
PENALTY = "penalty"  # Sheaf-FRL: mean gluing penalty of a round's steps
TEST_EXAMPLES = "test-examples"  # Sheaf-FRL: test samples behind an agent's accuracy


def edge_metric(sender: int) -> str:
    """Metric of the accuracy of decoding ``sender``'s transported latents: ``edge.3``."""
    return f"edge.{sender}"


def edge_sender(key: str) -> int | None:
    """The sender of an ``edge_metric`` key, or None for any other metric."""
    prefix, _, sender = key.partition(".")
    return int(sender) if prefix == "edge" and sender.isdigit() else None


# ---- Array names of the personalized linear model (FedRep, Section 4) ------------
LINEAR_BODY = "body.weight"  # the representation, stored as B^T (k x d)
LINEAR_HEAD = "head.weight"  # the head, stored as w^T (1 x k)
MOMENTS = "moments"  # a client's Method-of-Moments statistic (d x d)


# ---- Array names of the mixture algorithms ----------------------------------------
def learner_prefix(index: int) -> str:
    """Prefix of learner ``index``'s parameters: ``learner0.body.0.weight``."""
    return f"learner{index}."


MIXTURE_WEIGHTS = "mixture.weights"  # pi (M1, M2): personal on a device, global on the server
GAMMA = "gamma"  # a client's summed responsibilities (M1, M2)
GMM_MEANS = "gmm.means"
GMM_COVARIANCES = "gmm.covariances"
PCA_MEAN = "pca.mean"
PCA_DIRECTIONS = "pca.directions"
STATS_COUNT = "stats.count"
STATS_FIRST = "stats.first"
STATS_SECOND = "stats.second"
PCA_COUNT = "pca.count"  # query.pca: samples behind the moments
PCA_SUM = "pca.sum"
PCA_OUTER = "pca.outer"
SUMMARY_CENTROIDS = "summary.centroids"  # query.summary: local k-means centroids
SUMMARY_COUNTS = "summary.counts"

# ---- Array names of Sheaf-FRL -----------------------------------------------------
PILOTS = "pilots"  # an agent's own whitened pilot latents (P x d)
LATENTS = "latents"  # an agent's whitened test latents
LABELS = "labels"  # the labels of those test samples


def from_agent(name: str, agent: int) -> str:
    """``pilots`` of agent 3 as relayed to a neighbour: ``pilots.3``."""
    return f"{name}.{agent}"


TRANSPORTED = "transported"  # pilots transported into a neighbour's coordinates
MAP = "map"  # an edge's restriction map, relayed from the endpoint that computed it
NEIGHBOURS = "neighbours"  # query.transport: the agent's neighbours (int64 array)


def agent_of(name: str) -> tuple[str, int]:
    """``pilots.3`` -> ``("pilots", 3)``: the inverse of ``from_agent``."""
    kind, _, agent = name.rpartition(".")
    return kind, int(agent)


# ---- Node config keys of a SuperNode (``--node-config``) ----------------------------
NODE_PARTITION_ID = "partition-id"
NODE_NUM_PARTITIONS = "num-partitions"
NODE_STATE_DIR = "state-dir"  # where the node snapshots its context.state

# ---- context.state keys on the device ---------------------------------------------
STATE_PERSONAL = "fedpers.personal"
STATE_META = "fedpers.meta"  # ConfigRecord of bookkeeping (rounds trained)
STATE_ROUNDS_TRAINED = "rounds-trained"


# ---- Results of the final tests (server side, after the last round) ---------------
class Whitening(StrEnum):
    """Statistics that whiten latents before they are compared across agents."""

    PILOTS = "pilots"  # Sheaf-FRL's: the pilots' own statistics
    TRAIN = "train"  # the paper's baseline: statistics of the training latents


@dataclass(frozen=True)
class FinetunedTest:
    """Test accuracy after every client fine-tuned its head (FedAvg+FT, FedBABU)."""

    accuracy: float
    clients: dict[str, float] = field(default_factory=dict)  # accuracy per partition


@dataclass(frozen=True)
class UnseenTest:
    """Test accuracy of the unseen clients after they adapted (FedGMM's Table 4)."""

    accuracy: float
    clients: dict[str, float] = field(default_factory=dict)  # accuracy per partition


@dataclass(frozen=True)
class CommunicationTest:
    """Sheaf-FRL's communication accuracy: per whitening, the mean over receivers, and
    per directed edge ``(sender, receiver)``; and every agent's last private accuracy."""

    by_whitening: dict[str, float] = field(default_factory=dict)
    edges: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    private: dict[int, float] = field(default_factory=dict)


FinalTestResult = FinetunedTest | UnseenTest | CommunicationTest
