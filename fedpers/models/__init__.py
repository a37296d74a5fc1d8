"""Models split into a shared-or-personal ``body`` and ``head``.

Every model is a ``SplitModel``: ``forward(x) = head(body(x))``, and its parameter names
start with ``body.`` or ``head.``, which is how algorithms declare what they share
(``fedpers.protocol.SHARED_PARTS``). The zoo holds the FedRep paper's networks (CIFAR-10
and CIFAR-100 CNNs without BatchNorm, the FEMNIST MLP), small MLPs for MNIST-1D and the
digits, variants of these with BatchNorm layers (``-bn``, for FedBN), and the linear
representation model of Section 4.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from functools import lru_cache

import numpy as np
import torch
from torch import nn

from fedpers.data.registry import MODEL_INPUTS
from fedpers.seeding import seed_torch


class SplitModel(nn.Module):
    """``head(body(x))`` with the two parts addressable by name."""

    def __init__(self, body: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def mlp(
    sizes: list[int],
    *,
    final_activation: bool = True,
    dropout: float = 0.0,
    batch_norm: bool = False,
) -> nn.Sequential:
    """Linear layers of the given sizes with ReLU between them (with ``batch_norm``, a
    ``BatchNorm1d`` between each such layer and its ReLU, as FedBN's models have)."""
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(fan_in, fan_out))
        if i < len(sizes) - 2 or final_activation:
            if batch_norm:
                layers.append(nn.BatchNorm1d(fan_out))
            layers.append(nn.ReLU())
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def _logistic(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """Multinomial logistic regression: no representation, a linear head on the inputs."""
    return SplitModel(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def _mnist1d_mlp(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    return SplitModel(mlp([40, 128, 64]), nn.Linear(64, num_classes))


def _digits_mlp(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    return SplitModel(mlp([64, 128, 64]), nn.Linear(64, num_classes))


def _mnist1d_mlp_bn(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """The MNIST-1D MLP with BatchNorm after each hidden layer (FedBN's rows)."""
    return SplitModel(mlp([40, 128, 64], batch_norm=True), nn.Linear(64, num_classes))


def _digits_mlp_bn(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """The digits MLP with BatchNorm after each hidden layer (FedBN's rows)."""
    return SplitModel(mlp([64, 128, 64], batch_norm=True), nn.Linear(64, num_classes))


def _femnist_mlp(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """FedRep's FEMNIST MLP 784-512-256-64 | 64-C (plain logits: no softmax before CE)."""
    return SplitModel(
        nn.Sequential(nn.Flatten(), mlp([784, 512, 256, 64])), nn.Linear(64, num_classes)
    )


def _femnist_mlp_bn(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """FedRep's FEMNIST MLP with BatchNorm after each hidden layer (FedBN's rows)."""
    return SplitModel(
        nn.Sequential(nn.Flatten(), mlp([784, 512, 256, 64], batch_norm=True)),
        nn.Linear(64, num_classes),
    )


def _cifar10_cnn(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """FedRep's CIFAR-10 CNN: 2 conv 5x5 (64) + pool, fc 1600-120-64 | 64-C, no BN."""
    body = nn.Sequential(
        nn.Conv2d(3, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), mlp([1600, 120, 64]),
    )  # fmt: skip
    return SplitModel(body, nn.Linear(64, num_classes))


def _cifar100_cnn(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """FedRep's CIFAR-100 CNN: conv 64, 128, fc 3200-256-128, dropout 0.6 | 128-C."""
    body = nn.Sequential(
        nn.Conv2d(3, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), mlp([3200, 256, 128], dropout=0.6),
    )  # fmt: skip
    return SplitModel(body, nn.Linear(128, num_classes))


def _cifar10_cnn_bn(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """The CIFAR-10 CNN with a BatchNorm after each conv and hidden fc layer, before its
    ReLU (FedBN's rows; FedBN's own CNNs put BatchNorm there too)."""
    body = nn.Sequential(
        nn.Conv2d(3, 64, 5), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 5), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), mlp([1600, 120, 64], batch_norm=True),
    )  # fmt: skip
    return SplitModel(body, nn.Linear(64, num_classes))


def _cifar100_cnn_bn(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """The CIFAR-100 CNN with a BatchNorm after each conv and hidden fc layer (FedBN's
    rows)."""
    body = nn.Sequential(
        nn.Conv2d(3, 64, 5), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 5), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), mlp([3200, 256, 128], dropout=0.6, batch_norm=True),
    )  # fmt: skip
    return SplitModel(body, nn.Linear(128, num_classes))


def linear_model(dim: int, rank: int) -> SplitModel:
    """FedRep's linear model y = w^T B^T x: body weight B^T (k x d), head w^T.

    Kept for a uniform model zoo; the linear experiments use its array names with numpy.
    """
    return SplitModel(nn.Linear(dim, rank, bias=False), nn.Linear(rank, 1, bias=False))


MODELS: dict[str, Callable[[tuple[int, ...], int], SplitModel]] = {
    "logistic": _logistic,
    "mnist1d-mlp": _mnist1d_mlp,
    "digits-mlp": _digits_mlp,
    "femnist-mlp": _femnist_mlp,
    "mnist1d-mlp-bn": _mnist1d_mlp_bn,
    "digits-mlp-bn": _digits_mlp_bn,
    "femnist-mlp-bn": _femnist_mlp_bn,
    "cifar10-cnn": _cifar10_cnn,
    "cifar100-cnn": _cifar100_cnn,
    "cifar10-cnn-bn": _cifar10_cnn_bn,
    "cifar100-cnn-bn": _cifar100_cnn_bn,
}


def register_model(
    name: str,
    builder: Callable[[tuple[int, ...], int], SplitModel],
    *,
    input_shape: tuple[int, ...] | None,
) -> None:
    """Make model ``name`` available to every run (``model = "<name>"``).

    Parameters
    ----------
    name : str
        The run-config value that selects it; must not name a built-in model.
    builder : callable
        ``(input_shape, num_classes) -> SplitModel`` whose parameters are named
        ``body.*`` and ``head.*``; called under a seeded torch RNG.
    input_shape : tuple of int, or None
        The one input shape it takes (checked against the data set before a run
        starts), or None for any.

    Raises
    ------
    ValueError
        If ``name`` is taken.
    """
    if MODELS.get(name) is builder and MODEL_INPUTS.get(name) == input_shape:
        return  # the same registration again (an extension loaded by a fresh fedpers)
    if name in MODELS or name in MODEL_INPUTS:
        raise ValueError(f"model '{name}' exists already; choose another name")
    MODELS[name] = builder
    MODEL_INPUTS[name] = input_shape


def build_model(
    name: str, num_classes: int, seed: int, input_shape: tuple[int, ...] = ()
) -> SplitModel:
    """The model ``name`` with weights drawn from ``seed``, equal in every process.

    ``input_shape`` is needed by models that take any input (``logistic``). The global
    torch RNG is left as it was. Clients build their models for every message, so the
    seeded model is made once per process and copied.
    """
    return copy.deepcopy(_prototype(name, num_classes, seed, tuple(input_shape)))


@lru_cache(maxsize=64)
def _prototype(name: str, num_classes: int, seed: int, input_shape: tuple[int, ...]) -> SplitModel:
    with torch.random.fork_rng(devices=[]):
        seed_torch(seed)
        return MODELS[name](input_shape, num_classes)


def part_arrays(model: nn.Module, parts: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Copies of the parameters (and buffers) of the named parts as numpy arrays."""
    return {
        name: tensor.detach().cpu().numpy().copy()
        for name, tensor in model.state_dict().items()
        if name.split(".", 1)[0] in parts
    }


def load_part_arrays(model: nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Overwrite the named parameters from numpy arrays; shapes must match exactly."""
    state = model.state_dict()
    for name, array in arrays.items():
        if name not in state:
            raise KeyError(f"model has no parameter '{name}'")
        if tuple(state[name].shape) != tuple(array.shape):
            raise ValueError(
                f"parameter '{name}' has shape {tuple(state[name].shape)}, "
                f"received {tuple(array.shape)}"
            )
        state[name].copy_(torch.as_tensor(array))
