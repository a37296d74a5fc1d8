"""What crosses the wire between a ServerApp and a ClientApp for every family, declared once.

`strategies` and `clients` never import each other; both import these names: message
types, record names, the keys of the configs and metrics that travel, and the names of
the model parts. What only one family sends is declared by that family's module
(``fedpers.families``, each ``FamilySpec.wire``). A test
(tests/test_wire_contract.py) fails on any record key written as a quoted literal under
``strategies/`` or ``clients/``. Which algorithm shares which model parts is the
algorithm table's (``fedpers.algorithms``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

# The model is split into a `body` (representation) and a `head`; an algorithm shares
# a subset of these parts with the server and keeps the rest personal.
BODY = "body"
HEAD = "head"
MODEL_PARTS: tuple[str, ...] = (BODY, HEAD)


class Query(StrEnum):
    """The queries every family's clients answer, beyond Flower's TRAIN / EVALUATE: the
    handler is ``@app.query(Query.X)``, the message type ``query_type(Query.X)``
    (``"query.<name>"``). A family's own queries are its ``FamilySpec.queries``."""

    INFO = "info"  # partition id and sizes of a node
    INITIAL = "initial"  # the seeded initial shared arrays
    SNAPSHOT = "snapshot"  # a resumed run's node restores its state: from which round


def query_type(query: str) -> str:
    """The message type of the query action ``query``: Flower routes ``query.<name>``
    to its handler."""
    return f"query.{query}"


# ---- Message types beyond Flower's plain TRAIN / EVALUATE -------------------------
QUERY_INFO = query_type(Query.INFO)
QUERY_INITIAL = query_type(Query.INITIAL)
QUERY_SNAPSHOT = query_type(Query.SNAPSHOT)

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
RUN_TOKEN = "run-token"  # a fresh run's identity, kept by its resumption (snapshot names)
DIGEST = "digest"  # query.initial: 1 asks for the SHA-256 of the arrays (``arrays_digest``)

# ---- Keys of the MetricRecord a client replies with -------------------------------
NUM_EXAMPLES = "num-examples"
NUM_TRAIN = "num-train-examples"
NUM_TEST = "num-test-examples"
PARTITION_ID = "partition-id"
LOSS = "loss"
ACCURACY = "accuracy"
SNAPSHOT_ROUND = "snapshot-round"  # the round of the snapshot restored (0: none)

# The closed range of every metric above; a family declares its own metrics' ranges
# (``FamilySpec.metric_ranges``). A reply with a value outside its range is rejected.
METRIC_RANGES: dict[str, tuple[float, float]] = {
    NUM_EXAMPLES: (0.0, math.inf),
    NUM_TRAIN: (0.0, math.inf),
    NUM_TEST: (0.0, math.inf),
    PARTITION_ID: (0.0, math.inf),
    LOSS: (0.0, math.inf),
    ACCURACY: (0.0, 1.0),
}


def arrays_digest(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """SHA-256 (32 uint8) of named arrays: names, shapes, dtypes and bytes, by name. The
    server's vote on the initial model counts these (``query.initial`` with ``DIGEST``)."""
    digest = hashlib.sha256()
    for name, values in sorted(arrays.items()):
        digest.update(repr((name, tuple(values.shape), str(values.dtype))).encode())
        digest.update(np.ascontiguousarray(values).tobytes())
    return np.frombuffer(digest.digest(), dtype=np.uint8).copy()


# ---- Node config keys of a SuperNode (``--node-config``) ----------------------------
NODE_PARTITION_ID = "partition-id"
NODE_NUM_PARTITIONS = "num-partitions"
NODE_STATE_DIR = "state-dir"  # where the node snapshots its context.state
# the least noise multiplier of the update this node sends (fedpers.privacy.device_floor)
NODE_DP_MIN_NOISE = "dp-min-noise"

# ---- context.state keys on the device ---------------------------------------------
STATE_PERSONAL = "fedpers.personal"
STATE_META = "fedpers.meta"  # ConfigRecord of bookkeeping (rounds trained)
STATE_ROUNDS_TRAINED = "rounds-trained"


# ---- Results of the final tests (server side, after the last round) ---------------
class FinalTestResult:
    """What a test after the last round found (a family declares its own kinds)."""


@dataclass(frozen=True)
class UnseenTest(FinalTestResult):
    """Test accuracy of the unseen clients after they adapted (``unseen-fraction``)."""

    accuracy: float
    clients: dict[str, float] = field(default_factory=dict)  # accuracy per partition
