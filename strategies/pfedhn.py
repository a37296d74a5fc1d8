"""pFedHN's server (Shamsian et al., ICML 2021; the hypernetwork's forward pass and
vector-Jacobian product are ``fedpers/algorithms/pfedhn.py``, numpy). The global state
is the hypernetwork, the clients' embeddings and the target model's shapes; each
sampled client is sent the model generated from its embedding and screened against it,
and the replies' products with ``theta_i - theta~_i`` step the hypernetwork (combined
by the run's ``aggregation``) and each replying client's embedding (its own). Every
client is evaluated with its generated model."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedpers import protocol, records
from fedpers.algorithms import pfedhn
from fedpers.seeding import rng
from fedpers.strategies import screening
from fedpers.strategies.base import FedpersStrategy, mean_metrics

Model = dict[str, np.ndarray]


class PFedHN(FedpersStrategy):
    """A hypernetwork generates every client's model."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = self.run.group(pfedhn.PFedHNSettings)
        self.state: Model = {}  # the hypernetwork this round started from
        self.sent: dict[int, Model] = {}  # the model each sampled client was sent

    def initial_arrays(self, grid: Grid, *, timeout: float) -> ArrayRecord:
        """The seeded hypernetwork for the initial model's arrays (as a majority of the
        nodes build it: only their names, shapes and dtypes are used)."""
        model = {
            k: records.values(v) for k, v in super().initial_arrays(grid, timeout=timeout).items()
        }
        generator = rng(self.run.seed, "pfedhn")
        return _record(pfedhn.initial(model, self.run.num_clients, self.settings, generator))

    def train_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> dict[int, RecordDict]:
        """To each sampled client the model generated from its embedding."""
        self.state = {k: records.values(v) for k, v in arrays.items()}
        self.round_config(server_round, config)
        self.sent = {p: pfedhn.model_of(self.state, p) for p in self.sample(server_round)}
        contents = {
            p: RecordDict({protocol.ARRAYS: _record(model), protocol.CONFIG: config})
            for p, model in self.sent.items()
        }
        if self.sent:  # replies are screened against their own client's model (sent_to)
            first = next(iter(self.sent.values()))
            self.sent_arrays = screening.array_specs(_record(first))
            self.current_shared = first
        return contents

    def sent_to(self, reply: Message) -> dict[str, np.ndarray]:
        """A reply's update is measured from the model its client was sent."""
        return self.sent.get(self.federation.partition(reply), self.current_shared)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """One SGD step (with weight decay) of the hypernetwork along the combined
        products, each clipped to ``pfedhn-clip``, and of each replying client's
        embedding along its own; None without a reply."""
        valid = [r for r in replies if screening.num_examples(r) > 0]
        if not valid:
            return None, None
        layers = [k for k in pfedhn.hypernetwork(self.state) if k != pfedhn.EMBEDDINGS]
        products, embeddings = [], np.zeros_like(self.state[pfedhn.EMBEDDINGS])
        for reply in valid:
            partition = self.federation.partition(reply)
            sent = self.sent[partition]
            returned = screening.arrays_of(reply)
            delta = pfedhn.flatten(sent) - pfedhn.flatten({k: returned[k] for k in sent})
            grads = pfedhn.vjp(self.state, partition, delta)
            own = grads[pfedhn.EMBEDDINGS][partition]
            norm = np.sqrt(sum(float(np.sum(grads[k] ** 2)) for k in layers) + own @ own)
            factor = min(1.0, self.settings.pfedhn_clip / (norm + 1e-6))
            products.append({k: factor * grads[k] for k in layers})
            embeddings[partition] = factor * own
        zeros = {k: np.zeros_like(self.state[k]) for k in layers}
        step = self.combine(products, [1.0] * len(products), zeros)
        step[pfedhn.EMBEDDINGS] = embeddings
        lr, decay = self.settings.pfedhn_lr, self.settings.pfedhn_weight_decay
        new = dict(self.state)
        for k in [*layers, pfedhn.EMBEDDINGS]:
            new[k] = self.state[k] - lr * (step[k] + decay * self.state[k])
        return _record(new), mean_metrics([r.content for r in valid])

    def evaluate_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> dict[int, RecordDict]:
        """To every seen client the model generated from its embedding."""
        if not self.evaluate_nodes:
            return {}
        config[protocol.ROUND] = server_round
        state = {k: records.values(v) for k, v in arrays.items()}
        return {
            p: RecordDict(
                {protocol.ARRAYS: _record(pfedhn.model_of(state, p)), protocol.CONFIG: config}
            )
            for p in self.seen
        }


def _record(arrays: Model) -> ArrayRecord:
    return ArrayRecord({k: Array(records.contiguous(v)) for k, v in arrays.items()})
