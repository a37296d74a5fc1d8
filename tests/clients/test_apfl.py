"""APFL against its equations (Deng et al., 2020, Algorithm 1 with the adaptive alpha of
Section 3.2): two rounds on a tiny problem through the in-process grid (the real
ClientApp and the FedAvg server), half the clients a round, against the steps of ``w``,
``v`` and ``alpha`` written here in plain torch; then the evaluation of the mixture."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, RecordDict

from fedpers import protocol
from fedpers.algorithms.apfl import ALPHA, STATE_ALPHA, APFLSettings
from fedpers.config import RunConfig, load_run_config
from fedpers.data.client import client_data
from fedpers.settings import ConfigError
from tests.clients.test_fedprox import _forward, _largest_gap, tiny_rounds, training_tensors
from tests.helpers import client_of, run_config

ALPHA_0 = 0.3

Params = dict[str, torch.Tensor]


def _grad(params: Params, x: torch.Tensor, y: torch.Tensor) -> Params:
    p = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    grads = torch.autograd.grad(F.cross_entropy(_forward(p, x), y), list(p.values()))
    return dict(zip(p, grads, strict=True))


def _apfl_oracle(
    config: RunConfig,
    start: dict[str, np.ndarray],
    sampled: list[list[int]],
    *,
    adaptive: bool = True,
    chain: bool = True,
) -> tuple[dict[str, np.ndarray], dict[int, tuple[Params, float]]]:
    """Per full-batch step, from the values before it: w <- w - lr grad f(w);
    g = grad f(v_bar), v_bar = alpha v + (1 - alpha) w; v <- v - lr alpha g;
    alpha <- clip(alpha - lr <v - w, g>, 0, 1). Server: w averaged by training samples.
    ``adaptive=False`` holds alpha, ``chain=False`` leaves the factor alpha out of v's
    step (so that the test can show it fails without either)."""
    w = {k: torch.tensor(v, dtype=torch.float64) for k, v in start.items()}
    personal = {
        p: ({k: v.clone() for k, v in w.items()}, ALPHA_0) for p in range(config.num_clients)
    }
    for clients in sampled:
        total = {k: torch.zeros_like(v) for k, v in w.items()}
        samples = 0
        for partition in clients:
            x, y = training_tensors(config, partition)
            wk = dict(w)
            v, alpha = personal[partition]
            for _ in range(config.epochs):
                mixed = {k: alpha * v[k] + (1 - alpha) * wk[k] for k in wk}
                g_w, g = _grad(wk, x, y), _grad(mixed, x, y)
                step_alpha = alpha - config.lr * sum(
                    float(((v[k] - wk[k]) * g[k]).sum()) for k in wk
                )
                factor = alpha if chain else 1.0
                v = {k: v[k] - config.lr * factor * g[k] for k in v}
                wk = {k: wk[k] - config.lr * g_w[k] for k in wk}
                if adaptive:
                    alpha = min(1.0, max(0.0, step_alpha))
            personal[partition] = (v, alpha)
            for k in total:
                total[k] += len(y) * wk[k]
            samples += len(y)
        w = {k: v / samples for k, v in total.items()}
    return {k: v.numpy() for k, v in w.items()}, personal


def test_two_rounds_of_apfl_are_algorithm_1_with_adaptive_alpha() -> None:
    config, start, result, sampled, grid = tiny_rounds(
        2, algorithm="apfl", fraction_train=0.5, apfl_alpha=ALPHA_0
    )
    oracle, personal = _apfl_oracle(config, start, sampled)
    assert _largest_gap(result, oracle) < 1e-6
    # The v and alpha kept on the node of a client sampled in both rounds (its second
    # update starts from the state its first one stored)
    both = sorted(set(sampled[0]) & set(sampled[1]))
    assert both
    partition = both[0]
    state = grid.contexts[grid.node_of(partition)].state
    kept_v = {k: v.numpy() for k, v in state[protocol.STATE_PERSONAL].items()}
    v, alpha = personal[partition]
    assert _largest_gap(kept_v, {k: t.numpy() for k, t in v.items()}) < 1e-6
    kept_alpha = float(state[STATE_ALPHA][ALPHA].numpy()[0])
    assert abs(kept_alpha - alpha) < 1e-6
    assert abs(alpha - ALPHA_0) > 1e-4  # alpha moved
    # The test can fail: with alpha held, or v stepped by grad f(v_bar) without the
    # chain rule's alpha, the oracle is far from what APFL computed.
    for wrong in ({"adaptive": False}, {"chain": False}):
        _, other = _apfl_oracle(config, start, sampled, **wrong)
        other_v, other_alpha = other[partition]
        gap = _largest_gap(kept_v, {k: t.numpy() for k, t in other_v.items()})
        assert gap > 1e-4 or abs(other_alpha - kept_alpha) > 1e-4, wrong


def test_a_fixed_alpha_stays_and_the_client_is_tested_with_the_mixture() -> None:
    run = RunConfig.from_mapping(
        run_config(
            algorithm="apfl",
            dataset="digits",
            num_clients=10,
            apfl_adaptive=False,
            apfl_alpha=0.75,  # a mixture of both models (the default, 1, tests v alone)
        )
    )
    state = RecordDict()
    client = client_of(run, 2, state)
    assert client.run.spec.update == "fedpers.algorithms.apfl"
    w = client.initial_arrays()
    train = ConfigRecord({protocol.ROUND: 1, protocol.EPOCHS: 2, protocol.LR: 0.05})
    reply, _ = client.fit(dict(w), train)
    assert float(state[STATE_ALPHA][ALPHA].numpy()[0]) == run.group(APFLSettings).apfl_alpha
    # The mixture alpha v + (1 - alpha) w, built here, tests as the client does
    again = client_of(run, 2, state)
    a = float(state[STATE_ALPHA][ALPHA].numpy()[0])
    v = {k: t.numpy() for k, t in state[protocol.STATE_PERSONAL].items()}
    mixed = {k: (a * v[k] + (1 - a) * reply[k]).astype(np.float32) for k in reply}
    data = client_data(run, 2)
    x, y = torch.tensor(data.x_test), torch.tensor(data.y_test, dtype=torch.int64)

    def loss(arrays: dict[str, np.ndarray]) -> float:
        logits = _forward({k: torch.tensor(m) for k, m in arrays.items()}, x)
        return float(F.cross_entropy(logits, y))

    metrics = again.evaluate(dict(reply), ConfigRecord({protocol.ROUND: 1}))
    assert metrics[protocol.LOSS] == pytest.approx(loss(mixed), rel=1e-5)
    # and neither w alone nor v alone
    for only in (reply, v):
        assert abs(loss(only) - metrics[protocol.LOSS]) > 1e-3


def test_apfl_keeps_state_and_refuses_an_alpha_outside_the_unit_interval() -> None:
    assert load_run_config({"algorithm": "apfl"}).spec.keeps_state  # v and alpha
    with pytest.raises(ConfigError, match=r"'apfl-alpha' = 1\.5 must be in \[0, 1\]"):
        load_run_config({"algorithm": "apfl", "apfl-alpha": 1.5})
