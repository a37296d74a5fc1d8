"""The GMM's input embedding z = phi(x): identity, pooled PCA, or a local encoder.

FedGMM fits its Gaussians on an embedding of the inputs, never on the learners' raw
inputs: the paper uses ImageNet ResNet18 features projected by PCA to 48 dimensions.
Weights cannot be downloaded here, so the encoder is optional and read from a local
file; by default images are embedded by a PCA of their pixels. The PCA's statistics are
pooled from the clients (``fedpers.gmm.moment_statistics``): no sample leaves a client.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

ENCODER_BATCH = 256


def flatten(x: np.ndarray) -> np.ndarray:
    """Samples as float64 row vectors."""
    return np.asarray(x.reshape(len(x), -1), dtype=float)


def project(x: np.ndarray, mean: np.ndarray, directions: np.ndarray) -> np.ndarray:
    """``(x - mean) W^T``: the PCA embedding (n, k)."""
    return np.asarray((flatten(x) - mean) @ directions.T)


@lru_cache(maxsize=1)
def _encoder(path: str) -> object:
    import torch
    import torchvision

    model = torchvision.models.resnet18(weights=None)
    state = torch.load(Path(path), map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    model.fc = torch.nn.Identity()
    return model.eval()


def encode(x: np.ndarray, weights_path: str) -> np.ndarray:
    """ResNet18 features (n, 512) of images (n, C, H, W) or grey images (n, 1, H, W).

    The weights come from ``weights_path`` (a torchvision ``resnet18`` state dict on this
    machine); grey images are repeated over three channels.
    """
    import torch

    model = _encoder(weights_path)
    images = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    if images.ndim != 4:
        raise ValueError(f"the encoder takes images (n, C, H, W), got shape {tuple(x.shape)}")
    if images.shape[1] == 1:
        images = images.repeat(1, 3, 1, 1)
    features = []
    with torch.no_grad():
        for start in range(0, len(images), ENCODER_BATCH):
            features.append(model(images[start : start + ENCODER_BATCH]).numpy())  # type: ignore[operator]
    return np.concatenate(features).astype(float) if features else np.zeros((0, 512))
