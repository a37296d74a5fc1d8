"""Sheaf-FRL agent (clients/sheaf.py): the whole model stays in ``context.state``.

A round of the default (heterogeneous) protocol:
1. ``query.pilots``: refit the whitening on the current pilot latents, send the
   whitened pilot matrix ``A_i`` (the only thing that leaves the agent);
2. ``train``: receive the neighbours' pilot matrices, refit every incident restriction
   map in closed form (Procrustes; both endpoints compute the same map from the same
   two matrices), then train on the private loss plus ``lambda`` times the gluing
   penalty of those edges on pilot batches, neighbours' pilots held fixed.

Variants with equal latent dimensions: ``homogeneous`` (the edge's source computes the
one SVD of the edge, ``query.maps``, and sends its pilots already transported; its raw
latents never leave it) and ``private`` (every agent only ever sends pilots transported
into its neighbour's coordinates with the current map; both endpoints correct the map
by a Procrustes step on what they receive, which lands both on the same optimum).
``non-cooperative`` trains with lambda = 0 and exchanges nothing.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedpers import protocol, records, sheaf
from fedpers.clients.base import TorchClient
from fedpers.clients.common import Arrays, Metrics, config_int
from fedpers.config import RunConfig
from fedpers.data.client import pilot_data
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import SheafVariant
from fedpers.legacy_training import evaluate, train
from fedpers.models.agents import build_agent, pilot_whitening
from fedpers.protocol import MODEL_PARTS
from fedpers.seeding import int_seed

STATE_MODEL = "sheaf.model"
STATE_MAPS = "sheaf.maps"
STATE_NEIGHBOUR_PILOTS = "sheaf.neighbour-pilots"


class SheafClient(TorchClient):
    """One agent of a Sheaf-FRL graph; ``cooperative = False`` trains it alone."""

    cooperative = True

    def __init__(self, run: RunConfig, partition_id: int, state: RecordDict) -> None:
        super().__init__(run, partition_id, state)
        self.specs = sheaf_family.run_agent_specs(run)
        self.dims = [s.latent for s in self.specs]
        self.model = build_agent(
            self.specs[partition_id],
            run.dataset,
            run.num_classes,
            int_seed(run.seed, "agent", partition_id),
        )
        if STATE_MODEL in state:
            stored = state[STATE_MODEL]
            assert isinstance(stored, ArrayRecord)
            self.model.load_state_dict(
                {k: torch.from_numpy(records.values(v)) for k, v in stored.items()}
            )
        self.model.to(self.device)
        self.pilots_x, self.pilots_y = pilot_data(run)
        self.lam = sheaf_family.settings(run).sheaf_lambda if self.cooperative else 0.0

    # ------------------------------------------------------------------ helpers
    def save(self) -> None:
        """Keep the whole model on the device."""
        self.state[STATE_MODEL] = ArrayRecord(
            {k: Array(v.detach().cpu().numpy().copy()) for k, v in self.model.state_dict().items()}
        )

    @torch.no_grad()
    def raw_latents(self, x: np.ndarray) -> np.ndarray:
        """Encoder outputs (eval mode) of inputs ``x``."""
        self.model.eval()
        return self.model.body(self.tensor(x)).cpu().numpy().astype(float)

    def whitening(self, mode: str) -> sheaf.Whitening:
        """Whitening statistics fitted on the pilots' or the training data's latents."""
        source = self.pilots_x if mode == sheaf_family.Whitening.PILOTS else self.data.x_train
        return sheaf.Whitening.fit(self.raw_latents(source))

    def own_pilots(self) -> np.ndarray:
        """The pilot latents whitened by their own statistics (eval mode, no dropout)."""
        with torch.no_grad():
            self.model.eval()
            whitened, _, _ = pilot_whitening(self.model.body(self.tensor(self.pilots_x)))
            return whitened.cpu().numpy().astype(float)

    def restriction(self, neighbour: int, own: np.ndarray, theirs: np.ndarray) -> np.ndarray:
        """The edge's map ``V`` (d_large x d_small) from the two endpoints' pilots."""
        a, _ = sheaf.orient(self.partition_id, neighbour, self.dims)
        return (
            sheaf.procrustes(own, theirs)
            if a == self.partition_id
            else sheaf.procrustes(theirs, own)
        )

    def to_neighbour(
        self, neighbour: int, latents: np.ndarray, restriction: np.ndarray
    ) -> np.ndarray:
        """This agent's latents expressed in ``neighbour``'s coordinates."""
        a, _ = sheaf.orient(self.partition_id, neighbour, self.dims)
        if a == self.partition_id:
            return sheaf.transport_up(latents, restriction)
        return sheaf.transport_down(latents, restriction)

    def from_neighbour(
        self, neighbour: int, latents: np.ndarray, restriction: np.ndarray
    ) -> np.ndarray:
        """``neighbour``'s latents expressed in this agent's coordinates."""
        a, _ = sheaf.orient(self.partition_id, neighbour, self.dims)
        if a == self.partition_id:
            return sheaf.transport_down(latents, restriction)
        return sheaf.transport_up(latents, restriction)

    # ---------------------------------------------------------- pilot exchanges
    def pilots_message(self, config: ConfigRecord) -> Arrays:
        """Send the current pilot latents whitened by their own statistics."""
        pilots = self.own_pilots()
        self.save()
        return {sheaf_family.PILOTS: pilots}

    def maps_message(self, arrays: Arrays) -> Arrays:
        """Homogeneous variant, edge source: one SVD per owned edge; send own pilots
        transported into each owned neighbour's coordinates (raw ones never leave)."""
        own = self.own_pilots()
        maps, kept, out = {}, {}, {}
        for name, theirs in arrays.items():
            _, neighbour = sheaf_family.agent_of(name)
            restriction = self.restriction(neighbour, own, theirs)
            maps[str(neighbour)] = Array(restriction)
            kept[str(neighbour)] = Array(theirs)
            out[sheaf_family.from_agent(sheaf_family.TRANSPORTED, neighbour)] = self.to_neighbour(
                neighbour, own, restriction
            )
            out[sheaf_family.from_agent(sheaf_family.MAP, neighbour)] = restriction
        self.state[STATE_MAPS] = ArrayRecord(maps)
        self.state[STATE_NEIGHBOUR_PILOTS] = ArrayRecord(kept)
        return out

    def transport_message(self, neighbours: list[int]) -> Arrays:
        """Private variant: own pilots in each neighbour's coordinates, current maps."""
        own = self.own_pilots()
        maps = self._stored(STATE_MAPS)
        return {
            sheaf_family.from_agent(sheaf_family.TRANSPORTED, j): own
            @ maps.get(str(j), np.eye(own.shape[1]))
            for j in neighbours
        }

    def _stored(self, key: str) -> dict[str, np.ndarray]:
        record = self.state.get(key)
        if record is None:
            return {}
        assert isinstance(record, ArrayRecord)
        return {k: records.values(v) for k, v in record.items()}

    # -------------------------------------------------------------------- train
    def edge_targets(self, arrays: Arrays) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Per incident edge: the neighbour's pilots in this agent's frame of reference,
        as ``(target, restriction)``: the penalty compares ``own @ restriction`` (or
        ``own`` when None) with ``target``, one row per pilot."""
        own = self.own_pilots()
        if sheaf_family.settings(self.run).sheaf_variant == SheafVariant.HETEROGENEOUS:
            return self._heterogeneous_targets(own, arrays)
        if sheaf_family.settings(self.run).sheaf_variant == SheafVariant.HOMOGENEOUS:
            return self._homogeneous_targets(arrays)
        return self._private_targets(own, arrays)

    def _heterogeneous_targets(
        self, own: np.ndarray, arrays: Arrays
    ) -> list[tuple[np.ndarray, np.ndarray | None]]:
        edges: list[tuple[np.ndarray, np.ndarray | None]] = []
        fitted: dict[str, Array] = {}
        for name, theirs in sorted(arrays.items()):
            _, neighbour = sheaf_family.agent_of(name)
            restriction = self.restriction(neighbour, own, theirs)
            fitted[str(neighbour)] = Array(restriction)
            if sheaf.orient(self.partition_id, neighbour, self.dims)[0] == self.partition_id:
                edges.append((sheaf.transport_down(theirs, restriction), None))  # small side
            else:
                edges.append((theirs, restriction))  # large side: own @ V vs their pilots
        self.state[STATE_MAPS] = ArrayRecord(fitted)
        return edges

    def _homogeneous_targets(self, arrays: Arrays) -> list[tuple[np.ndarray, np.ndarray | None]]:
        maps = self._stored(STATE_MAPS)  # owned edges' maps (set by maps_message)
        kept = self._stored(STATE_NEIGHBOUR_PILOTS)
        edges: list[tuple[np.ndarray, np.ndarray | None]] = [
            (kept[key], maps[key].T)
            for key in sorted(kept, key=int)  # own O^T vs theirs
        ]
        for name, received in sorted(arrays.items()):
            kind, agent = sheaf_family.agent_of(name)
            key = str(agent)
            if kind == sheaf_family.MAP:  # the owner's map of our edge, relayed
                maps[key] = received
            else:  # the owner's pilots, already transported into this frame
                edges.append((received, None))
        self.state[STATE_MAPS] = ArrayRecord({k: Array(v) for k, v in maps.items()})
        return edges

    def _private_targets(
        self, own: np.ndarray, arrays: Arrays
    ) -> list[tuple[np.ndarray, np.ndarray | None]]:
        current = self._stored(STATE_MAPS)
        updated: dict[str, Array] = {}
        edges: list[tuple[np.ndarray, np.ndarray | None]] = []
        for name, received in sorted(arrays.items()):
            key = str(sheaf_family.agent_of(name)[1])
            # `received` = their pilots through their map to me, W_j M_ji. The best
            # correction R (received R^T ~ own) makes M_ji R^T the optimal map, and my
            # map to them its transpose R M_ij; the neighbour, correcting from the other
            # side, reaches the same optimum (Procrustes is unique).
            correction = sheaf.procrustes(received, own)
            updated[key] = Array(correction @ current.get(key, np.eye(own.shape[1])))
            edges.append((received @ correction.T, None))
        self.state[STATE_MAPS] = ArrayRecord(updated)
        return edges

    def fit(self, arrays: Arrays, config: ConfigRecord) -> tuple[Arrays, Metrics]:
        """Refit the incident maps, then local epochs on loss + lambda * penalty."""
        edges = self.edge_targets(arrays) if self.lam > 0 else []
        server_round = config_int(config, protocol.ROUND)
        generator = self.generator("train", server_round)
        pilots = self.tensor(self.pilots_x)
        targets = [
            (
                self.tensor(t.astype(np.float32)),
                None if r is None else self.tensor(r.astype(np.float32)),
            )
            for t, r in edges
        ]
        batch = sheaf_family.settings(self.run).sheaf_pilot_batch
        lam = self.lam
        penalties: list[float] = []

        def penalty(gen: torch.Generator) -> torch.Tensor:
            index = torch.randperm(len(pilots), generator=gen)[:batch]
            # All pilots through the encoder without dropout (the maps were fitted on
            # eval-mode latents), whitened by their own statistics with gradient.
            self.model.body.eval()
            whitened, _, _ = pilot_whitening(self.model.body(pilots))
            own = whitened[index]
            self.model.body.train()
            total = sheaf.gluing_penalty_torch(own, [(t[index], r) for t, r in targets])
            penalties.append(float(total.detach()))
            return lam * total

        stats = train(
            self.model,
            self.tensor(self.data.x_train),
            self.tensor(self.data.y_train),
            parts=MODEL_PARTS,
            epochs=config_int(config, protocol.EPOCHS),
            settings=self.sgd_settings(config),
            generator=generator,
            penalty=penalty if targets else None,
            max_grad_norm=sheaf_family.settings(self.run).sheaf_clip
            if sheaf_family.settings(self.run).sheaf_clip > 0
            else None,
        )
        self.save()
        return {}, {
            protocol.NUM_EXAMPLES: float(len(self.data.y_train)),
            protocol.LOSS: stats.loss,
            sheaf_family.PENALTY: float(np.mean(penalties)) if penalties else 0.0,
        }

    # ----------------------------------------------------------------- evaluate
    def latents_message(self, config: ConfigRecord) -> Arrays:
        """Whitened test latents and labels, for the neighbours' communication accuracy."""
        whitening = self.whitening(
            str(config.get(sheaf_family.WHITENING, sheaf_family.Whitening.PILOTS))
        )
        return {
            sheaf_family.PILOTS: whitening.whiten(self.raw_latents(self.pilots_x)),
            sheaf_family.LATENTS: whitening.whiten(self.raw_latents(self.data.x_test)),
            sheaf_family.LABELS: self.data.y_test.astype(np.int64),
        }

    def evaluate(self, arrays: Arrays, config: ConfigRecord) -> Metrics:
        """Private accuracy, or (``communication = 1``) the accuracy of decoding each
        neighbour's transported test latents with this agent's head."""
        if not config_int(config, sheaf_family.COMMUNICATION, default=0):
            stats = evaluate(
                self.model, self.tensor(self.data.x_test), self.tensor(self.data.y_test)
            )
            # Weight 1: the paper averages accuracies over agents, not over samples.
            return {
                protocol.NUM_EXAMPLES: 1.0,
                protocol.ACCURACY: stats.accuracy,
                sheaf_family.TEST_EXAMPLES: float(stats.num_examples),
            }
        whitening = self.whitening(
            str(config.get(sheaf_family.WHITENING, sheaf_family.Whitening.PILOTS))
        )
        own = whitening.whiten(self.raw_latents(self.pilots_x))
        metrics: Metrics = {protocol.NUM_EXAMPLES: 1.0}
        accuracies = []
        for name in sorted(arrays):
            kind, sender = sheaf_family.agent_of(name)
            if kind != sheaf_family.PILOTS:
                continue
            restriction = self.restriction(sender, own, arrays[name])
            latents = arrays[sheaf_family.from_agent(sheaf_family.LATENTS, sender)]
            labels = arrays[sheaf_family.from_agent(sheaf_family.LABELS, sender)]
            if len(labels) == 0:
                continue
            received = self.from_neighbour(sender, latents, restriction)
            with torch.no_grad():
                self.model.eval()
                raw = self.tensor(whitening.colour(received).astype(np.float32))
                predicted = self.model.head(raw).argmax(dim=1).cpu().numpy()
            accuracy = float(np.mean(predicted == labels))
            metrics[sheaf_family.edge_metric(sender)] = accuracy
            accuracies.append(accuracy)
        metrics[protocol.ACCURACY] = float(np.mean(accuracies)) if accuracies else float("nan")
        return metrics


class NonCooperativeClient(SheafClient):
    """The same agent trained alone (lambda = 0); aligned only after training."""

    cooperative = False
