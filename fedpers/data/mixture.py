"""Synthetic clients whose joint distributions are mixtures (FedGMM, Section 4.1).

M Gaussian components ``N(mu_m, Sigma)`` over ``R^d``, each with its own labelling
function ``y = 1{(x - mu_m)^T v_m > 0}``. Client ``c`` draws its mixture weights
``pi_c ~ Dir(alpha)``, then for each sample a component ``z ~ pi_c``, ``x ~ N(mu_z,
Sigma)`` and ``y = F_z(x)``. Every client generates its own samples from its own
stream, so no client needs anyone else's data (or all of it).

Variants (each a run-config key):
- covariance ``identity`` (the paper's text) or ``official`` (``I / sqrt(d)``, the
  authors' code);
- labels ``difference`` (``v_m = +-(mu_m' - mu_m)`` for a random other component m',
  the authors' code) or ``random`` (a Gaussian unit vector);
- sizes ``fixed`` (``samples-per-client`` each) or ``lognormal`` (the authors' code:
  ``min(LogNormal(4, 2) + 100, 1000)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property

import numpy as np

from fedpers.seeding import rng
from fedpers.settings import at_least, positive, setting

DATASET = "mixture"  # its name in fedpers.data.registry and run-config ``dataset``


class MixtureCovariance(StrEnum):
    """Covariance of the synthetic mixtures' components (``fedpers.data.mixture``)."""

    IDENTITY = "identity"
    OFFICIAL = "official"


class MixtureLabels(StrEnum):
    """Labelling directions of the synthetic mixtures (``fedpers.data.mixture``)."""

    DIFFERENCE = "difference"
    RANDOM = "random"


class MixtureSizes(StrEnum):
    """Client sizes of the synthetic mixtures (``fedpers.data.mixture``)."""

    FIXED = "fixed"
    LOGNORMAL = "lognormal"


@dataclass(frozen=True)
class MixtureDataSettings:
    """The synthetic mixtures of FedGMM's Section 4.1 (dataset "mixture").

    The data set's settings; the mixture family (``fedpers.families.mixture``) declares
    the group, so that the docs list it there."""

    mixture_dim: int = setting(32, "input dimension d")
    mixture_components: int = setting(3, "Gaussian components M")
    mixture_alpha: float = setting(0.4, "Dirichlet concentration of a client's mixture weights")
    mixture_covariance: MixtureCovariance = setting(
        MixtureCovariance.IDENTITY, "`identity` (the paper's text) or `official` (I / sqrt(d))"
    )
    mixture_labels: MixtureLabels = setting(
        MixtureLabels.DIFFERENCE,
        "labelling directions: the `difference` of two means (the authors' code) or `random`",
    )
    mixture_sizes: MixtureSizes = setting(
        MixtureSizes.FIXED,
        "`fixed` (`samples-per-client` each) or `lognormal` (the authors' code)",
    )

    def check(self) -> None:
        at_least("mixture-dim", self.mixture_dim, 1)
        at_least("mixture-components", self.mixture_components, 1)
        positive("mixture-alpha", self.mixture_alpha)


@dataclass(frozen=True)
class MixtureTasks:
    """The generative model shared by all clients (ids beyond the federation are new
    clients from the same model)."""

    dim: int
    components: int
    alpha: float
    covariance: str
    labels: str
    sizes: str
    samples: int
    seed: int

    @cached_property
    def means(self) -> np.ndarray:
        """Component means ``mu_m ~ U[-1, 1]^d`` (M, d)."""
        return rng(self.seed, "mixture-means").uniform(-1, 1, (self.components, self.dim))

    @cached_property
    def directions(self) -> np.ndarray:
        """Labelling directions ``v_m`` (M, d)."""
        generator = rng(self.seed, "mixture-directions")
        if self.labels == MixtureLabels.RANDOM or self.components == 1:
            v = generator.standard_normal((self.components, self.dim))
            return np.asarray(v / np.linalg.norm(v, axis=1, keepdims=True))
        out = np.empty((self.components, self.dim))
        for m in range(self.components):
            other = generator.choice([k for k in range(self.components) if k != m])
            out[m] = generator.choice([-1.0, 1.0]) * (self.means[other] - self.means[m])
        return out

    @property
    def scale(self) -> float:
        """Standard deviation of every coordinate within a component."""
        return 1.0 if self.covariance == MixtureCovariance.IDENTITY else float(self.dim**-0.25)

    def weights(self, client: int) -> np.ndarray:
        """Client ``client``'s mixture weights ``pi_c ~ Dir(alpha)``."""
        return rng(self.seed, "mixture-weights", client).dirichlet(
            np.full(self.components, self.alpha)
        )

    def size(self, client: int) -> int:
        """Number of samples of client ``client``."""
        if self.sizes == MixtureSizes.FIXED:
            return self.samples
        draw = rng(self.seed, "mixture-size", client).lognormal(4, 2)
        return int(min(draw + 100, 1000))

    def sample(self, client: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(x, y, component) of all samples of client ``client``."""
        generator = rng(self.seed, "mixture-samples", client)
        count = self.size(client)
        component = generator.choice(self.components, size=count, p=self.weights(client))
        x = self.means[component] + self.scale * generator.standard_normal((count, self.dim))
        y = np.einsum("nd,nd->n", x - self.means[component], self.directions[component]) > 0
        return x.astype(np.float32), y.astype(np.int64), component
