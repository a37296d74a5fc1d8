"""CoMFed against its objective (Badi et al. 2026, eq. 7, with the concurrent steps
(8)-(9)): between two Sheaf-FRL agents of different latent dimensions, an agent's
full-batch step is the gradient step of CE + lambda mean_m ||P v_bar_m - c_m||^2 on its
model and on P (torch.func in float64, dropout off), with c_m its neighbour's projected
prototype; its message is P times its class means; a receiver decodes through
pinv(P_j); relayed prototypes are screened."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, RecordDict

from fedpers import protocol, records
from fedpers.algorithms import comfed
from fedpers.config import RunConfig
from fedpers.data.client import client_data
from fedpers.families import sheaf as sheaf_family
from fedpers.families.sheaf import PROTOTYPE_COUNTS, PROTOTYPES, Whitening
from tests.clients.sheaf_agents import agent_model, answer, local_of, without_dropout
from tests.helpers import Node, client_of, run_config

AGENTS = {
    "dataset": "digits",
    "algorithm": "comfed",
    "num_clients": 2,
    "sheaf_latent_dims": "8,16",
    "sheaf_hidden": "64,160",
    "fraction_train": 1.0,
    "batch_size": 100_000,
    "momentum": 0.0,
    "weight_decay": 0.0,
    "sheaf_clip": 0.0,
    "epochs": 1,
    "lr": 0.1,
    "comfed_lambda": 2.0,
    "comfed_dim": 4,
}


def _oracle(
    model: torch.nn.Module,
    projection: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    targets: np.ndarray,
    known: np.ndarray,
    *,
    lam: float,
    lr: float,
) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    params = {k: v.detach().double().requires_grad_(True) for k, v in model.named_parameters()}
    p = torch.tensor(projection, dtype=torch.float64, requires_grad=True)
    xs, ys = torch.tensor(x, dtype=torch.float64), torch.tensor(y)
    body = {k.removeprefix("body."): v for k, v in params.items() if k.startswith("body.")}
    head = {k.removeprefix("head."): v for k, v in params.items() if k.startswith("head.")}
    z = torch.func.functional_call(model.body.double(), body, (xs,))
    logits = torch.func.functional_call(model.head.double(), head, (z,))
    terms = [
        ((p @ z[ys == m].mean(dim=0) - torch.tensor(targets[m], dtype=torch.float64)) ** 2).sum()
        for m in sorted(set(y.tolist()))
        if known[m]
    ]
    loss = F.cross_entropy(logits, ys) + lam * torch.stack(terms).mean()
    grads = torch.autograd.grad(loss, [*params.values(), p])
    new = {k: (v - lr * g).detach() for (k, v), g in zip(params.items(), grads, strict=False)}
    return new, (p - lr * grads[-1]).detach().numpy()


def _projection(node: Node) -> np.ndarray:
    """The node's ``P_i``: as it kept it, or as it draws it before."""
    stored = node.state.get(comfed.STATE_PROJECTION)
    if stored is not None:
        return records.values(stored[comfed.STATE_PROJECTION])  # type: ignore[index]
    return comfed.projection(local_of(node), 0)


def test_an_agents_step_is_the_consensus_regularized_gradient_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    without_dropout(monkeypatch)  # the agent's and the oracle's
    run = RunConfig.from_mapping(run_config(**AGENTS))
    client = client_of(run, 0, RecordDict())
    start, projection = agent_model(run, 0), _projection(client).copy()
    data = client_data(run, 0)
    generator = np.random.default_rng(0)
    theirs = generator.normal(size=(run.num_classes, 4)).astype(np.float32)
    counts = np.ones(run.num_classes)
    counts[int(data.y_train[0])] = 0.0  # a class the agent holds and its neighbour does not
    arrays = {
        sheaf_family.from_agent(PROTOTYPES, 1): theirs,
        sheaf_family.from_agent(PROTOTYPE_COUNTS, 1): counts,
    }
    config = ConfigRecord({protocol.ROUND: 1, protocol.EPOCHS: 1, protocol.LR: run.lr})
    client.fit(arrays, config)
    trained = agent_model(run, 0, client.state)
    after = {k: v.detach().double() for k, v in trained.named_parameters()}
    expected, expected_p = _oracle(
        copy.deepcopy(start),
        projection,
        data.x_train,
        data.y_train,
        theirs,
        counts > 0,
        lam=2.0,
        lr=run.lr,
    )
    assert max(float((after[k] - expected[k]).abs().max()) for k in expected) < 1e-6
    assert np.max(np.abs(_projection(client) - expected_p)) < 1e-6
    # The test can fail: the class its neighbour does not hold pulled toward zeros
    wrong, wrong_p = _oracle(
        copy.deepcopy(start),
        projection,
        data.x_train,
        data.y_train,
        np.where((counts > 0)[:, None], theirs, 0.0),
        np.ones(run.num_classes, dtype=bool),
        lam=2.0,
        lr=run.lr,
    )
    assert np.max(np.abs(_projection(client) - wrong_p)) > 1e-5
    assert max(float((after[k] - wrong[k]).abs().max()) for k in wrong) > 1e-5


def test_its_message_is_its_class_means_through_its_projection() -> None:
    run = RunConfig.from_mapping(run_config(**AGENTS))
    client = client_of(run, 1, RecordDict())
    sent = answer(client, "prototypes_message", {}, ConfigRecord({protocol.ROUND: 1}))
    data = client_data(run, 1)
    model = agent_model(run, 1, client.state).eval()
    with torch.no_grad():
        z = model.body(torch.tensor(data.x_train)).double().numpy()
    p = _projection(client).astype(np.float64)
    for m in range(run.num_classes):
        held = data.y_train == m
        assert sent[PROTOTYPE_COUNTS][m] == held.sum()
        expected = p @ z[held].mean(axis=0) if held.any() else np.zeros(4)
        assert np.max(np.abs(sent[PROTOTYPES][m] - expected)) < 1e-5


def test_a_receiver_decodes_through_the_pseudo_inverse_of_its_projection() -> None:
    run = RunConfig.from_mapping(run_config(**AGENTS))
    receiver = client_of(run, 1, RecordDict())
    generator = np.random.default_rng(2)
    sent = generator.normal(size=(50, 4))
    labels = generator.integers(0, 10, size=50)
    config = ConfigRecord(
        {sheaf_family.WHITENING: Whitening.PROJECTION.value, sheaf_family.COMMUNICATION: 1}
    )
    arrays = {
        sheaf_family.from_agent(sheaf_family.PILOTS, 0): sent[:5],
        sheaf_family.from_agent(sheaf_family.LATENTS, 0): sent,
        sheaf_family.from_agent(sheaf_family.LABELS, 0): labels,
    }
    metrics = receiver.evaluate(arrays, config)
    p = _projection(receiver).astype(np.float64)
    z = sent @ np.linalg.pinv(p).T
    head = agent_model(run, 1, receiver.state).head
    weights = {k: v.detach().double().numpy() for k, v in head.named_parameters()}
    hidden = np.maximum(z @ weights["0.weight"].T + weights["0.bias"], 0)
    predicted = (hidden @ weights["2.weight"].T + weights["2.bias"]).argmax(axis=1)
    assert metrics[sheaf_family.edge_metric(0)] == pytest.approx(np.mean(predicted == labels))


@pytest.mark.parametrize("kind", ["pilots-scale", "pilots-nan"])
def test_nan_prototypes_are_not_relayed_and_scaled_ones_are(kind: str) -> None:
    from tests.strategies.test_robustness import FAULTY, _run

    left = {"num_clients", "fraction_train", "sheaf_latent_dims", "sheaf_hidden"}
    family = {k: v for k, v in {**AGENTS, "sheaf_clip": 1.0}.items() if k not in left}
    _strategy, (log, _) = _run(family, f"{kind}:{FAULTY}@2", rounds=2)
    assert log[0].rejections == []
    named = [r for r in log[1].rejections if r.startswith(f"partition {FAULTY}: ")]
    if kind == "pilots-nan":
        assert named, log[1].rejections
    else:  # 1e6 x the prototypes: finite, relayed (the receiver's steps are clipped)
        assert named == []
