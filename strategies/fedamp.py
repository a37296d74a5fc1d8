"""FedAMP's server (Huang et al., AAAI 2021, Algorithm 1; the clients' update and the
attention weights are ``fedpers/algorithms/fedamp.py``). As Fed-MTL's, it keeps every
client's last model as the global state (``task.<partition>.<parameter>``, the seeded
initial model at first, checkpointed) and each round the replies kept replace their
clients' models; a sampled client is sent its cloud model ``u_i``, the attentive
combination of every model held, and screened against its own model."""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.serverapp import Grid

from fedpers import protocol, records
from fedpers.aggregation import Aggregation
from fedpers.algorithms.fedamp import FedAmpSettings, attention
from fedpers.strategies import screening
from fedpers.strategies.fedmtl import FedMTL, Model, _mean, _tasks


class FedAMP(FedMTL):
    """Every client's model kept; each sampled client sent its ``u_i``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = self.run.group(FedAmpSettings)

    def train_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> dict[int, RecordDict]:
        """To each sampled client its cloud model ``u_i``."""
        self.tasks = _tasks(arrays)
        sampled = self.sample(server_round)
        self.round_config(server_round, config)
        everyone = sorted(self.tasks)
        names = sorted(self.tasks[everyone[0]]) if everyone else []
        # Every model held, flattened once a round (n x d, float64): each sampled client's
        # attention weights are its distances to all of them.
        flat = np.stack(
            [np.concatenate([self.tasks[p][n].ravel() for n in names]) for p in everyone]
        ).astype(np.float64)
        contents = {}
        clouds = self.cloud_models([everyone.index(p) for p in sampled], everyone, flat)
        for partition, cloud in zip(sampled, clouds, strict=True):
            sent = ArrayRecord({k: Array(records.contiguous(v)) for k, v in cloud.items()})
            contents[partition] = RecordDict({protocol.ARRAYS: sent, protocol.CONFIG: config})
        # Replies are screened against their client's own model (``sent_to``); the mean
        # of the sampled models stands for them elsewhere.
        self.current_shared = _mean([self.tasks[p] for p in sampled])
        self.sent_arrays = screening.array_specs(
            ArrayRecord({k: Array(records.contiguous(v)) for k, v in self.current_shared.items()})
        )
        return contents

    def cloud_models(self, rows: list[int], everyone: list[int], flat: np.ndarray) -> list[Model]:
        """``cloud_model`` of each of ``rows``; under the weighted mean (the default
        ``aggregation``), the others' means of every row at once (``weighted_rows``), to
        the bit what ``cloud_model`` computes one row at a time."""
        if self.run.aggregation != Aggregation.MEAN:
            return [self.cloud_model(i, everyone, flat) for i in rows]
        xis = [
            attention(flat, i, self.settings.fedamp_alpha, self.settings.fedamp_sigma) for i in rows
        ]
        # weighted_mean's share of each of the others: its weight over their sum.
        others = [
            [j for j in range(len(everyone)) if j != i and xi[j] > 0]
            for i, xi in zip(rows, xis, strict=True)
        ]
        shares = np.zeros((len(rows), len(everyone)))
        for row, (xi, kept) in enumerate(zip(xis, others, strict=True)):
            if kept:
                shares[row, kept] = xi[kept] / float(xi[kept].sum())
        means = weighted_rows(shares, flat)
        clouds = []
        for row, (i, xi, kept) in enumerate(zip(rows, xis, others, strict=True)):
            own = self.tasks[everyone[i]]
            if not kept:
                clouds.append(own)
                continue
            share = float(xi[kept].sum())
            ordered = {n: own[n] for n in sorted(own)}  # the order of ``flat``'s columns
            mix = {
                n: v.astype(own[n].dtype) for n, v in records.unflatten(means[row], ordered).items()
            }
            clouds.append(_blend(own, share, mix))
        return clouds

    def cloud_model(self, i: int, everyone: list[int], flat: np.ndarray) -> Model:
        """``u_i = xi_ii w_i + sum_{j != i} xi_ij w_j`` over every model held. The others'
        part is their ``xi``-weighted mean; under a robust ``aggregation`` it is that
        aggregation of them (the median and the trimmed mean ignore the weights: only
        the others' share, ``sum xi_ij``, is the attention's), and the weighted mean where
        the trimmed mean would cut every one of them. ``i`` is the client's row of
        ``everyone`` (the partitions held, in order) and of ``flat`` (their models)."""
        own = self.tasks[everyone[i]]
        xi = attention(flat, i, self.settings.fedamp_alpha, self.settings.fedamp_sigma)
        others = [j for j in range(len(everyone)) if j != i and xi[j] > 0]
        if not others:
            return own
        share = float(xi[others].sum())
        models = [self.tasks[everyone[j]] for j in others]
        weights = [float(xi[j]) for j in others]
        mix: Model = (
            {n: np.tensordot(weights, [m[n] for m in models], axes=1) / share for n in own}
            if self.trims_every_reply(len(others))
            else self.combine(models, weights, own)
        )
        return _blend(own, share, mix)


def _blend(own: Model, share: float, mix: Model) -> Model:
    """``(1 - share) w_i + share mix``, in ``w_i``'s dtypes."""
    return {
        n: ((1.0 - share) * own[n].astype(np.float64) + share * mix[n]).astype(own[n].dtype)
        for n in own
    }


WEIGHTED_COLUMNS = 4096  # columns of one block of ``weighted_rows``: its rows stay in cache


def weighted_rows(shares: np.ndarray, flat: np.ndarray) -> np.ndarray:
    """``shares @ flat`` (k, n) x (n, d), each element summed as
    ``fedpers.aggregation.weighted_mean`` sums it, term by term in the order of ``flat``'s
    rows from zero (a share of 0 adds a zero: a finite model's sum is unchanged), so
    that every row equals its weighted mean to the bit; a block of columns at a time for
    all ``k`` rows (a matrix product would sum in another order)."""
    out = np.zeros((len(shares), flat.shape[1]))
    scratch = np.empty((len(shares), min(WEIGHTED_COLUMNS, flat.shape[1])))
    for start in range(0, flat.shape[1], WEIGHTED_COLUMNS):
        block = out[:, start : start + WEIGHTED_COLUMNS]
        term = scratch[:, : block.shape[1]]
        for j in range(len(flat)):
            np.multiply(shares[:, j, None], flat[j, start : start + WEIGHTED_COLUMNS], out=term)
            block += term
    return out
