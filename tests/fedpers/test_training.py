"""The one training loop: frozen parts stay exactly as they are, weight decay skips
biases, training reduces the loss, evaluation counts correctly."""

import numpy as np
import pytest
import torch

from fedpers.models import MODELS, build_model, linear_model, load_part_arrays, part_arrays
from fedpers.training import SGDSettings, evaluate, random_crop_flip, train

SETTINGS = SGDSettings(lr=0.1, momentum=0.9, weight_decay=0.1, batch_size=8)


def _data(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 40, generator=generator)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return x, y


@pytest.mark.parametrize(("trained", "frozen"), [("head", "body"), ("body", "head")])
def test_frozen_part_is_bitwise_unchanged_despite_momentum_and_decay(
    trained: str, frozen: str
) -> None:
    model = build_model("mnist1d-mlp", 10, seed=0)
    x, y = _data()
    frozen_before = part_arrays(model, (frozen,))
    trained_before = part_arrays(model, (trained,))
    for _ in range(2):  # two calls: a stale optimizer state would move frozen weights
        train(
            model,
            x,
            y,
            parts=(trained,),
            epochs=3,
            settings=SETTINGS,
            generator=torch.Generator().manual_seed(1),
        )
    for name, value in part_arrays(model, (frozen,)).items():
        np.testing.assert_array_equal(value, frozen_before[name])
    changed = [
        not np.array_equal(v, trained_before[k]) for k, v in part_arrays(model, (trained,)).items()
    ]
    assert all(changed)
    assert all(p.requires_grad for p in model.parameters())  # restored afterwards


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
    train(
        model,
        x,
        y,
        parts=("body",),
        epochs=1,
        settings=settings,
        generator=torch.Generator(),
    )
    np.testing.assert_allclose(model.body.weight.detach().numpy(), 1.0 - 0.5 * 0.2 * 1.0)
    np.testing.assert_allclose(model.body.bias.detach().numpy(), 1.0)


def test_training_reduces_the_loss_and_evaluate_counts_correctly() -> None:
    model = build_model("mnist1d-mlp", 10, seed=0)
    x, y = _data(256)
    before = evaluate(model, x, y)
    train(
        model,
        x,
        y,
        parts=("body", "head"),
        epochs=20,
        settings=SGDSettings(0.05, 0.5, 0.0, 16),
        generator=torch.Generator().manual_seed(0),
    )
    after = evaluate(model, x, y)
    assert after.loss < 0.5 * before.loss
    logits = model(x)
    expected = float((logits.argmax(1) == y).float().mean())
    assert after.accuracy == pytest.approx(expected)
    assert after.num_examples == 256


def test_sample_weights_scale_the_loss() -> None:
    x, y = _data(16)
    models = [build_model("mnist1d-mlp", 10, seed=0) for _ in range(2)]
    settings = SGDSettings(0.1, 0.0, 0.0, 16)  # one full batch
    train(
        models[0],
        x,
        y,
        parts=("head",),
        epochs=1,
        settings=settings,
        generator=torch.Generator(),
    )
    half = SGDSettings(0.2, 0.0, 0.0, 16)
    train(
        models[1],
        x,
        y,
        parts=("head",),
        epochs=1,
        settings=half,
        generator=torch.Generator(),
        sample_weights=torch.full((16,), 0.5),
    )
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), atol=1e-6)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_split_into_body_and_head_and_are_seeded(name: str) -> None:
    classes = 100 if name == "cifar100-cnn" else 10
    shape = {
        "mnist1d-mlp": (2, 40),
        "digits-mlp": (2, 64),
        "femnist-mlp": (2, 1, 28, 28),
        "logistic": (2, 5),
    }.get(name, (2, 3, 32, 32))
    model = build_model(name, classes, seed=3, input_shape=shape[1:])
    assert model(torch.zeros(shape)).shape == (2, classes)
    parts = {k.split(".")[0] for k in model.state_dict()}
    assert parts == ({"head"} if name == "logistic" else {"body", "head"})
    assert len(part_arrays(model, ("head",))) == 2  # the head is the last linear layer
    again = build_model(name, classes, seed=3, input_shape=shape[1:])
    for key, value in part_arrays(model, ("body", "head")).items():
        np.testing.assert_array_equal(value, part_arrays(again, ("body", "head"))[key])


def test_load_part_arrays_rejects_wrong_shapes_and_names() -> None:
    model = build_model("mnist1d-mlp", 10, seed=0)
    with pytest.raises(ValueError, match="has shape"):
        load_part_arrays(model, {"head.weight": np.zeros((3, 3), np.float32)})
    with pytest.raises(KeyError, match="no parameter"):
        load_part_arrays(model, {"head.nothing": np.zeros(1)})


def test_random_crop_flip_keeps_shape_and_content_scale() -> None:
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8)
    out = random_crop_flip(padding=2)(x, torch.Generator().manual_seed(0))
    assert out.shape == x.shape
    assert set(out.unique().tolist()) <= set(x.unique().tolist()) | {0.0}


def test_dropout_and_initial_weights_are_the_bits_torch_manual_seed_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fedpers seeds only the CPU generator (fedpers.seeding.seed_torch); torch's own
    ``manual_seed``, which also queues every accelerator's seeding, is the oracle."""
    import fedpers.models as models_module
    import fedpers.training as training_module
    from fedpers.models.agents import build_agent
    from fedpers.sheaf import AgentSpec

    def run() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        models_module._prototype.cache_clear()
        model = build_model("cifar100-cnn", 100, seed=3)  # dropout 0.6 in its body
        x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        train(
            model,
            x,
            torch.arange(8),
            parts=("body", "head"),
            epochs=1,
            settings=SETTINGS,
            generator=torch.Generator().manual_seed(1),
        )
        agent = build_agent(AgentSpec(8, 16, 8, 0.5), "digits", 10, seed=4)
        return part_arrays(model, ("body", "head")), {
            k: v.detach().numpy().copy() for k, v in agent.state_dict().items()
        }

    ours = run()
    oracle = torch.manual_seed
    # The three modules import seed_torch by name: patch each.
    monkeypatch.setattr(training_module, "seed_torch", lambda seed, device="cpu": oracle(seed))
    monkeypatch.setattr(models_module, "seed_torch", lambda seed, device="cpu": oracle(seed))
    monkeypatch.setattr("fedpers.models.agents.seed_torch", lambda seed, device="cpu": oracle(seed))
    theirs = run()
    models_module._prototype.cache_clear()
    for mine, other in zip(ours, theirs, strict=True):
        assert set(mine) == set(other)
        for name in mine:
            np.testing.assert_array_equal(mine[name], other[name])


@pytest.mark.parametrize(
    ("model_name", "momentum", "weight_decay", "clip"),
    [
        ("mnist1d-mlp", 0.9, 0.1, None),
        ("mnist1d-mlp", 0.0, 0.0, None),
        ("mnist1d-mlp", 0.5, 0.0, 1.0),
        ("cifar10-cnn", 0.9, 5e-4, None),
    ],
)
def test_sgd_takes_the_steps_torch_optim_sgd_takes_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch,
    model_name: str,
    momentum: float,
    weight_decay: float,
    clip: float | None,
) -> None:
    """``training.SGD`` against ``torch.optim.SGD`` on the two parameter groups ``train``
    gave it before (weights with decay, biases without): the same bits after three
    epochs of ``train``, weight decay, momentum and clipping included."""
    import fedpers.training as training_module

    class TorchSGD:
        def __init__(self, params: list[torch.nn.Parameter], settings: SGDSettings) -> None:
            self.optimizer = torch.optim.SGD(
                [
                    {
                        "params": [p for p in params if p.ndim >= 2],
                        "weight_decay": settings.weight_decay,
                    },
                    {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
                ],
                lr=settings.lr,
                momentum=settings.momentum,
            )

        def zero_grad(self) -> None:
            self.optimizer.zero_grad(set_to_none=True)

        def step(self) -> None:
            self.optimizer.step()

    shape = (3, 32, 32) if model_name.startswith("cifar") else (40,)
    x = torch.randn(48, *shape, generator=torch.Generator().manual_seed(0))
    y = torch.arange(48) % 4
    settings = SGDSettings(lr=0.05, momentum=momentum, weight_decay=weight_decay, batch_size=16)

    def trained() -> dict[str, np.ndarray]:
        model = build_model(model_name, 10, seed=2)
        for parts in (("head",), ("body", "head")):  # a frozen part, then both
            train(
                model,
                x,
                y,
                parts=parts,
                epochs=3,
                settings=settings,
                generator=torch.Generator().manual_seed(5),
                max_grad_norm=clip,
            )
        return part_arrays(model, ("body", "head"))

    ours = trained()
    monkeypatch.setattr(training_module, "SGD", TorchSGD)
    theirs = trained()
    start = part_arrays(build_model(model_name, 10, seed=2), ("body", "head"))
    assert any(not np.array_equal(ours[k], start[k]) for k in ours)  # it trained
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_sgd_skips_a_parameter_without_a_gradient_as_torch_does() -> None:
    used, unused = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    optimizer = _sgd([used, unused])
    (used * torch.arange(4.0).reshape(2, 2)).sum().backward()
    optimizer.step()
    np.testing.assert_array_equal(unused.detach().numpy(), np.ones(2))
    # weight decay 0.1 on the 2-D tensor, lr 0.5: 1 - 0.5 * (g + 0.1 * 1)
    expected = 1 - 0.5 * (np.arange(4.0).reshape(2, 2) + 0.1)
    np.testing.assert_allclose(used.detach().numpy(), expected, rtol=1e-6)
    optimizer.zero_grad()
    assert used.grad is None


def _sgd(params: list[torch.nn.Parameter]) -> object:
    from fedpers.training import SGD

    return SGD(params, SGDSettings(lr=0.5, momentum=0.0, weight_decay=0.1, batch_size=1))


def test_training_does_not_import_torch_dynamo() -> None:
    """A fresh process trains without importing torch._dynamo (seconds of start-up in
    every cold ClientApp and Ray actor; fedpers.training's docstring)."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from fedpers.models import build_model\n"
        "from fedpers.training import SGDSettings, train\n"
        "m = build_model('mnist1d-mlp', 10, seed=0)\n"
        "x, y = torch.randn(8, 40), torch.arange(8) % 10\n"
        "s = SGDSettings(lr=0.1, momentum=0.9, weight_decay=0.1, batch_size=4)\n"
        "train(m, x, y, parts=('body', 'head'), epochs=1, settings=s,\n"
        "      generator=torch.Generator(), max_grad_norm=1.0)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "False"
