"""Clients: what each algorithm trains, shares and keeps, checked on real models."""

from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from numpy.testing import assert_allclose, assert_array_equal

from fedpers import linear, protocol
from fedpers.config import RunConfig
from fedpers.data.synthetic import LinearTasks
from fedpers.seeding import rng
from tests.helpers import client_of, run_config

TRAIN = {
    protocol.ROUND: 1,
    protocol.EPOCHS: 1,
    protocol.HEAD_EPOCHS: 2,
    protocol.LR: 0.05,
}


def _client(
    algorithm: str, state: RecordDict | None = None, partition: int = 0, **overrides: Any
) -> Any:
    run = RunConfig.from_mapping(
        run_config(algorithm=algorithm, dataset="digits", num_clients=10, **overrides)
    )
    return client_of(run, partition, state)


@pytest.mark.parametrize(
    ("algorithm", "shared", "kept"),
    [
        ("fedrep", {"body"}, {"head"}),
        ("fedper", {"body"}, {"head"}),
        ("fedavg", {"body", "head"}, set()),
        ("lg-fedavg", {"head"}, {"body"}),
        ("local", set(), {"body", "head"}),
        ("fedbabu", {"body"}, {"head"}),
    ],
)
def test_each_algorithm_shares_and_keeps_its_parts(algorithm: str, shared: set, kept: set) -> None:
    state = RecordDict()
    client = _client(algorithm, state)
    arrays, metrics = client.fit(client.initial_arrays(), ConfigRecord(TRAIN))
    assert {name.split(".")[0] for name in arrays} == shared
    stored = state.get(protocol.STATE_PERSONAL)
    assert ({name.split(".")[0] for name in stored} if stored is not None else set()) == kept
    assert metrics[protocol.NUM_EXAMPLES] == len(client.data.y_train)


def test_fedrep_trains_head_then_body(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedpers import update

    calls: list[tuple[tuple[str, ...], int]] = []
    real_train = update.train

    def recording_train(*args: Any, **kwargs: Any) -> Any:
        calls.append((kwargs["parts"], kwargs["epochs"]))
        return real_train(*args, **kwargs)

    monkeypatch.setattr(update, "train", recording_train)
    client = _client("fedrep")
    client.fit(
        client.initial_arrays(),
        ConfigRecord({**TRAIN, protocol.HEAD_EPOCHS: 10, protocol.EPOCHS: 5}),
    )
    assert calls == [(("head",), 10), (("body",), 5)]
    calls.clear()
    fedper = _client("fedper")
    fedper.fit(fedper.initial_arrays(), ConfigRecord({**TRAIN, protocol.EPOCHS: 5}))
    assert calls == [(("body", "head"), 5)]


def test_personal_head_persists_across_rounds_and_is_restored() -> None:
    from fedpers.models import build_model, part_arrays
    from fedpers.seeding import int_seed

    state = RecordDict()
    first = _client("fedrep", state)
    body, _ = first.fit(first.initial_arrays(), ConfigRecord(TRAIN))
    head_after_round_1 = {k: v.numpy().copy() for k, v in state[protocol.STATE_PERSONAL].items()}
    # a fresh process: only context.state survives, and round 2 trains from that head
    second = _client("fedrep", state)
    config = ConfigRecord({**TRAIN, protocol.ROUND: 2, protocol.HEAD_EPOCHS: 0, protocol.EPOCHS: 0})
    second.fit(body, config)  # no steps: the head comes back as it was restored
    for name, value in head_after_round_1.items():
        assert_array_equal(state[protocol.STATE_PERSONAL][name].numpy(), value)
    seeded = build_model("digits-mlp", 10, int_seed(0, "model"))
    initial_head = part_arrays(seeded, ("head",))  # a client never trained keeps this head
    assert any(not np.array_equal(initial_head[k], v) for k, v in head_after_round_1.items())
    assert set(body) == set(part_arrays(seeded, ("body",)))


def test_finetuned_evaluation_does_not_store_the_finetuned_head() -> None:
    state = RecordDict()
    client = _client("fedavg-ft", state)
    arrays = client.initial_arrays()
    plain = client.evaluate(arrays, ConfigRecord({**TRAIN, protocol.FINETUNE_EPOCHS: 0}))
    tuned = _client("fedavg-ft", state).evaluate(
        arrays, ConfigRecord({**TRAIN, protocol.FINETUNE_EPOCHS: 10})
    )
    assert tuned[protocol.ACCURACY] > plain[protocol.ACCURACY]
    assert protocol.STATE_PERSONAL not in state
    again = _client("fedavg-ft", state).evaluate(
        arrays, ConfigRecord({**TRAIN, protocol.FINETUNE_EPOCHS: 0})
    )
    assert again == plain


def test_wrong_shared_arrays_are_rejected_with_the_expected_names() -> None:
    client = _client("fedrep")
    arrays = client.initial_arrays()
    arrays.pop(next(iter(arrays)))
    with pytest.raises(ValueError, match="expected shared arrays"):
        client.fit(arrays, ConfigRecord(TRAIN))


# -------------------------------------------------------------------- linear model
def _linear_client(algorithm: str, state: RecordDict, head_steps: int = 0) -> Any:
    run = RunConfig.from_mapping(
        run_config(
            algorithm=algorithm,
            dataset="linear",
            num_clients=10,
            linear_head_steps=head_steps,
        )
    )
    return client_of(run, 3, state)


def _linear_samples(purpose: str, server_round: int, partition: int = 3) -> Any:
    """A linear client's fresh samples, drawn independently from its own stream."""
    tasks = LinearTasks(10, 2, 0.0316, 0)
    return tasks.sample(partition, 5, rng(0, "linear", purpose, partition, server_round))


def _stored_head(state: RecordDict) -> np.ndarray:
    """The head a linear client keeps in its ``context.state``."""
    record = state[protocol.STATE_PERSONAL]
    assert isinstance(record, ArrayRecord)
    head: np.ndarray = record["head.weight"].numpy()[0]
    return head


def test_linear_fedrep_solves_the_head_exactly_then_steps_on_b() -> None:
    state = RecordDict()
    client = _linear_client("fedrep", state)
    b = linear.orthonormalize(np.random.default_rng(0).standard_normal((10, 2)))
    arrays, _ = client.fit({"body.weight": b.T}, ConfigRecord(TRAIN))
    # Independent recomputation from the same stream of fresh samples.
    tasks = LinearTasks(10, 2, 0.0316, 0)
    x, y = tasks.sample(3, 5, rng(0, "linear", "train", 3, 1))
    head, *_ = np.linalg.lstsq(x @ b, y, rcond=None)
    assert_allclose(_stored_head(state), head, atol=1e-12)
    residual = y - x @ b @ head
    expected = b + 0.05 * np.outer(x.T @ residual, head) / 5
    assert_allclose(arrays["body.weight"].T, expected, atol=1e-12)


def test_gd_gd_takes_gradient_steps_from_the_stored_head() -> None:
    state = RecordDict()
    client = _linear_client("fedrep", state, head_steps=1)
    b = linear.orthonormalize(np.random.default_rng(1).standard_normal((10, 2)))
    config = ConfigRecord(TRAIN)
    client.fit({"body.weight": b.T}, config)
    x, y = _linear_samples("train", 1)
    assert_allclose(
        _stored_head(state), -0.4 * linear.head_gradient(x, y, b, np.zeros(2)), atol=1e-12
    )


def test_fedsgd_client_steps_on_both_parts() -> None:
    client = _linear_client("fedsgd", RecordDict())
    b, w = np.random.default_rng(2).standard_normal((10, 2)), np.array([0.3, -0.2])
    arrays, _ = client.fit({"body.weight": b.T, "head.weight": w[None, :]}, ConfigRecord(TRAIN))
    x, y = _linear_samples("train", 1)
    assert_allclose(arrays["body.weight"].T, b - 0.05 * linear.representation_gradient(x, y, b, w))
    assert_allclose(arrays["head.weight"][0], w - 0.05 * linear.head_gradient(x, y, b, w))


@pytest.mark.parametrize("algorithm", ["fedrep", "fedsgd"])
def test_linear_clients_answer_the_moments_query_from_their_own_samples(algorithm: str) -> None:
    client = _linear_client(algorithm, RecordDict())
    [(arrays, metrics)] = client.call("moments", {})
    x, y = _linear_samples("moments", 0)
    assert_allclose(arrays["moments"], (x * (y**2)[:, None]).T @ x / 5, atol=1e-12)
    assert metrics == {protocol.NUM_EXAMPLES: 5.0}


def test_linear_fedrep_evaluates_with_the_kept_head_or_one_solved_on_fresh_samples() -> None:
    state = RecordDict()
    client = _linear_client("fedrep", state)
    b = linear.orthonormalize(np.random.default_rng(3).standard_normal((10, 2)))
    x_test, y_test = LinearTasks(10, 2, 0.0316, 0).sample(3, 1000, rng(0, "linear", "test", 3, 2))
    untrained = client.evaluate({"body.weight": b.T}, ConfigRecord({protocol.ROUND: 2}))
    x, y = _linear_samples("train", 0)  # a client that never trained solves on these
    head, *_ = np.linalg.lstsq(x @ b, y, rcond=None)
    assert untrained[protocol.NUM_EXAMPLES] == 1000.0
    assert_allclose(untrained[protocol.LOSS], np.mean((y_test - x_test @ b @ head) ** 2))
    client.fit({"body.weight": b.T}, ConfigRecord(TRAIN))
    trained = client.evaluate({"body.weight": b.T}, ConfigRecord({protocol.ROUND: 2}))
    kept = _stored_head(state)
    assert_allclose(trained[protocol.LOSS], np.mean((y_test - x_test @ b @ kept) ** 2))


def test_a_linear_client_refuses_arrays_without_its_model() -> None:
    client = _linear_client("fedsgd", RecordDict())
    with pytest.raises(ValueError, match=r"expected arrays \['body.weight', 'head.weight'\]"):
        client.fit({"body.weight": np.zeros((2, 10))}, ConfigRecord(TRAIN))


def test_a_linear_cohort_that_fails_keeps_no_members_head() -> None:
    from fedpers.cohort import Cohort, Member

    client = _linear_client("fedrep", RecordDict(), head_steps=1)
    good = Member(3, RecordDict(), {"body.weight": np.eye(10)[:2]})
    bad = Member(4, RecordDict(), {"body.weight": np.zeros((2, 7))})
    fit = client.run.spec.update_function("fit", client.run.family)
    with pytest.raises(ValueError, match="mismatch"):  # numpy's, from the bad member's B
        fit(Cohort(client.run, ConfigRecord(TRAIN), [good, bad]))
    assert protocol.STATE_PERSONAL not in good.state  # its rerun alone starts afresh


def test_gmm_embedding_from_a_local_resnet18_file(tmp_path: Any) -> None:
    import torch
    import torchvision

    path = tmp_path / "resnet18.pt"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    run = RunConfig.from_mapping(
        run_config(
            algorithm="fedgmm",
            dataset="digits",
            num_clients=10,
            test_split="per-client",
            gmm_embedding="resnet18",
            gmm_encoder_weights=str(path),
            gmm_embedding_dim=8,
        )
    )
    from fedpers.algorithms import fedgmm

    node = client_of(run, 0)
    moments, _ = node.call("pca_moments", {})[0]
    assert moments["pca.sum"].shape == (512,)  # encoder features, not the 64 pixels
    directions = np.linalg.qr(np.random.default_rng(0).standard_normal((512, 8)))[0].T
    pca = {"pca.mean": np.zeros(512), "pca.directions": directions}
    z = fedgmm.embed(run, node.data.x_train, pca)
    assert z.shape == (len(node.data.y_train), 8)
    assert np.all(np.isfinite(z))


def test_fedbabu_trains_only_the_body_and_its_head_stays_the_shared_initial_one() -> None:
    from fedpers.models import build_model, part_arrays
    from fedpers.seeding import int_seed

    # Prepare: two clients of different partitions, same seeded model
    states = [RecordDict(), RecordDict()]
    clients = [_client("fedbabu", states[p], partition=p) for p in (0, 1)]
    initial_head = part_arrays(build_model("digits-mlp", 10, int_seed(0, "model")), ("head",))
    # Execute: a round of local training on each
    replies = [c.fit(c.initial_arrays(), ConfigRecord(TRAIN))[0] for c in clients]
    # Assert: only the body moved and went back; both heads are still the initial head
    for state, reply in zip(states, replies, strict=True):
        assert {name.split(".")[0] for name in reply} == {"body"}
        stored = state[protocol.STATE_PERSONAL]
        assert set(stored) == set(initial_head)
        for name, value in initial_head.items():
            np.testing.assert_array_equal(stored[name].numpy(), value)

    assert any(
        not np.array_equal(replies[0][name], replies[1][name]) for name in replies[0]
    )  # the bodies did train, on different data


def test_fedbabu_fine_tunes_its_whole_model_before_the_final_test() -> None:
    # Issue 42: FedBABU's experiments personalize by fine-tuning the whole model (and
    # Flower's FedBABU baseline puts every parameter in its fine-tuning optimizer); it
    # fine-tuned the head alone, the +FT protocol of FedRep's table. The oracle: the loop
    # fedpers ran before cohorts (tests/fedpers/reference_loop.py), from the seeded model,
    # on the client's training data, with the client's fine-tuning stream.
    import torch

    from fedpers.data.client import client_data
    from fedpers.models import build_model
    from fedpers.seeding import int_seed
    from fedpers.training import SGDSettings
    from tests.fedpers import reference_loop

    partition, server_round, epochs = 3, 7, 2
    client = _client("fedbabu", RecordDict(), partition=partition)
    run = client.run
    config = {protocol.ROUND: server_round, protocol.FINETUNE_EPOCHS: epochs, protocol.LR: 0.05}
    metrics = client.evaluate(client.initial_arrays(), ConfigRecord(config))
    data = client_data(run, partition)
    settings = SGDSettings(
        lr=0.05, momentum=run.momentum, weight_decay=run.weight_decay, batch_size=run.batch_size
    )

    def oracle(parts: tuple[str, ...]) -> Any:
        model = build_model("digits-mlp", 10, int_seed(run.seed, "model"))
        reference_loop.train(
            model,
            torch.tensor(data.x_train),
            torch.tensor(data.y_train, dtype=torch.int64),
            parts=parts,
            epochs=epochs,
            settings=settings,
            generator=torch.Generator().manual_seed(
                int_seed(run.seed, "finetune", partition, server_round)
            ),
        )
        x, y = torch.tensor(data.x_test), torch.tensor(data.y_test, dtype=torch.int64)
        return reference_loop.evaluate(model, x, y)

    whole = oracle(("body", "head"))
    assert metrics[protocol.ACCURACY] == whole.accuracy
    assert metrics[protocol.LOSS] == pytest.approx(whole.loss, rel=1e-6)
    head = oracle(("head",))  # what it did before: far from what it does now
    assert abs(metrics[protocol.LOSS] - head.loss) > 1e-3
