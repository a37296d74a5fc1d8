"""What crosses the wire between a ServerApp and a ClientApp, defined once.

`strategies` and `clients` never import each other; both import these names. An
algorithm is declared here by its name and by which parts of the model it shares
with the server: everything else stays on the device in ``context.state``.
"""

from __future__ import annotations

from enum import StrEnum


class Algorithm(StrEnum):
    """Every algorithm a run can name in its ``algorithm`` key."""

    FEDREP = "fedrep"
    FEDPER = "fedper"
    FEDAVG = "fedavg"
    FEDAVG_FT = "fedavg-ft"
    LG_FEDAVG = "lg-fedavg"
    LOCAL = "local"
    FEDSGD = "fedsgd"
    FEDGMM = "fedgmm"
    FEDEM = "fedem"
    SHEAF_FRL = "sheaf-frl"
    NON_COOPERATIVE = "non-cooperative"


# The model is split into a `body` (representation) and a `head`; an algorithm shares
# a subset of these parts with the server and keeps the rest personal.
BODY = "body"
HEAD = "head"
MODEL_PARTS: tuple[str, ...] = (BODY, HEAD)

SHARED_PARTS: dict[Algorithm, tuple[str, ...]] = {
    Algorithm.FEDREP: (BODY,),
    Algorithm.FEDPER: (BODY,),
    Algorithm.FEDAVG: (BODY, HEAD),
    Algorithm.FEDAVG_FT: (BODY, HEAD),
    Algorithm.LG_FEDAVG: (HEAD,),
    Algorithm.LOCAL: (),
    Algorithm.FEDSGD: (BODY, HEAD),
    # Mixtures share every learner whole; the personal part is the mixture weights.
    Algorithm.FEDGMM: (BODY, HEAD),
    Algorithm.FEDEM: (BODY, HEAD),
    # Sheaf-FRL shares no model part: only pilot latents, relayed between neighbours.
    Algorithm.SHEAF_FRL: (),
    Algorithm.NON_COOPERATIVE: (),
}

# Algorithms that exist only for the linear representation model (Section 4 of FedRep).
LINEAR_ONLY: frozenset[Algorithm] = frozenset({Algorithm.FEDSGD})
# Mixtures of learners (and, for FedGMM, of Gaussian components).
MIXTURE_ALGORITHMS: frozenset[Algorithm] = frozenset({Algorithm.FEDGMM, Algorithm.FEDEM})
# Decentralized agents aligned on a graph (Sheaf-FRL and its lambda = 0 baseline).
SHEAF_ALGORITHMS: frozenset[Algorithm] = frozenset({Algorithm.SHEAF_FRL, Algorithm.NON_COOPERATIVE})
# Algorithms that have a linear variant; the others need a deep model.
LINEAR_ALGORITHMS: frozenset[Algorithm] = frozenset({Algorithm.FEDREP, Algorithm.FEDSGD})


def shared_parts(algorithm: str) -> tuple[str, ...]:
    """Model parts (``body``/``head``) that ``algorithm`` sends to the server."""
    return SHARED_PARTS[Algorithm(algorithm)]


def personal_parts(algorithm: str) -> tuple[str, ...]:
    """Model parts that ``algorithm`` keeps on the device."""
    shared = shared_parts(algorithm)
    return tuple(part for part in MODEL_PARTS if part not in shared)


def part_of(array_name: str) -> str:
    """The model part of a parameter name such as ``body.0.weight``."""
    return array_name.split(".", 1)[0]


# ---- Message types beyond Flower's plain TRAIN / EVALUATE -------------------------
QUERY_INFO = "query.info"  # partition id and sizes of a node
QUERY_INITIAL = "query.initial"  # the seeded initial shared arrays
QUERY_MOMENTS = "query.moments"  # Method-of-Moments statistics (linear FedRep)
QUERY_PCA = "query.pca"  # moment statistics of the GMM's embedding inputs (FedGMM)
QUERY_SUMMARY = "query.summary"  # local k-means centroids for k-means++ (FedGMM)
QUERY_ASSIGN = "query.assign"  # statistics of hard assignments to initial means (FedGMM)
QUERY_PILOTS = "query.pilots"  # an agent's whitened pilot latents (Sheaf-FRL)
QUERY_MAPS = "query.maps"  # edge owners' maps -> transported pilots (homogeneous Sheaf-FRL)
QUERY_TRANSPORT = "query.transport"  # pilots transported to each neighbour (private)
QUERY_LATENTS = "query.latents"  # whitened test latents, for communication accuracy

# ---- Record names inside a message's RecordDict ----------------------------------
ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"

# ---- Keys of the ConfigRecord the server sends ------------------------------------
ROUND = "server-round"
EPOCHS = "epochs"
HEAD_EPOCHS = "head-epochs"
FINETUNE_EPOCHS = "finetune-epochs"
LR = "lr"
MOMENTUM = "momentum"
WEIGHT_DECAY = "weight-decay"
BATCH_SIZE = "batch-size"
LINEAR_HEAD_STEPS = "linear-head-steps"
LINEAR_HEAD_LR = "linear-head-lr"
UNSEEN = "unseen"  # 1: the node is an unseen client: adapt, then test
ADAPT_FRACTION = "adapt-fraction"
WHITENING = "whitening"  # Sheaf-FRL: whiten with statistics of "pilots" or "train" latents
COMMUNICATION = "communication"  # 1: evaluate decoding the neighbours' transported latents

# ---- Keys of the MetricRecord a client replies with -------------------------------
NUM_EXAMPLES = "num-examples"
NUM_TRAIN = "num-train-examples"
NUM_TEST = "num-test-examples"
PARTITION_ID = "partition-id"
LOSS = "loss"
ACCURACY = "accuracy"
LOG_LIKELIHOOD = "log-likelihood"


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

# ---- Array names of Sheaf-FRL -----------------------------------------------------
PILOTS = "pilots"  # an agent's own whitened pilot latents (P x d)
LATENTS = "latents"  # an agent's whitened test latents
LABELS = "labels"  # the labels of those test samples


def from_agent(name: str, agent: int) -> str:
    """``pilots`` of agent 3 as relayed to a neighbour: ``pilots.3``."""
    return f"{name}.{agent}"


TRANSPORTED = "transported"  # pilots transported into a neighbour's coordinates
MAP = "map"  # an edge's restriction map, relayed from the endpoint that computed it

# ---- context.state keys on the device ---------------------------------------------
STATE_PERSONAL = "fedpers.personal"
