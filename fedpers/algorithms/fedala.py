"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma and Guan, "FedALA: Adaptive Local Aggregation
for Personalized Federated Learning", AAAI 2023, Algorithm 1).

The server runs FedAvg on the whole model. A sampled client does not overwrite its
local model ``theta_i`` with the global ``theta``; it initializes its model by adaptive
local aggregation (ALA): the lower layers (the body) take the global values, and the
higher layers (the head: the paper's ``p`` = 1 layer) become

    theta_hat = theta_i + (theta - theta_i) * W        (elementwise),

with element-wise weights ``W`` in [0, 1] (all ones at first, kept in ``context.state``
between rounds) learned on a random ``fedala-sample``% of its training samples (a
contiguous slice at a random start, in order, as the authors' code takes it), in
mini-batches of the run's ``batch-size``:

    W <- clip(W - eta * grad_theta_hat L(theta_hat) * (theta - theta_i), 0, 1),

``eta`` = ``fedala-eta``. At a client's first ALA the weights train epoch after epoch
until the standard deviation of the last ``10`` epochs' losses (each epoch's last
batch) falls below ``fedala-threshold``; afterwards one epoch per round. Then the client
trains ``theta_hat`` for the round's ``epochs`` as FedAvg does, keeps it as its
``theta_i``, replies it, and is tested with it.

What differs from the paper, and why:
- A client's first participation has no local model yet: it takes the global model
  and skips ALA (the authors' code skips ALA in the first round, where the local and
  global models are equal), and its weights start training at its second.
- The convergence loop stops after at most ``fedala-max-epochs`` epochs (the authors'
  loop has no bound), so that no client stalls a round.
- ALA runs member by member (its epoch count is each client's own); the local epochs
  after it run for the whole cohort at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.families import personalized
from fedpers.protocol import HEAD, MODEL_PARTS
from fedpers.settings import at_least, finite, setting, step_size, within

if TYPE_CHECKING:
    import torch

    from fedpers.cohort import Arrays, Cohort, Reply

STATE_WEIGHTS = "fedpers.fedala.weights"  # W, by the head's parameter names
PREVIOUS_LOSSES = 10  # the paper's window of epoch losses for the convergence test


@dataclass(frozen=True)
class FedAlaSettings:
    """The adaptive local aggregation of FedALA (the row `fedala`)."""

    HEADING: ClassVar[str] = "fedala"

    # Chosen on validation (docs/reproducing.md): FedRep's Table 1 setting, seeds 0-2,
    # over 0.1 / 1 (the paper's) / 10 -> 86.27 / 85.86 / 85.79 %.
    fedala_eta: float = setting(
        0.1, "FedALA: the step eta of the element-wise aggregation weights W (the paper's 1.0)"
    )
    fedala_sample: float = setting(
        80.0,
        "FedALA: the percentage s of a client's training samples its weights W learn on "
        "(the paper's 80)",
    )
    fedala_threshold: float = setting(
        0.1,
        "FedALA: the first ALA trains W until the std of the last 10 epoch losses is below "
        "this (the authors' 0.1)",
    )
    fedala_max_epochs: int = setting(
        100, "FedALA: the most epochs of the first ALA's weight training (a bound on time)"
    )

    def check(self) -> None:
        step_size("fedala-eta", self.fedala_eta)
        within("fedala-sample", self.fedala_sample, "(0, 100]")
        finite("fedala-threshold", self.fedala_threshold, 0.0, strict=True)
        at_least("fedala-max-epochs", self.fedala_max_epochs, 1)


def sample_slice(count: int, percent: float, generator: torch.Generator) -> slice:
    """The contiguous ``percent``% of ``count`` samples at a random start."""
    import torch

    size = max(1, int(percent / 100 * count)) if count else 0
    start = int(torch.randint(0, count - size + 1, (1,), generator=generator)) if count else 0
    return slice(start, start + size)


def ala(
    model: torch.nn.Module,
    local: dict[str, torch.Tensor],
    global_: dict[str, torch.Tensor],
    weights: dict[str, torch.Tensor] | None,
    x: torch.Tensor,
    y: torch.Tensor,
    settings: FedAlaSettings,
    batch_size: int,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """One client's ALA: its initialized model (body global, head ``theta_i + (theta -
    theta_i) * W``), its new ``W`` and the epochs it trained ``W`` (``weights`` None:
    its first ALA, W all ones, trained to convergence)."""
    import torch
    import torch.nn.functional as F

    from fedpers.training import call_with, training_mode

    head = [n for n in local if n.split(".", 1)[0] == HEAD]
    w = {n: torch.ones_like(local[n]) for n in head} if weights is None else dict(weights)
    fixed = {n: v for n, v in global_.items() if n not in head}
    gap = {n: global_[n] - local[n] for n in head}
    losses: list[float] = []
    epochs = 0
    while len(y):
        for start in range(0, len(y), batch_size):
            mixed = {n: (local[n] + gap[n] * w[n]).requires_grad_(True) for n in head}
            with training_mode(model, False):
                out = call_with(model, {**fixed, **mixed}, x[start : start + batch_size])
            loss = F.cross_entropy(out, y[start : start + batch_size])
            grads = torch.autograd.grad(loss, [mixed[n] for n in head])
            with torch.no_grad():
                w = {
                    n: (w[n] - settings.fedala_eta * g * gap[n]).clamp(0.0, 1.0)
                    for n, g in zip(head, grads, strict=True)
                }
        losses.append(float(loss.detach()))  # each epoch's last batch, as the authors record
        epochs += 1
        if weights is not None or epochs >= settings.fedala_max_epochs:
            break
        last = losses[-PREVIOUS_LOSSES:]
        if len(losses) > PREVIOUS_LOSSES and float(np.std(last)) < settings.fedala_threshold:
            break
    initialized = {**fixed, **{n: (local[n] + gap[n] * w[n]).detach() for n in head}}
    return initialized, w, epochs


def fit(cohort: Cohort) -> list[Reply]:
    """Each member's ALA from its kept model and the global one, then FedAvg's epochs
    of the whole model; replies it, keeps it and ``W``."""
    import torch

    from fedpers import update

    settings = cohort.run.group(FedAlaSettings)
    local = update.Personalized(cohort)
    received = local.received()
    model = local.model
    generators = local.generators("ala", local.round)
    as_tensor = _tensors(local)
    starts: list[Arrays] = []
    for member, theta, data, generator in zip(
        local.members, received, local.data, generators, strict=True
    ):
        kept = update.kept(member)
        if not kept:  # first participation: the global model, no ALA
            starts.append(theta)
            continue
        own = update.kept(member, STATE_WEIGHTS)
        chosen = sample_slice(len(data.y_train), settings.fedala_sample, generator)
        initialized, weights, _ = ala(
            model,
            as_tensor(kept),
            as_tensor(theta),
            as_tensor(own) if own else None,
            as_tensor({"x": data.x_train[chosen]})["x"],
            torch.as_tensor(data.y_train[chosen], dtype=torch.int64, device=local.device),
            settings,
            local.run.batch_size,
        )
        member.state[STATE_WEIGHTS] = update.to_record(
            {n: v.detach().cpu().numpy().astype(theta[n].dtype) for n, v in weights.items()}
        )
        starts.append(
            {n: v.detach().cpu().numpy().astype(theta[n].dtype) for n, v in initialized.items()}
        )
    stack = local.stack(local.model, starts)
    stats = local.train_phases(stack)
    local.keep(stack)
    return update.fit_replies(local.shared_arrays(stack), stats)


def _tensors(local: Any) -> Any:
    """Arrays as tensors in the cohort's precision (float64 where it computes in it)."""
    import torch

    def convert(arrays: Arrays) -> dict[str, torch.Tensor]:
        return {
            n: torch.as_tensor(np.array(v), dtype=local.dtype or torch.float32).to(local.device)
            for n, v in arrays.items()
        }

    return convert


evaluate = personalized.evaluate_kept  # tested with its theta_i


ROWS = (
    AlgorithmSpec(
        name="fedala",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        settings=(FedAlaSettings,),
        personal_state=True,  # theta_i and W
        paper="Zhang et al., AAAI 2023",
    ),
)
