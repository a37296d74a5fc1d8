"""pFedMe against its equations (T Dinh et al., NeurIPS 2020, Algorithm 1): two rounds
of a tiny problem through the in-process grid (the real ClientApp and pFedMe's server),
half the clients a round, against the inner steps on theta, the local steps on w_i and
the server's beta step written here in plain torch, one full batch per local round; and
the update of a cohort of every client at once (training sets of different sizes),
each member against its own steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, RecordDict

from fedpers import protocol
from fedpers.cohort import Cohort, Member
from fedpers.config import RunConfig, load_run_config
from fedpers.data.client import client_data
from fedpers.settings import ConfigError
from tests.clients.test_fedprox import (
    TINY,
    _forward,
    _largest_gap,
    tiny_rounds,
    training_tensors,
)
from tests.helpers import client_of, run_config

LAMBDA, K, PERSONAL_LR, BETA = 5.0, 3, 0.05, 0.7

Params = dict[str, torch.Tensor]


def _local_rounds(config: RunConfig, w: Params, i: int, *, k: int = K) -> tuple[Params, Params]:
    """Client ``i``'s ``w_i`` and ``theta`` after its local rounds from the global ``w``:
    per local round K steps theta <- theta - plr (grad f(theta) + lambda (theta - w_i)),
    then w_i <- w_i - lr lambda (w_i - theta)."""
    x, y = training_tensors(config, i)
    theta, w_i = dict(w), dict(w)
    for _ in range(config.epochs):
        for _ in range(k):
            p = {key: v.clone().requires_grad_(True) for key, v in theta.items()}
            grads = torch.autograd.grad(F.cross_entropy(_forward(p, x), y), list(p.values()))
            theta = {
                key: v - PERSONAL_LR * (g + LAMBDA * (v - w_i[key]))
                for (key, v), g in zip(theta.items(), grads, strict=True)
            }
        w_i = {key: v - config.lr * LAMBDA * (v - theta[key]) for key, v in w_i.items()}
    return w_i, theta


def _pfedme_oracle(
    config: RunConfig,
    start: dict[str, np.ndarray],
    sampled: list[list[int]],
    *,
    k: int = K,
    beta: float = BETA,
) -> tuple[dict[str, np.ndarray], dict[int, Params]]:
    """Per client from the global w: theta = w_i = w; per local round K steps
    theta <- theta - plr (grad f(theta) + lambda (theta - w_i)), then
    w_i <- w_i - lr lambda (w_i - theta). Server: w + beta (mean w_i - w), unweighted."""
    w = {key: torch.tensor(v, dtype=torch.float64) for key, v in start.items()}
    personal: dict[int, Params] = {}
    for clients in sampled:
        replies = []
        for i in clients:
            w_i, personal[i] = _local_rounds(config, w, i, k=k)
            replies.append(w_i)
        mean = {key: sum(r[key] for r in replies) / len(replies) for key in w}
        w = {key: v + beta * (mean[key] - v) for key, v in w.items()}
    return {key: v.numpy() for key, v in w.items()}, personal


def test_two_rounds_of_pfedme_are_algorithm_1() -> None:
    config, start, result, sampled, grid = tiny_rounds(
        2,
        algorithm="pfedme",
        fraction_train=0.5,
        pfedme_lambda=LAMBDA,
        pfedme_k=K,
        pfedme_personal_lr=PERSONAL_LR,
        pfedme_beta=BETA,
    )
    oracle, personal = _pfedme_oracle(config, start, sampled)
    assert _largest_gap(result, oracle) < 1e-6
    # The personal model theta of the last round's clients is kept on their nodes
    for partition in sampled[-1]:
        state = grid.contexts[grid.node_of(partition)].state
        kept = {key: v.numpy() for key, v in state[protocol.STATE_PERSONAL].items()}
        expected = {key: t.numpy() for key, t in personal[partition].items()}
        assert _largest_gap(kept, expected) < 1e-6
    # The test can fail: with the mean itself (beta = 1), or one inner step (K = 1)
    for wrong in ({"beta": 1.0}, {"k": 1}):
        other, _ = _pfedme_oracle(config, start, sampled, **wrong)
        assert _largest_gap(result, other) > 1e-4, wrong


def test_a_cohort_takes_each_members_own_local_rounds_and_keeps_its_theta() -> None:
    values = run_config(
        **TINY,
        algorithm="pfedme",
        pfedme_lambda=LAMBDA,
        pfedme_k=K,
        pfedme_personal_lr=PERSONAL_LR,
    )
    run = RunConfig.from_mapping(values)
    w = client_of(run, 0).initial_arrays()
    start = {key: torch.tensor(v, dtype=torch.float64) for key, v in w.items()}
    config = ConfigRecord({protocol.ROUND: 1, protocol.LR: run.lr, protocol.EPOCHS: run.epochs})
    members = [Member(p, RecordDict(), dict(w)) for p in range(run.num_clients)]
    fit = run.spec.update_function("fit", run.family)
    evaluate = run.spec.update_function("evaluate", run.family)
    assert fit is not None
    assert evaluate is not None
    replies = fit(Cohort(run, config, members))
    tested = evaluate(Cohort(run, config, members))
    oracles = [_local_rounds(run, start, p) for p in range(run.num_clients)]
    assert len({len(client_data(run, p).y_train) for p in range(run.num_clients)}) > 1
    for member, (arrays, _), metrics, (w_i, theta) in zip(
        members, replies, tested, oracles, strict=True
    ):
        assert _largest_gap(arrays, {key: v.numpy() for key, v in w_i.items()}) < 1e-6
        kept = {key: v.numpy() for key, v in member.state[protocol.STATE_PERSONAL].items()}
        assert _largest_gap(kept, {key: v.numpy() for key, v in theta.items()}) < 1e-6
        # the member is tested with its theta
        data = client_data(run, member.partition)
        x_test = torch.tensor(data.x_test, dtype=torch.float64)
        loss = F.cross_entropy(_forward(theta, x_test), torch.tensor(data.y_test))
        assert metrics[protocol.LOSS] == pytest.approx(float(loss), rel=1e-5)
    # The test can fail: a member's result is not another's
    assert _largest_gap(replies[0][0], {key: v.numpy() for key, v in oracles[1][0].items()}) > 1e-4


def test_pfedme_keeps_state_and_refuses_a_step_past_theta_and_dp() -> None:
    assert load_run_config({"algorithm": "pfedme"}).spec.keeps_state  # theta
    with pytest.raises(ConfigError, match=r"so that lr lambda <= 1"):
        load_run_config({"algorithm": "pfedme", "lr": 0.1, "pfedme-lambda": 15.0})
    with pytest.raises(ConfigError, match="steps by pfedme-beta"):
        load_run_config({"algorithm": "pfedme", "dp": "central"})
