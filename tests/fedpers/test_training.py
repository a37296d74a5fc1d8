"""The one training loop, for a cohort: with one client it gives the bits of the loop
fedpers ran before cohorts (tests/fedpers/reference_loop.py, torch's own SGD and
dropout inside); a client trained in a cohort gets its result alone (float64, 1e-10);
frozen parts stay exactly as they are, weight decay skips biases, training reduces the
loss, evaluation counts correctly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fedpers.data.registry import MODEL_INPUTS
from fedpers.models import (
    MODELS,
    SplitModel,
    build_model,
    linear_model,
    load_part_arrays,
    part_arrays,
)
from fedpers.models.agents import build_agent
from fedpers.sheaf import AgentSpec
from fedpers.training import (
    CohortData,
    SGDSettings,
    Stack,
    evaluate,
    evaluate_model,
    random_crop_flip,
    train,
    train_model,
)
from tests.fedpers import reference_loop

SETTINGS = SGDSettings(lr=0.1, momentum=0.9, weight_decay=0.1, batch_size=8)


def _data(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 40, generator=generator)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return x, y


def _dropout_mlp() -> SplitModel:
    torch.manual_seed(7)
    body = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 8), nn.ReLU())
    return SplitModel(body, nn.Sequential(nn.Dropout(0.5), nn.Linear(8, 3)))


# ------------------------------------------------------------- one client: the bits
@pytest.mark.parametrize(
    ("name", "momentum", "weight_decay", "clip", "weighted", "augment"),
    [
        ("mnist1d-mlp", 0.9, 0.1, None, False, False),
        ("mnist1d-mlp", 0.0, 0.0, None, True, False),
        ("mnist1d-mlp", 0.5, 0.0, 1.0, False, False),
        ("dropout-mlp", 0.5, 1e-3, None, False, False),
        ("digits-agent", 0.9, 5e-4, 1.0, False, False),  # Sheaf-FRL's agent: dropout 0.5
        ("digits-agent-0.15", 0.9, 5e-4, 1.0, False, False),  # 1 / (1 - p) not exact
        ("cifar10-cnn", 0.9, 5e-4, None, False, True),
    ],
)
def test_one_client_takes_the_steps_of_the_loop_before_cohorts_bit_for_bit(
    name: str,
    momentum: float,
    weight_decay: float,
    clip: float | None,
    weighted: bool,
    augment: bool,
) -> None:
    """Frozen part then both parts, momentum, decay, clipping, sample weights, dropout
    (masks from the client's generator against torch's global one) and augmentation:
    every parameter, the loss and the step count equal to the bit."""
    shape = {"cifar10-cnn": (3, 32, 32), "dropout-mlp": (6,), "digits-agent": (64,)}.get(
        name.removesuffix("-0.15"), (40,)
    )
    x = torch.randn(45, *shape, generator=torch.Generator().manual_seed(0))
    y = torch.arange(45) % 3
    weights = torch.rand(45, generator=torch.Generator().manual_seed(1)) if weighted else None
    settings = SGDSettings(lr=0.05, momentum=momentum, weight_decay=weight_decay, batch_size=16)
    crop = random_crop_flip() if augment else None

    def fresh() -> nn.Module:
        if name == "dropout-mlp":
            return _dropout_mlp()
        if name.startswith("digits-agent"):
            p = 0.15 if name.endswith("-0.15") else 0.5
            return build_agent(AgentSpec(8, 16, 8, p), "digits", 10, seed=4)
        return build_model(name, 10, seed=2)

    ours, theirs = fresh(), fresh()
    for parts in (("head",), ("body", "head")):
        mine = train_model(
            ours, x, y, parts=parts, epochs=2, settings=settings,
            generator=torch.Generator().manual_seed(5), sample_weights=weights,
            augment=crop, max_grad_norm=clip,
        )  # fmt: skip
        reference = reference_loop.train(
            theirs, x, y, parts=parts, epochs=2, settings=settings,
            generator=torch.Generator().manual_seed(5), sample_weights=weights,
            augment=crop, max_grad_norm=clip,
        )  # fmt: skip
        assert mine == reference
    start = part_arrays(fresh(), ("body", "head"))
    trained, expected = part_arrays(ours, ("body", "head")), part_arrays(theirs, ("body", "head"))
    assert any(not np.array_equal(trained[k], start[k]) for k in trained)  # it trained
    for key in expected:
        np.testing.assert_array_equal(trained[key], expected[key], err_msg=key)
    assert evaluate_model(ours, x, y) == reference_loop.evaluate(theirs, x, y)


def test_the_reference_loop_tells_a_changed_step_apart() -> None:
    """The control of the test above: one more draw from the generator before training
    (another batch order) changes the parameters."""
    x, y = _data(40)
    ours, theirs = build_model("mnist1d-mlp", 10, seed=2), build_model("mnist1d-mlp", 10, seed=2)
    shifted = torch.Generator().manual_seed(5)
    torch.randint(0, 2, (1,), generator=shifted)
    train_model(ours, x, y, parts=("body", "head"), epochs=1, settings=SETTINGS, generator=shifted)
    reference_loop.train(
        theirs, x, y, parts=("body", "head"), epochs=1, settings=SETTINGS,
        generator=torch.Generator().manual_seed(5),
    )  # fmt: skip
    differs = [
        not np.array_equal(a, part_arrays(theirs, ("body",))[k])
        for k, a in part_arrays(ours, ("body",)).items()
    ]
    assert all(differs)


# ----------------------------------------------------------- a cohort: each its own
COUNTS = (13, 7, 0, 20, 1)


def _cohort(
    model: nn.Module, counts: tuple[int, ...], shape: tuple[int, ...], seed: int = 0
) -> tuple[list[dict[str, np.ndarray]], list[np.ndarray], list[np.ndarray]]:
    """Each client's own start (the model, perturbed), inputs and labels."""
    rng = np.random.default_rng(seed)
    starts = [
        {
            k: v.detach().numpy() + 0.05 * rng.normal(size=v.shape).astype(np.float32)
            for k, v in model.state_dict().items()
        }
        for _ in counts
    ]
    xs = [rng.normal(size=(n, *shape)).astype(np.float32) for n in counts]
    ys = [rng.integers(0, 3, size=n) for n in counts]
    return starts, xs, ys


def _train_clients(
    model: nn.Module,
    starts: list[dict[str, np.ndarray]],
    xs: list[np.ndarray],
    ys: list[np.ndarray],
    seeds: list[int],
    **kwargs: Any,
) -> tuple[list[dict[str, np.ndarray]], list[Any], list[Any]]:
    stack = Stack.of(model, starts, dtype=torch.float64)
    data = CohortData.of(xs, ys, dtype=torch.float64)
    stats = train(
        stack, data, parts=("body", "head"), epochs=2,
        settings=SGDSettings(0.05, 0.9, 0.01, 4),
        generators=[torch.Generator().manual_seed(s) for s in seeds], **kwargs,
    )  # fmt: skip
    return stack.arrays(("body", "head")), stats, evaluate(stack, data)


def _largest_difference(
    together: tuple[list[dict[str, np.ndarray]], list[Any], list[Any]],
    alone: list[tuple[list[dict[str, np.ndarray]], list[Any], list[Any]]],
) -> float:
    worst = 0.0
    for k, (arrays, stats, tests) in enumerate(alone):
        for name, value in arrays[0].items():
            other = together[0][k][name]
            worst = max(worst, float(np.max(np.abs(value - other) / (np.abs(value) + 1e-12))))
        if stats[0].steps != together[1][k].steps:
            return float("inf")
        if stats[0].steps:
            worst = max(worst, abs(stats[0].loss - together[1][k].loss) / abs(stats[0].loss))
        if tests[0].num_examples:
            worst = max(worst, abs(tests[0].loss - together[2][k].loss) / abs(tests[0].loss))
            worst = max(worst, abs(tests[0].accuracy - together[2][k].accuracy))
    return worst


@pytest.mark.parametrize("case", ["plain", "dropout", "clip", "weights", "correction", "augment"])
def test_a_client_in_a_cohort_gets_its_result_alone(case: str) -> None:
    """Five clients of uneven sizes (one without data, one with a single sample), trained
    together and each alone, float64: parameters, losses, steps and test figures agree
    to 1e-10. Swapping two clients' seeds breaks it (the control)."""
    model = build_model("cifar10-cnn", 10, seed=0) if case == "augment" else _dropout_mlp()
    if case != "dropout" and case != "augment":
        model = SplitModel(model.body[:2], nn.Linear(16, 3))
    counts = (5, 3, 0, 8) if case == "augment" else COUNTS
    shape = (3, 32, 32) if case == "augment" else (6,)
    starts, xs, ys = _cohort(model, counts, shape)
    seeds = [100 + k for k in range(len(counts))]
    rng = np.random.default_rng(1)
    kwargs: dict[str, Any] = {}
    if case == "clip":
        kwargs["max_grad_norm"] = 0.5
    if case == "augment":
        kwargs["augment"] = random_crop_flip()
    weights = [torch.as_tensor(rng.uniform(0.1, 2.0, size=n)) for n in counts]
    corrections = {
        k: torch.as_tensor(rng.normal(size=(len(counts), *v.shape)) * 0.1)
        for k, v in model.named_parameters()
    }

    def run(members: list[int], seeds_of: list[int]) -> tuple[Any, Any, Any]:
        extra = dict(kwargs)
        if case == "weights":
            width = max([counts[k] for k in members] + [0])
            table = torch.zeros(len(members), width, dtype=torch.float64)
            for j, k in enumerate(members):
                table[j, : counts[k]] = weights[k]
            extra["sample_weights"] = table
        if case == "correction":
            extra["correction"] = {n: c[members] for n, c in corrections.items()}
        return _train_clients(
            model, [starts[k] for k in members], [xs[k] for k in members],
            [ys[k] for k in members], [seeds_of[k] for k in members], **extra,
        )  # fmt: skip

    members = list(range(len(counts)))
    together = run(members, seeds)
    alone = [run([k], seeds) for k in members]
    assert _largest_difference(together, alone) < 1e-10
    swapped = [seeds[1], seeds[0], *seeds[2:]]
    assert _largest_difference(run(members, swapped), alone) > 1e-3


def test_a_client_in_a_cohort_is_told_apart_from_another_clients_data() -> None:
    """The control on data: the first client trained on the second one's samples."""
    model = SplitModel(_dropout_mlp().body[:2], nn.Linear(16, 3))
    starts, xs, ys = _cohort(model, COUNTS, (6,))
    seeds = [100 + k for k in range(len(COUNTS))]
    alone = [
        _train_clients(model, [starts[k]], [xs[k]], [ys[k]], [seeds[k]]) for k in range(len(COUNTS))
    ]
    xs[0] = np.concatenate([xs[1], xs[1]])[: COUNTS[0]]
    ys[0] = np.concatenate([ys[1], ys[1]])[: COUNTS[0]]
    together = _train_clients(model, starts, xs, ys, seeds)
    assert _largest_difference(together, alone) > 1e-3


# --------------------------------------------------------------------- properties
@pytest.mark.parametrize(("trained", "frozen"), [("head", "body"), ("body", "head")])
def test_frozen_part_is_bitwise_unchanged_despite_momentum_and_decay(
    trained: str, frozen: str
) -> None:
    model = build_model("mnist1d-mlp", 10, seed=0)
    x, y = _data()
    frozen_before = part_arrays(model, (frozen,))
    trained_before = part_arrays(model, (trained,))
    for _ in range(2):  # two calls: a stale optimizer state would move frozen weights
        train_model(
            model, x, y, parts=(trained,), epochs=3, settings=SETTINGS,
            generator=torch.Generator().manual_seed(1),
        )  # fmt: skip
    for name, value in part_arrays(model, (frozen,)).items():
        np.testing.assert_array_equal(value, frozen_before[name])
    changed = [
        not np.array_equal(v, trained_before[k]) for k, v in part_arrays(model, (trained,)).items()
    ]
    assert all(changed)


def test_weight_decay_applies_to_weights_not_biases() -> None:
    model = linear_model(3, 2)
    model.body = torch.nn.Linear(3, 2)  # with a bias
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    x, y = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    head = torch.nn.Linear(2, 2, bias=False)
    model.head = head
    with torch.no_grad():
        head.weight.zero_()  # zero logits gradient w.r.t. body: only decay acts on it
    settings = SGDSettings(lr=0.5, momentum=0.0, weight_decay=0.2, batch_size=4)
    train_model(
        model, x, y, parts=("body",), epochs=1, settings=settings, generator=torch.Generator()
    )
    np.testing.assert_allclose(model.body.weight.detach().numpy(), 1.0 - 0.5 * 0.2 * 1.0)
    np.testing.assert_allclose(model.body.bias.detach().numpy(), 1.0)


def test_training_reduces_the_loss_and_evaluate_counts_correctly() -> None:
    model = build_model("mnist1d-mlp", 10, seed=0)
    x, y = _data(256)
    before = evaluate_model(model, x, y)
    train_model(
        model, x, y, parts=("body", "head"), epochs=20, settings=SGDSettings(0.05, 0.5, 0.0, 16),
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    after = evaluate_model(model, x, y)
    assert after.loss < 0.5 * before.loss
    logits = model(x)
    expected = float((logits.argmax(1) == y).float().mean())
    assert after.accuracy == pytest.approx(expected)
    assert after.num_examples == 256


def test_sample_weights_scale_the_loss() -> None:
    x, y = _data(16)
    models = [build_model("mnist1d-mlp", 10, seed=0) for _ in range(2)]
    settings = SGDSettings(0.1, 0.0, 0.0, 16)  # one full batch
    train_model(
        models[0], x, y, parts=("head",), epochs=1, settings=settings, generator=torch.Generator()
    )
    half = SGDSettings(0.2, 0.0, 0.0, 16)
    train_model(
        models[1], x, y, parts=("head",), epochs=1, settings=half, generator=torch.Generator(),
        sample_weights=torch.full((16,), 0.5),
    )  # fmt: skip
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), atol=1e-6)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_split_into_body_and_head_and_are_seeded(name: str) -> None:
    classes = 100 if name == "cifar100-cnn" else 10
    shape = (2, *(MODEL_INPUTS[name] or (5,)))  # logistic takes any input
    model = build_model(name, classes, seed=3, input_shape=shape[1:])
    again = build_model(name, classes, seed=3, input_shape=shape[1:])
    for key, value in part_arrays(model, ("body", "head")).items():
        np.testing.assert_array_equal(value, part_arrays(again, ("body", "head"))[key])
    # (a training-mode pass moves BatchNorm's running statistics: compared before it)
    assert model(torch.zeros(shape)).shape == (2, classes)
    parts = {k.split(".")[0] for k in model.state_dict()}
    assert parts == ({"head"} if name == "logistic" else {"body", "head"})
    assert len(part_arrays(model, ("head",))) == 2  # the head is the last linear layer


def test_load_part_arrays_rejects_wrong_shapes_and_names() -> None:
    model = build_model("mnist1d-mlp", 10, seed=0)
    with pytest.raises(ValueError, match="has shape"):
        load_part_arrays(model, {"head.weight": np.zeros((3, 3), np.float32)})
    with pytest.raises(KeyError, match="no parameter"):
        load_part_arrays(model, {"head.nothing": np.zeros(1)})


def test_random_crop_flip_crops_the_padded_image_at_the_drawn_offsets() -> None:
    """Each output image is the 8 x 8 window of the zero-padded input at the drawn
    offsets, mirrored where drawn: written out with numpy from the same draws."""
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8) + 1
    crop = random_crop_flip(padding=2)
    out = crop(x, torch.Generator().manual_seed(0))
    dy, dx, flip = crop.draw(2, torch.Generator().manual_seed(0))
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (2, 2), (2, 2)))
    for i in range(2):
        window = padded[i, :, int(dy[i]) : int(dy[i]) + 8, int(dx[i]) : int(dx[i]) + 8]
        expected = window[:, :, ::-1] if bool(flip[i]) else window
        np.testing.assert_array_equal(out[i].numpy(), expected)
    assert not np.array_equal(out.numpy(), x.numpy())  # the draws moved something


def test_sgd_skips_a_parameter_without_a_gradient_as_torch_does() -> None:
    from fedpers.training import SGD

    used, unused = torch.ones(1, 2, 2), torch.ones(1, 2)
    optimizer = SGD(
        [used, unused], SGDSettings(lr=0.5, momentum=0.0, weight_decay=0.1, batch_size=1)
    )
    optimizer.step([torch.arange(4.0).reshape(1, 2, 2), None])
    np.testing.assert_array_equal(unused.numpy(), np.ones((1, 2)))
    # weight decay 0.1 on the 2-D tensor, lr 0.5: 1 - 0.5 * (g + 0.1 * 1)
    expected = 1 - 0.5 * (np.arange(4.0).reshape(1, 2, 2) + 0.1)
    np.testing.assert_allclose(used.numpy(), expected, rtol=1e-6)


def test_an_inactive_client_is_not_moved_by_decay_or_momentum() -> None:
    from fedpers.training import SGD

    params = torch.ones(2, 3, 3)
    optimizer = SGD([params], SGDSettings(lr=0.5, momentum=0.9, weight_decay=0.1, batch_size=1))
    optimizer.step([torch.ones(2, 3, 3)])
    after_first = params[1].clone()
    optimizer.step([torch.zeros(2, 3, 3)], torch.tensor([True, False]))
    np.testing.assert_array_equal(params[1].numpy(), after_first.numpy())
    assert not torch.equal(params[0], after_first)


def test_training_does_not_import_torch_dynamo() -> None:
    """A fresh process trains a cohort without importing torch._dynamo (seconds of
    start-up in every cold ClientApp and Ray actor; fedpers.training's docstring)."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from fedpers.models import build_model\n"
        "from fedpers.training import CohortData, SGDSettings, Stack, train\n"
        "m = build_model('mnist1d-mlp', 10, seed=0)\n"
        "stack = Stack.of(m, [{}, {}])\n"
        "data = CohortData(torch.randn(2, 8, 40), torch.arange(16).view(2, 8) % 10, [8, 5])\n"
        "s = SGDSettings(lr=0.1, momentum=0.9, weight_decay=0.1, batch_size=4)\n"
        "train(stack, data, parts=('body', 'head'), epochs=1, settings=s,\n"
        "      generators=[torch.Generator(), torch.Generator()], max_grad_norm=1.0)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "False"


def test_a_cohort_of_batchnorm_models_trains_each_client_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """BatchNorm normalizes by the batch: padded rows must not enter its statistics, so a
    cohort of such models trains client by client; the result (parameters and running
    statistics) is each client's alone, float64 to 1e-12. Trained as one cohort, the
    padding shifts them (the control)."""
    torch.manual_seed(3)
    body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU())
    model = SplitModel(body, nn.Linear(16, 3))
    counts = (14, 7, 0, 18)  # no batch of one: BatchNorm refuses it, alone as in a cohort
    starts, xs, ys = _cohort(model, counts, (6,))
    seeds = [100 + k for k in range(len(counts))]
    together = _train_clients(model, starts, xs, ys, seeds)
    alone = [
        _train_clients(model, [starts[k]], [xs[k]], [ys[k]], [seeds[k]]) for k in range(len(counts))
    ]
    assert _largest_difference(together, alone) < 1e-12
    assert Stack.of(model, starts).has_batch_statistics
    monkeypatch.setattr(Stack, "has_batch_statistics", property(lambda self: False))
    padded = _train_clients(model, starts, xs, ys, seeds)
    assert _largest_difference(padded, alone) > 1e-6


def test_call_with_is_functional_call_and_restores_the_module() -> None:
    """``call_with`` against torch.func.functional_call (the oracle), on a model with a
    buffer (BatchNorm), for the whole model and a part under ``vmap``; the module's own
    tensors are back after the call, also when it fails; an unknown name is refused."""
    from torch.func import functional_call, vmap

    from fedpers.training import call_with

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)).eval()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    tensors = {n: torch.randn_like(t.float()).to(t.dtype) for n, t in model.state_dict().items()}
    tensors["1.running_var"] = tensors["1.running_var"].abs()
    x = torch.randn(7, 5)
    assert torch.equal(call_with(model, tensors, x), functional_call(model, tensors, (x,)))
    stacked = {n: torch.stack([t, t * 2]) for n, t in tensors.items() if t.is_floating_point()}
    ours = vmap(lambda ts, xx: call_with(model, ts, xx))(stacked, torch.stack([x, x]))
    theirs = vmap(lambda ts, xx: functional_call(model, ts, (xx,)))(stacked, torch.stack([x, x]))
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours[0], ours[1])
    with pytest.raises(KeyError, match=r"no parameter or buffer 'head\.weight'"):
        call_with(model, {"0.weight": tensors["0.weight"], "head.weight": x}, x)
    with pytest.raises(RuntimeError):
        call_with(model, {"0.weight": torch.zeros(3, 3)}, x)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
