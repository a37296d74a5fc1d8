"""pFedMe (T Dinh, Tran and Nguyen, "Personalized Federated Learning with Moreau
Envelopes", NeurIPS 2020, Algorithm 1).

Each client's personal model ``theta_i`` approximately minimizes its loss plus
``(lambda / 2) ||theta - w_i||^2`` around a local model ``w_i``, the Moreau envelope's
inner problem. A sampled client starts ``w_i`` and ``theta`` at the global ``w`` it
received and, for each mini-batch ``D`` of its local update (the run's ``epochs``
passes in the run's random order: the paper's ``R`` local rounds),

    K times:  theta <- theta - personal_lr (grad f(theta; D) + lambda (theta - w_i))
    then:     w_i   <- w_i - lr lambda (w_i - theta)

(``theta`` carries over from one mini-batch to the next, as in the authors' code), and
replies ``w_i``; the server steps ``w <- (1 - beta) w + beta mean_S(w_i)``
(``strategies/pfedme.py``). The steps are the paper's plain ones: the run's momentum
and weight decay do not apply. The last ``theta`` is the client's personal model, kept
in ``context.state`` and tested; a client not yet sampled holds the initial model.

Written for a cohort: every member's steps are one computation (each member's gradient
is that of the sum of the members' losses, in which its ``theta`` enters only its own),
its batches and dropout masks drawn from its own generator; a member whose batches have
ended is not moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from fedpers import protocol, records
from fedpers.algorithms import AlgorithmSpec, Family
from fedpers.families import personalized
from fedpers.protocol import MODEL_PARTS
from fedpers.settings import ConfigError, at_least, positive, setting, step_size

if TYPE_CHECKING:
    import torch

    from fedpers.cohort import Cohort, Reply
    from fedpers.config import RunConfig
    from fedpers.training import Stack
    from fedpers.update import Personalized


@dataclass(frozen=True)
class PFedMeSettings:
    """The Moreau envelope and the server step of pFedMe (the row `pfedme`)."""

    HEADING: ClassVar[str] = "pfedme"

    pfedme_lambda: float = setting(
        15.0,
        "pFedMe: the weight lambda of (lambda/2)||theta - w||^2 tying the personal model "
        "theta to the local model w (the paper's 15)",
    )
    pfedme_k: int = setting(
        5, "pFedMe: gradient steps K on the inner problem per mini-batch (the paper's 5)"
    )
    pfedme_personal_lr: float = setting(
        0.01, "pFedMe: the step size of those K steps on theta (the round's lr moves w)"
    )
    pfedme_beta: float = setting(
        3.0,
        "pFedMe: the server's step w <- (1 - beta) w + beta mean(w_i) (1: the mean, the "
        "paper's 1 and 2; 3 chosen on validation for FedRep's Table 1)",
    )

    def check(self) -> None:
        positive("pfedme-lambda", self.pfedme_lambda)
        at_least("pfedme-k", self.pfedme_k, 1)
        step_size("pfedme-personal-lr", self.pfedme_personal_lr)
        step_size("pfedme-beta", self.pfedme_beta)


def check_pull(run: RunConfig) -> None:
    """Refuse a local step of ``w_i`` past ``theta`` (``lr lambda > 1``)."""
    pull = run.lr * run.group(PFedMeSettings).pfedme_lambda
    if pull > 1.0:
        raise ConfigError(
            f"run-config keys lr = {run.lr:g} and pfedme-lambda = "
            f"{run.group(PFedMeSettings).pfedme_lambda:g} make pFedMe's local step move w "
            f"{pull:.3g} times its distance to theta (past it): lower one of them so "
            "that lr lambda <= 1."
        )


def fit(cohort: Cohort) -> list[Reply]:
    """Algorithm 1's local rounds of every member from the ``w`` it received; replies
    ``w_i``, keeps ``theta``."""
    from fedpers import update

    local = update.Personalized(cohort)
    stack = local.models()  # w_i, from the received w
    theta = stack.copy()
    totals = _rounds(local, stack, theta)
    local.keep(theta)
    replies = []
    for arrays, data, (loss_sum, seen) in zip(
        local.shared_arrays(stack), local.data, totals, strict=True
    ):
        metrics = {protocol.NUM_EXAMPLES: float(len(data.y_train))}
        if seen:
            metrics[protocol.LOSS] = loss_sum / seen  # of theta, on the last inner step
        replies.append((arrays, metrics))
    return replies


def _rounds(local: Personalized, stack: Stack, theta: Stack) -> list[tuple[float, int]]:
    """Every member's local rounds, in place in ``stack`` (``w_i``) and ``theta``; per
    member, the sum of its batches' last inner losses times their sizes, and its
    samples seen."""
    import torch

    from fedpers import training, update

    settings = local.run.group(PFedMeSettings)
    lam, personal_lr, lr = settings.pfedme_lambda, settings.pfedme_personal_lr, local.lr
    data = local.train_data()
    generators = local.generators("train", local.round)
    batch_size = local.run.batch_size
    epochs = records.config_int(local.config, protocol.EPOCHS)
    seeds = [
        training.dropout_seed(g) if n else None
        for g, n in zip(generators, data.counts, strict=True)
    ]
    plans = [
        training.client_steps(n, epochs, batch_size, g, augment=local.augment)
        for n, g in zip(data.counts, generators, strict=True)
    ]
    masks = training.DropoutMasks(theta, seeds, data.x[0]) if theta.has_dropout else None
    names = theta.names(MODEL_PARTS)
    thetas, ws = [theta.tensors[n] for n in names], [stack.tensors[n] for n in names]
    totals = [(0.0, 0)] * theta.size
    for t in thetas:
        t.requires_grad_(True)
    try:
        with training.training_mode(theta.template, True):
            for s in range(max((len(p) for p in plans), default=0)):
                batch = training.assemble(
                    data, [p[s] if s < len(p) else None for p in plans], augment=local.augment
                )
                active = None if batch.full or theta.size == 1 else batch.active
                for _ in range(settings.pfedme_k):
                    if masks is not None:
                        batch.masks = masks.draw(batch.sizes, batch.x.shape[1], batch.x)
                    loss = update.mean_losses(theta, theta.tensors, batch)
                    grads = torch.autograd.grad(loss.sum(), thetas)
                    with torch.no_grad():
                        for t, g, wi in zip(thetas, grads, ws, strict=True):
                            _move(t, personal_lr * (g + lam * (t - wi)), active)
                with torch.no_grad():
                    for wi, t in zip(ws, thetas, strict=True):
                        _move(wi, lr * lam * (wi - t), active)
                values = loss.detach()
                totals = [
                    (total + float(values[k]) * size, seen + size) if size else (total, seen)
                    for k, ((total, seen), size) in enumerate(zip(totals, batch.sizes, strict=True))
                ]
    finally:
        for t in thetas:
            t.requires_grad_(False)
    return totals


def _move(tensor: torch.Tensor, step: torch.Tensor, active: torch.Tensor | None) -> None:
    """``tensor -= step`` for the members in ``active`` (None: all)."""
    import torch

    if active is None:
        tensor.sub_(step)
        return
    where = active.view(-1, *([1] * (tensor.ndim - 1)))
    tensor.copy_(torch.where(where, tensor - step, tensor))


evaluate = personalized.evaluate_kept  # tested with its theta


ROWS = (
    AlgorithmSpec(
        name="pfedme",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        strategy="fedpers.strategies.pfedme:PFedMe",
        settings=(PFedMeSettings,),
        checks=(
            personalized.refuses_dp("whose server steps by pfedme-beta from the last global model"),
            check_pull,
        ),
        personal_state=True,  # theta
        paper="T Dinh et al., NeurIPS 2020",
    ),
)
