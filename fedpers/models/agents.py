"""Sheaf-FRL agents: heterogeneous encoders (``body``) and heads to the classes.

The private path is ``head(body(x))``: the head sees raw latents. Messages, the gluing
penalty and the restriction maps use whitened latents (``pilot_whitening`` during
training, ``fedpers.sheaf.Whitening`` for messages); a receiver decodes a neighbour's
(transported) whitened latents by colouring them with its own statistics and applying
its head.
"""

from __future__ import annotations

import torch
from torch import nn

from fedpers.seeding import seed_torch
from fedpers.sheaf import EIGENVALUE_FLOOR, AgentSpec


def pilot_whitening(
    latents: torch.Tensor, ridge: float = EIGENVALUE_FLOOR
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whitened pilot latents and the statistics that whiten them, differentiably.

    ``w = (z - mu) L^{-T}`` with ``L`` the Cholesky factor of the pilots' covariance plus
    ``ridge I``. Used inside the gluing penalty: the penalty then measures how well the
    *shapes* of two agents' pilot clouds agree, and an encoder cannot lower it by
    shrinking or stretching its latents, which the whitening undoes (the authors' code
    whitens each pilot batch the same way). Any whitening differs from ZCA by a rotation,
    which the Procrustes maps absorb.

    Returns
    -------
    whitened, mean, factor : torch.Tensor
        (n x d), (d,), and ``L`` (d x d, lower triangular).
    """
    mean = latents.mean(dim=0)
    centred = latents - mean
    covariance = centred.T @ centred / max(len(latents) - 1, 1)
    eye = torch.eye(latents.shape[1], dtype=latents.dtype)
    factor = torch.linalg.cholesky(covariance + ridge * eye)
    whitened = torch.linalg.solve_triangular(factor, centred.T, upper=False).T
    return whitened, mean, factor


class Agent(nn.Module):
    """One agent: ``body`` (encoder) and ``head`` (decoder to classes)."""

    def __init__(self, body: nn.Module, latent: int, head: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = head
        self.latent_dim = latent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build_agent(spec: AgentSpec, dataset: str, num_classes: int, seed: int) -> Agent:
    """The agent of ``spec`` for ``dataset``, weights drawn from ``seed``.

    Digits (8 x 8, flat): an MLP encoder 64 -> hidden -> latent. MNIST: two conv3x3-BN-
    ReLU-maxpool-dropout blocks and global average pooling, the paper's encoder shape,
    with ``hidden`` and ``latent`` channels. Heads: latent -> head_hidden -> classes.
    """
    with torch.random.fork_rng(devices=[]):
        seed_torch(seed)
        if dataset == "digits":
            body: nn.Module = nn.Sequential(
                nn.Linear(64, spec.hidden),
                nn.ReLU(),
                nn.Dropout(spec.dropout),
                nn.Linear(spec.hidden, spec.latent),
            )
        elif dataset == "mnist":
            body = nn.Sequential(
                nn.Conv2d(1, spec.hidden, 3, padding=1), nn.BatchNorm2d(spec.hidden), nn.ReLU(),
                nn.MaxPool2d(2), nn.Dropout(spec.dropout),
                nn.Conv2d(spec.hidden, spec.latent, 3, padding=1), nn.BatchNorm2d(spec.latent),
                nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(spec.dropout),
                nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            )  # fmt: skip
        else:
            raise ValueError(f"no Sheaf-FRL agent for dataset '{dataset}'")
        head = nn.Sequential(
            nn.Linear(spec.latent, spec.head_hidden),
            nn.ReLU(),
            nn.Linear(spec.head_hidden, num_classes),
        )
        return Agent(body, spec.latent, head)
