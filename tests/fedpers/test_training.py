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
