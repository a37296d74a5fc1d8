"""FedBN against its algorithm (Li et al., ICLR 2021, Algorithm 1): three rounds on a
tiny problem through the in-process grid (the real ClientApp and the FedAvg server),
half the clients a round, against each client's full-batch gradient steps through the
digits MLP with BatchNorm written out here in plain torch (batch statistics in
training, running statistics updated with momentum 0.1 and the unbiased variance), the
server's sample-weighted mean of every tensor outside the BatchNorm layers, and each
client's BatchNorm layers kept from one of its rounds to the next."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedpers import protocol
from fedpers.algorithms.fedbn import local_names
from fedpers.config import RunConfig
from fedpers.data.client import ClientData, client_data, feature_shifted
from fedpers.models import build_model
from fedpers.settings import ConfigError
from fedpers.simulations.fedrep_images import methods as fedrep_images_methods
from fedpers.training import SGDSettings, Stack, train
from tests.clients.test_fedprox import _largest_gap, tiny_rounds, training_tensors
from tests.fedpers.test_data import write_cifar

ROUNDS = 3
EPS = 1e-5  # nn.BatchNorm1d's
MOMENTUM = 0.1  # nn.BatchNorm1d's

Params = dict[str, torch.Tensor]


def _normalized(w: Params, h: torch.Tensor, name: str) -> tuple[torch.Tensor, Params]:
    """BatchNorm ``name`` in training mode on ``h``: its output and its new running
    statistics and step count."""
    mean, var = h.mean(dim=0), h.var(dim=0, unbiased=False)
    out = (h - mean) / torch.sqrt(var + EPS) * w[f"{name}.weight"] + w[f"{name}.bias"]
    with torch.no_grad():
        stats = {
            f"{name}.running_mean": (1 - MOMENTUM) * w[f"{name}.running_mean"] + MOMENTUM * mean,
            f"{name}.running_var": (1 - MOMENTUM) * w[f"{name}.running_var"]
            + MOMENTUM * h.var(dim=0, unbiased=True),
            f"{name}.num_batches_tracked": w[f"{name}.num_batches_tracked"] + 1,
        }
    return out, stats


def _forward(w: Params, x: torch.Tensor) -> tuple[torch.Tensor, Params]:
    """The digits MLP with BatchNorm, 64-128(BN)-64(BN) | 64-10 with ReLU, in training
    mode: logits and the BatchNorm layers' new statistics."""
    h, first = _normalized(w, x @ w["body.0.weight"].T + w["body.0.bias"], "body.1")
    h, second = _normalized(w, torch.relu(h) @ w["body.3.weight"].T + w["body.3.bias"], "body.4")
    return torch.relu(h) @ w["head.weight"].T + w["head.bias"], {**first, **second}


def _oracle(
    config: RunConfig,
    start: dict[str, np.ndarray],
    sampled: list[list[int]],
    *,
    keep: bool = True,
    average_all: bool = False,
) -> tuple[dict[str, np.ndarray], dict[int, Params]]:
    """FedBN's rounds: each sampled client trains its whole model (its kept BatchNorm
    layers, else the seeded ones; the global rest) for ``epochs`` full-batch steps; the
    server averages the rest weighted by samples. ``keep=False`` starts every round from
    the seeded BatchNorm layers, ``average_all=True`` averages them too (FedAvg): the
    controls. Returns the global arrays and each client's BatchNorm layers."""
    # BatchNorm layers start at scale 1, shift 0, mean 0, variance 1 whatever the seed
    seeded = build_model(config.model_name, config.num_classes, 0, config.input_shape)
    bn = local_names(seeded)
    seeded_bn = {k: v.detach().double() for k, v in seeded.state_dict().items() if k in bn}
    theta: Params = {k: torch.tensor(v, dtype=torch.float64) for k, v in start.items()}
    kept: dict[int, Params] = {}
    for clients in sampled:
        models, sizes = [], []
        for partition in clients:
            x, y = training_tensors(config, partition)
            own = kept.get(partition, seeded_bn) if keep else seeded_bn
            w = {**theta, **own}
            trained = [k for k in w if "running" not in k and "num_batches" not in k]
            for _ in range(config.epochs):
                p = {
                    k: (v.clone().requires_grad_(True) if k in trained else v) for k, v in w.items()
                }
                logits, stats = _forward(p, x)
                grads = torch.autograd.grad(F.cross_entropy(logits, y), [p[k] for k in trained])
                w = {**w, **stats}
                w.update({k: w[k] - config.lr * g for k, g in zip(trained, grads, strict=True)})
            kept[partition] = {k: w[k].detach() for k in bn}
            models.append(w)
            sizes.append(len(y))
        share = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
        theta = {k: sum(s * m[k] for s, m in zip(share, models, strict=True)) for k in theta}
        if average_all:
            averaged = {
                k: sum(s * m[k].double() for s, m in zip(share, models, strict=True)) for k in bn
            }
            for partition in clients:
                kept[partition] = averaged
    return {k: v.detach().numpy() for k, v in theta.items()}, kept


def test_three_rounds_of_fedbn_average_all_but_the_batch_norm_layers() -> None:
    config, start, result, sampled, grid = tiny_rounds(
        ROUNDS, algorithm="fedbn", model="digits-mlp-bn", fraction_train=0.5
    )
    model = build_model(config.model_name, config.num_classes, 0, config.input_shape)
    bn = local_names(model)
    # the server holds everything but the BatchNorm layers
    assert set(start) == set(model.state_dict()) - bn
    assert set(result) == set(start)
    oracle, kept = _oracle(config, start, sampled)
    assert _largest_gap(result, oracle) < 1e-6
    for partition in range(config.num_clients):
        state = grid.contexts[grid.node_of(partition)].state
        if partition not in kept:
            assert protocol.STATE_PERSONAL not in state
            continue
        stored = {k: v.numpy() for k, v in state[protocol.STATE_PERSONAL].items()}
        assert set(stored) == bn
        assert _largest_gap(stored, {k: v.numpy() for k, v in kept[partition].items()}) < 1e-6
    # the test can fail: with the BatchNorm layers reset every round, or averaged
    # (FedAvg), the oracle is far from what FedBN computed
    assert _largest_gap(result, _oracle(config, start, sampled, keep=False)[0]) > 1e-4
    assert _largest_gap(result, _oracle(config, start, sampled, average_all=True)[0]) > 1e-4


def test_fedbn_refuses_a_built_in_model_without_batch_norm() -> None:
    from fedpers.simulations.grid import run_config

    with pytest.raises(ConfigError, match="model = 'digits-mlp' has none: choose model = one"):
        RunConfig.from_mapping(run_config(algorithm="fedbn", dataset="digits"))


def test_a_batch_norm_model_skips_a_one_sample_batch() -> None:
    """11 samples in batches of 10: the last batch of each epoch holds one sample,
    which BatchNorm cannot normalize in training mode; the step is skipped (10 samples
    a step, one step an epoch) and the client trains."""
    model = build_model("digits-mlp-bn", 10, 0, (64,))
    stack = Stack.of(model, [{}])
    x = torch.randn(1, 11, 64)
    y = torch.randint(0, 10, (1, 11))
    from fedpers.training import CohortData

    before = {k: v.clone() for k, v in stack.tensors.items()}
    (stats,) = train(
        stack,
        CohortData(x, y, [11]),
        parts=("body", "head"),
        epochs=2,
        settings=SGDSettings(lr=0.1, momentum=0.0, weight_decay=0.0, batch_size=10),
        generators=[torch.Generator().manual_seed(0)],
    )
    assert stats.steps == 2
    assert np.isfinite(stats.loss)
    assert int(stack.tensors["body.1.num_batches_tracked"][0]) == 2
    assert not torch.equal(before["body.0.weight"], stack.tensors["body.0.weight"])


def test_feature_shift_maps_each_client_by_its_own_contrast_and_brightness() -> None:
    """Every split of a client under one map ``a x + b`` (the same for all its samples),
    its own per client; 0 leaves the data as it is; labels never move."""
    from fedpers.simulations.grid import run_config

    plain = RunConfig.from_mapping(run_config(dataset="digits"))
    shifted = RunConfig.from_mapping(run_config(dataset="digits", feature_shift=1.0))
    maps = []
    for partition in range(3):
        before, after = client_data(plain, partition), client_data(shifted, partition)
        np.testing.assert_array_equal(before.y_train, after.y_train)
        np.testing.assert_array_equal(before.y_test, after.y_test)
        x = np.concatenate([before.x_train, before.x_test]).ravel().astype(np.float64)
        z = np.concatenate([after.x_train, after.x_test]).ravel().astype(np.float64)
        a, b = np.polyfit(x, z, 1)  # one affine map fits every value of every split
        assert np.max(np.abs(a * x + b - z)) < 1e-4 * max(1.0, np.max(np.abs(z)))
        maps.append((a, b))
    assert len({round(a, 6) for a, _ in maps}) == 3  # each client its own contrast
    data = client_data(plain, 0)
    same = feature_shifted(data, 0.0, 0, 0)
    assert isinstance(same, ClientData)
    np.testing.assert_array_equal(same.x_train, data.x_train)


REFUSE_BATCH_NORM = ("scaffold", "scaffold-ft", "pfedhn")


@pytest.mark.long  # 35 runs in process, 20 worker-seconds: make test, not make check
@pytest.mark.parametrize("algorithm", fedrep_images_methods())
def test_every_row_runs_with_a_batch_norm_model_or_is_refused_before_start(
    algorithm: str, tmp_path
) -> None:
    """Two rounds of 6 generated MNIST-1D clients with ``mnist1d-mlp-bn`` in process:
    every personalized and mixture row trains and evaluates (no reply refused), except
    those whose update covers every array of the model, which are refused by the
    configuration, naming the fix, before anything starts."""
    from fedpers.simulations.inprocess import run_in_process

    overrides = {
        "algorithm": algorithm,
        "model": "mnist1d-mlp-bn",
        "num-clients": 6,
        "fraction-train": 0.5,
        "num-rounds": 2,
        "samples-per-client": 40,
        "partitioner": "generated",
        "epochs": 1,
        "head-epochs": 1,
        "final-rounds": 1,
        "results-dir": str(tmp_path),
        "run-name": "r",
    }
    if algorithm in REFUSE_BATCH_NORM:
        with pytest.raises(ConfigError, match="choose a model without BatchNorm layers"):
            run_in_process(overrides)
        assert not (tmp_path / "r").exists()
        return
    directory = run_in_process(overrides)
    rounds = [json.loads(line) for line in (directory / "rounds.jsonl").read_text().splitlines()]
    assert len(rounds) == 2
    assert all(not r["rejections"] and r["replies"] == r["sampled"] for r in rounds)
    assert np.isfinite(json.loads((directory / "summary.json").read_text())["final_accuracy"])


@pytest.mark.parametrize(
    ("name", "plain"), [("cifar10-cnn-bn", "cifar10-cnn"), ("cifar100-cnn-bn", "cifar100-cnn")]
)
def test_the_cnns_with_batch_norm_are_the_papers_cnns_with_a_batch_norm_before_each_relu(
    name: str, plain: str
) -> None:
    """The same seed gives the same conv and linear weights as the CNN without BatchNorm
    (BatchNorm draws nothing at its start), each BatchNorm sits between a conv or hidden
    linear layer and its ReLU, and with identity BatchNorm layers (eps 0, running mean
    0 and variance 1, scale 1, shift 0) the two compute the same logits in eval mode."""
    classes = 100 if name.startswith("cifar100") else 10
    model = build_model(name, classes, 0, (3, 32, 32))
    reference = build_model(plain, classes, 0, (3, 32, 32))
    modules = list(model.body.modules())
    norms = [m for m in modules if isinstance(m, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d))]
    assert len(norms) == 4  # two convs, two hidden linear layers
    layers = [
        m
        for m in modules
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear, torch.nn.ReLU)) or m in norms
    ]
    kinds = [type(m).__name__ for m in layers]
    for i, kind in enumerate(kinds):
        if kind.startswith("BatchNorm"):
            assert kinds[i - 1] in ("Conv2d", "Linear"), kinds
            assert kinds[i + 1] == "ReLU", kinds
    bn = local_names(model)
    assert len(bn) == 4 * 5  # weight, bias, running mean and variance, step count
    weights = {k: v for k, v in model.state_dict().items() if k not in bn}
    plain_weights = list(reference.state_dict().values())
    assert len(weights) == len(plain_weights)
    for ours, theirs in zip(weights.values(), plain_weights, strict=True):
        assert torch.equal(ours, theirs)
    for norm in norms:
        norm.eps = 0.0
    model.eval()
    reference.eval()
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-6)
        norms[0].running_mean.fill_(0.5)  # the test can fail: a moved BatchNorm shows
        assert not torch.allclose(model(x), reference(x), rtol=1e-3, atol=1e-4)


@pytest.mark.long  # a CNN's two rounds in process on each engine, about 10 s
def test_fedbn_on_cifar10s_cnn_with_batch_norm_keeps_those_layers_on_each_client(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two rounds of FedBN with ``cifar10-cnn-bn`` on CIFAR-10 files the test writes, in
    process, client by client and on the batched engine: no reply refused, the server's
    arrays are the model's but its BatchNorm layers, the trained clients each hold
    exactly those layers, moved from the seeded ones by their training, and the two
    engines agree."""
    from fedpers.simulations.inprocess import InProcessSimulation

    write_cifar(tmp_path, "cifar10", monkeypatch)
    model = build_model("cifar10-cnn-bn", 10, 0, (3, 32, 32))
    bn = local_names(model)
    seeded = {k: v.numpy() for k, v in model.state_dict().items() if k in bn}
    outcomes = []
    for engine in ("flower", "batched"):
        simulation = InProcessSimulation(echo=lambda line: None)
        directory = simulation.run(
            {
                "algorithm": "fedbn",
                "engine": engine,
                "dataset": "cifar10",
                "data-root": str(tmp_path),
                "model": "cifar10-cnn-bn",
                "num-clients": 4,
                "classes-per-client": 2,
                "fraction-train": 0.5,
                "num-rounds": 2,
                "epochs": 1,
                "batch-size": 4,
                "final-rounds": 1,
                "results-dir": str(tmp_path / engine),
                "run-name": "r",
            }
        )
        lines = (directory / "rounds.jsonl").read_text().splitlines()
        rounds = [json.loads(line) for line in lines]
        assert len(rounds) == 2
        assert all(not r["rejections"] and r["replies"] == r["sampled"] == 2 for r in rounds)
        with np.load(directory / "checkpoint.npz") as stored:
            server = {k: stored[k] for k in stored.files if not k.startswith("__")}
        assert set(server) == set(model.state_dict()) - bn
        clients = {}
        for node, context in simulation.grid.contexts.items():
            if protocol.STATE_PERSONAL in context.state:
                kept = context.state[protocol.STATE_PERSONAL].items()
                clients[node] = {k: v.numpy() for k, v in kept}
                assert set(clients[node]) == bn
                assert _largest_gap(clients[node], seeded) > 1e-4
        assert len(clients) >= 2
        outcomes.append((server, clients))
    (server, clients), (batched_server, batched_clients) = outcomes
    assert _largest_gap(server, batched_server) < 1e-5
    assert set(clients) == set(batched_clients)
    for node, kept in clients.items():
        assert _largest_gap(kept, batched_clients[node]) < 1e-5
