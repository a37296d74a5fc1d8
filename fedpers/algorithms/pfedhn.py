"""pFedHN (Shamsian, Navon, Fetaya and Chechik, "Personalized Federated Learning using
Hypernetworks", ICML 2021, Algorithm 1).

The server holds a hypernetwork ``h(v; phi)`` and one embedding ``v_i`` per client, and
generates each client's whole model ``theta_i = h(v_i; phi)``. A sampled client receives
its ``theta_i``, trains it for the round's ``epochs`` as FedAvg's clients do and replies
``theta~_i``; the server moves the hypernetwork and the client's embedding along the
vector-Jacobian product of the generated weights with ``theta_i - theta~_i``:

    phi <- phi - lr * (mean_i g_phi,i + wd phi),   v <- v - lr * (g_v + wd v),

where ``g_i`` is the product ``(d theta_i / d (phi, v_i))^T (theta_i - theta~_i)`` (the
authors' ``autograd.grad(weights, hnet.parameters(), grad_outputs=delta)``) scaled to
at most ``pfedhn-clip`` in norm (their ``clip_grad_norm_``, 50), ``g_v`` puts each
replying client's part on its own row of the embeddings, and ``wd`` is
``pfedhn-weight-decay`` (their 1e-3, on every parameter, every embedding row). A client
is tested with the model the server generates for it; nothing is kept on the device.

The hypernetwork is the authors' MLP: ``a_0 = W_0 v + b_0``, ``a_l = W_l relu(a_{l-1}) +
b_l`` for ``pfedhn-layers`` hidden layers of ``pfedhn-hidden`` units, then one linear
output for the model's parameters, ``theta = W_o a_L + b_o``; the embeddings start as
N(0, 1) draws and the layers as torch's ``nn.Linear`` (uniform in +-1/sqrt(fan in)),
seeded by the run. It is computed here in numpy (its forward pass and its
vector-Jacobian product, written out), so the server still never imports torch. Its
state, the global arrays ``pfedhn.<name>`` (``embeddings`` (n, e) and the layers), is
checkpointed with the run; at 1,000 clients of FedRep's MNIST-1D MLP (14,154
parameters) with the defaults (e = 1 + 1,000 / 4, hidden 100), 13.9 MB: 2.0 MB of
embeddings (251 float64 a client, 2,008 bytes) and 11.9 MB of layers (their arrays'
sizes, 2026-12-07).

What differs from the paper, and why: the authors take one client a step, with momentum
0.9; a round here samples several, whose clipped products are combined by the run's
``aggregation`` (the mean by default) for one SGD step without momentum (no optimizer
state to checkpoint), so that the round is one server step as every other row's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.families import personalized
from fedpers.protocol import MODEL_PARTS
from fedpers.settings import at_least, finite, setting, step_size

PREFIX = "pfedhn."
EMBEDDINGS = PREFIX + "embeddings"
# The target model's arrays, each as its shape (in its dtype), so that a resumed server
# knows what it generates: ``pfedhn-model.<name>``.
MODEL = "pfedhn-model."
Arrays = dict[str, np.ndarray]


@dataclass(frozen=True)
class PFedHNSettings:
    """The hypernetwork of pFedHN (the row `pfedhn`)."""

    HEADING: ClassVar[str] = "pfedhn"

    pfedhn_embed_dim: int = setting(
        0, "pFedHN: the clients' embedding size (0: the authors' 1 + num-clients / 4)"
    )
    pfedhn_hidden: int = setting(100, "pFedHN: units of each hidden layer (the authors' 100)")
    pfedhn_layers: int = setting(
        3, "pFedHN: hidden layers after the embedding's (the authors' n_hidden, 3)"
    )
    # Chosen on validation (docs/reproducing.md): FedRep's Table 1 setting, seeds 0-2:
    # 0.01 (the authors', with momentum 0.9) / 0.03 / 0.1 / 0.3 -> 29.62 / 44.38 / 54.14 /
    # 62.08 %; at 1 every run diverged (non-finite replies from round 4).
    pfedhn_clip: float = setting(
        50.0,
        "pFedHN: each reply's product (the hypernetwork's and its embedding's gradient) is "
        "scaled to at most this norm (the authors' clip_grad_norm_ 50)",
    )
    pfedhn_weight_decay: float = setting(
        1.0e-3, "pFedHN: weight decay of the server's SGD step (the authors' 1e-3)"
    )
    pfedhn_lr: float = setting(
        0.3, "pFedHN: the server's SGD step on the hypernetwork and embeddings (authors' 0.01)"
    )

    def check(self) -> None:
        at_least("pfedhn-embed-dim", self.pfedhn_embed_dim, 0)
        at_least("pfedhn-hidden", self.pfedhn_hidden, 1)
        at_least("pfedhn-layers", self.pfedhn_layers, 0)
        step_size("pfedhn-lr", self.pfedhn_lr)
        finite("pfedhn-clip", self.pfedhn_clip, 0.0, strict=True)
        finite("pfedhn-weight-decay", self.pfedhn_weight_decay, 0.0)

    def embedding_size(self, clients: int) -> int:
        return self.pfedhn_embed_dim or 1 + clients // 4


def initial(
    model: Arrays, clients: int, settings: PFedHNSettings, generator: np.random.Generator
) -> Arrays:
    """The seeded hypernetwork for ``model``'s arrays (their flat concatenation, in
    the order of their names), ``clients`` embeddings, and the model's shapes."""
    size = settings.embedding_size(clients)
    outputs = sum(v.size for v in model.values())
    widths = [size] + [settings.pfedhn_hidden] * (settings.pfedhn_layers + 1)
    state = {MODEL + k: np.array(v.shape, dtype=v.dtype) for k, v in model.items()}
    state[EMBEDDINGS] = generator.standard_normal((clients, size))
    for layer, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        state.update(_linear(f"{PREFIX}{layer}", fan_in, fan_out, generator))
    state.update(_linear(f"{PREFIX}out", widths[-1], outputs, generator))
    return state


def _linear(name: str, fan_in: int, fan_out: int, generator: np.random.Generator) -> Arrays:
    bound = 1.0 / np.sqrt(fan_in)
    return {
        f"{name}.weight": generator.uniform(-bound, bound, (fan_out, fan_in)),
        f"{name}.bias": generator.uniform(-bound, bound, fan_out),
    }


def layers(state: Arrays) -> int:
    """The number of hidden layers of the hypernetwork ``state`` (the first included)."""
    return sum(1 for k in state if k.startswith(PREFIX) and k.endswith(".weight")) - 1


def generate(state: Arrays, client: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """``theta_i`` (flat) and the pre-activations ``a_0 .. a_L`` its product needs."""
    a = state[f"{PREFIX}0.weight"] @ state[EMBEDDINGS][client] + state[f"{PREFIX}0.bias"]
    activations = [a]
    for layer in range(1, layers(state)):
        a = state[f"{PREFIX}{layer}.weight"] @ np.maximum(a, 0) + state[f"{PREFIX}{layer}.bias"]
        activations.append(a)
    return state[f"{PREFIX}out.weight"] @ a + state[f"{PREFIX}out.bias"], activations


def vjp(state: Arrays, client: int, delta: np.ndarray) -> Arrays:
    """``(d theta_i / d phi)^T delta`` for every array of ``state`` (the embeddings'
    only in row ``client``)."""
    _, activations = generate(state, client)
    grads = {
        f"{PREFIX}out.weight": np.outer(delta, activations[-1]),
        f"{PREFIX}out.bias": delta.copy(),
    }
    back = state[f"{PREFIX}out.weight"].T @ delta  # d/d a_L
    for layer in range(layers(state) - 1, 0, -1):
        below = np.maximum(activations[layer - 1], 0)
        grads[f"{PREFIX}{layer}.weight"] = np.outer(back, below)
        grads[f"{PREFIX}{layer}.bias"] = back.copy()
        back = (state[f"{PREFIX}{layer}.weight"].T @ back) * (activations[layer - 1] > 0)
    grads[f"{PREFIX}0.weight"] = np.outer(back, state[EMBEDDINGS][client])
    grads[f"{PREFIX}0.bias"] = back.copy()
    embeddings = np.zeros_like(state[EMBEDDINGS])
    embeddings[client] = state[f"{PREFIX}0.weight"].T @ back
    grads[EMBEDDINGS] = embeddings
    return grads


def model_of(state: Arrays, client: int) -> Arrays:
    """Client ``client``'s generated model, by the target model's names, shapes and
    dtypes (its flat ``theta_i`` split in the order of the names)."""
    flat, _ = generate(state, client)
    out, start = {}, 0
    for key in sorted(k for k in state if k.startswith(MODEL)):
        shape = tuple(int(d) for d in state[key])
        size = int(np.prod(shape))
        out[key[len(MODEL) :]] = flat[start : start + size].reshape(shape).astype(state[key].dtype)
        start += size
    return out


def hypernetwork(state: Arrays) -> list[str]:
    """The names of the arrays the server trains (the layers and the embeddings)."""
    return [k for k in state if k.startswith(PREFIX)]


def flatten(arrays: Arrays) -> np.ndarray:
    """The arrays' values in their names' order, as one float64 vector."""
    return np.concatenate([np.asarray(arrays[n], dtype=np.float64).ravel() for n in sorted(arrays)])


ROWS = (
    AlgorithmSpec(
        name="pfedhn",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        strategy="fedpers.strategies.pfedhn:PFedHN",
        settings=(PFedHNSettings,),
        checks=(
            personalized.refuses_dp("whose server trains a hypernetwork on the updates"),
            personalized.refuses_batch_norm("its hypernetwork generates every array of the model"),
        ),
        wire=(PREFIX, MODEL),
        personal_state=False,  # the server generates each client's model
        paper="Shamsian et al., ICML 2021",
    ),
)
