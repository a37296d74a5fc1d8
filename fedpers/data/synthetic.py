"""The synthetic multi-task linear regression of FedRep, Section 4 and Figures 1, 3, 4.

Client ``i`` draws ``x ~ N(0, I_d)`` and ``y = w_i*^T B*^T x + noise``, with a shared
ground-truth representation ``B*`` (d x k, orthonormal columns from the QR of a
Gaussian matrix) and a personal head ``w_i*`` (a Gaussian k-vector normalized to unit
length). Every party regenerates the same ``B*`` and heads from the seed; each round a
client draws fresh samples from its own stream, as the paper's analysis assumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from fedpers.seeding import rng


@dataclass(frozen=True)
class LinearTasks:
    """The generative model of all clients (and of new clients with ids >= n).

    Parameters
    ----------
    dim : int
        Input dimension ``d``.
    rank : int
        Representation dimension ``k``.
    noise_std : float
        Standard deviation of the label noise (the paper's N(., 1e-3) is a variance:
        std 0.0316).
    seed : int
        Seed of ``B*``, of the heads and of every sample.
    """

    dim: int
    rank: int
    noise_std: float
    seed: int

    @cached_property
    def representation(self) -> np.ndarray:
        """Ground truth ``B*`` (d x k) with orthonormal columns."""
        gaussian = rng(self.seed, "linear-representation").standard_normal((self.dim, self.rank))
        q, r = np.linalg.qr(gaussian)
        return q * np.sign(np.diag(r))

    def head(self, client: int) -> np.ndarray:
        """Ground-truth head ``w_i*`` (k,) of client ``client``, unit norm."""
        w = rng(self.seed, "linear-head", client).standard_normal(self.rank)
        return w / np.linalg.norm(w)

    def sample(
        self, client: int, num_samples: int, generator: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """``num_samples`` fresh pairs (X: m x d, y: m) of client ``client``."""
        x = generator.standard_normal((num_samples, self.dim))
        y = x @ (self.representation @ self.head(client))
        return x, y + self.noise_std * generator.standard_normal(num_samples)
