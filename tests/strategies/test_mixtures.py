"""FedGMM and FedEM strategies through the real ClientApp, in process (no Ray)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from numpy.testing import assert_allclose
from sklearn.mixture import GaussianMixture

from fedpers import protocol
from fedpers.clients.client_app import app as client_app
from fedpers.config import RunConfig
from fedpers.data.client import adaptation_split, client_data
from fedpers.families import mixture as mixture_family
from fedpers.protocol import UnseenTest
from fedpers.strategies import build_strategy
from fedpers.strategies.fedgmm import FedGMM
from tests.helpers import InProcessGrid, Node, run_config

MIXTURE = {
    "dataset": "mixture",
    "samples_per_client": 200,
    "mixture_dim": 4,
    "lr": 0.5,
    "momentum": 0.0,
    "weight_decay": 0.0,
    "batch_size": 64,
    "epochs": 1,
}


def _config(config: RunConfig, epochs: int | None = None) -> ConfigRecord:
    return ConfigRecord(
        {
            protocol.EPOCHS: config.epochs if epochs is None else epochs,
            protocol.LR: config.lr,
        }
    )


def _setup(**overrides: object) -> tuple[InProcessGrid, RunConfig, FedGMM]:
    values = run_config(**{**MIXTURE, "algorithm": "fedgmm", **overrides})
    config = RunConfig.from_mapping(values)
    grid = InProcessGrid(client_app, values, config.num_clients)
    strategy = build_strategy(config)
    assert isinstance(strategy, FedGMM)
    strategy.federation.connect(grid, timeout=5)
    return grid, config, strategy


def test_one_client_with_fixed_learners_is_sklearn_em_on_the_embeddings() -> None:
    # One learner that never trains: its likelihood is the same in every cell, so the
    # E-step is the GMM's alone and the rounds are EM iterations over the client's data.
    grid, config, strategy = _setup(
        num_clients=1,
        fraction_train=1.0,
        mixture_learners=1,
        gmm_ridge=1e-6,
        samples_per_client=400,
    )
    initial = strategy.initial_arrays(grid, timeout=5)
    means, covariances = (
        initial[mixture_family.GMM_MEANS].numpy(),
        initial[mixture_family.GMM_COVARIANCES].numpy(),
    )
    result = strategy.start(grid, initial, num_rounds=12, train_config=_config(config, epochs=0))
    z = client_data(config, 0).x_train.astype(float)
    oracle = GaussianMixture(
        3,
        covariance_type="full",
        reg_covar=1e-6,
        tol=0.0,
        max_iter=12,
        weights_init=np.full(3, 1 / 3),
        means_init=means,
        precisions_init=np.linalg.inv(covariances),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle.fit(z)
    assert_allclose(result.arrays[mixture_family.GMM_MEANS].numpy(), oracle.means_, atol=1e-6)
    assert_allclose(
        result.arrays[mixture_family.GMM_COVARIANCES].numpy(), oracle.covariances_, atol=1e-6
    )
    personal = grid.contexts[grid.node_of(0)].state[protocol.STATE_PERSONAL]
    assert_allclose(
        personal[mixture_family.MIXTURE_WEIGHTS].numpy().ravel(), oracle.weights_, atol=1e-6
    )


def test_all_clients_start_from_the_same_components_and_pi_stays_home() -> None:
    grid, config, strategy = _setup(num_clients=8, fraction_train=0.5)
    initial = strategy.initial_arrays(grid, timeout=5)
    strategy.start(grid, initial, num_rounds=2, train_config=_config(config))
    trains = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    first_round = [m for m in trains if m.content[protocol.CONFIG][protocol.ROUND] == 1]
    reference = first_round[0].content[protocol.ARRAYS][mixture_family.GMM_MEANS].numpy()
    assert all(
        np.array_equal(m.content[protocol.ARRAYS][mixture_family.GMM_MEANS].numpy(), reference)
        for m in first_round
    )
    assert np.array_equal(reference, initial[mixture_family.GMM_MEANS].numpy())
    # Replies carry statistics, gamma and learners, never the personal weights.
    for context in grid.contexts.values():
        if protocol.STATE_PERSONAL in context.state:
            assert mixture_family.MIXTURE_WEIGHTS in context.state[protocol.STATE_PERSONAL]


def test_unseen_clients_only_take_part_in_the_final_evaluation() -> None:
    grid, config, strategy = _setup(num_clients=10, fraction_train=0.5, unseen_fraction=0.2)
    initial = strategy.initial_arrays(grid, timeout=5)
    result = strategy.start(
        grid, initial, num_rounds=3, train_config=_config(config), evaluate_config=_config(config)
    )
    unseen_nodes = {grid.node_of(8), grid.node_of(9)}
    to_unseen = [m for m in grid.sent if m.metadata.dst_node_id in unseen_nodes]
    # Before the end they take part only in start-up: which partition they hold, and the
    # vote on the initial model (the digest of what they build)
    assert {m.metadata.message_type for m in to_unseen} == {
        protocol.QUERY_INFO,
        protocol.QUERY_INITIAL,
    }
    votes = [m for m in to_unseen if m.metadata.message_type == protocol.QUERY_INITIAL]
    assert all(m.content[protocol.CONFIG][protocol.DIGEST] == 1 for m in votes)
    before = len(grid.sent)
    final = strategy.final_test(grid, result.arrays, _config(config), server_round=4, timeout=5)
    finals = grid.sent[before:]
    assert {m.metadata.dst_node_id for m in finals} == unseen_nodes
    assert all(m.content[protocol.CONFIG][protocol.UNSEEN] == 1 for m in finals)
    assert isinstance(final, UnseenTest)
    assert 0.0 <= final.accuracy <= 1.0


def test_the_unseen_accuracy_weighs_each_client_by_the_samples_it_was_tested_on() -> None:
    # Before: an unseen client registered its test split's size (41, 32, 57 here) but is
    # tested on the part of all its data it did not adapt on (83, 63, 115), so its test
    # reply was capped at the registered size ("num-examples 83.0 capped at 41") and the
    # unseen accuracy weighted by the wrong counts (0.10385 against 0.10345).
    grid, config, strategy = _setup(
        num_clients=10,
        fraction_train=0.5,
        unseen_fraction=0.3,
        dataset="digits",
        partitioner="dirichlet",
    )
    initial = strategy.initial_arrays(grid, timeout=5)
    result = strategy.start(
        grid, initial, num_rounds=1, train_config=_config(config), evaluate_config=_config(config)
    )
    final = strategy.final_test(grid, result.arrays, _config(config), server_round=2, timeout=5)
    assert isinstance(final, UnseenTest)
    unseen = range(config.seen_clients, config.num_clients)
    tested = {
        p: len(adaptation_split(client_data(config, p), config.adapt_fraction, config.seed, p)[3])
        for p in unseen
    }
    assert len(set(tested.values())) > 1  # sizes that differ, or the weights would not matter
    assert {p: strategy.federation.test_sizes[p] for p in unseen} == tested
    accuracy = {int(p): a for p, a in final.clients.items()}
    expected = sum(accuracy[p] * tested[p] for p in unseen) / sum(tested.values())
    assert final.accuracy == pytest.approx(expected, rel=1e-12)


def _fake_reply(node: int, arrays: dict[str, np.ndarray]) -> Message:
    request = Message(content=RecordDict(), message_type=MessageType.TRAIN, dst_node_id=node)
    request.metadata.__dict__["_message_id"] = f"f{node}"
    content = RecordDict(
        {
            protocol.ARRAYS: ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 10.0}),
        }
    )
    return Message(content=content, reply_to=request)


def test_non_finite_statistics_are_left_out_with_a_reason() -> None:
    grid, config, strategy = _setup(num_clients=4, fraction_train=1.0)
    initial = strategy.initial_arrays(grid, timeout=5)
    messages = list(strategy.configure_train(1, initial, _config(config), grid))
    replies = list(grid.send_and_receive(messages))
    good = {k: v.numpy() for k, v in replies[0].content[protocol.ARRAYS].items()}
    bad = dict(good)
    bad[mixture_family.STATS_SECOND] = np.full_like(good[mixture_family.STATS_SECOND], np.nan)
    # The loop's order: screen, then aggregate what was kept
    screened = strategy.screen(1, [replies[0], _fake_reply(grid.node_of(1), bad)])
    arrays, _ = strategy.aggregate_train(1, screened.kept)
    assert arrays is not None
    assert all(np.all(np.isfinite(a.numpy())) for a in arrays.values())
    assert screened.rejected == [(1, "non-finite values in array 'arrays/stats.second'")]
    alone, _ = strategy.aggregate_train(2, [replies[0]])
    assert alone is not None
    assert_allclose(
        arrays[mixture_family.GMM_MEANS].numpy(), alone[mixture_family.GMM_MEANS].numpy()
    )


@pytest.mark.parametrize("algorithm", ["fedgmm", "fedem"])
def test_mixtures_learn_the_synthetic_task(algorithm: str) -> None:
    values = run_config(
        **{**MIXTURE, "algorithm": algorithm, "num_clients": 6, "fraction_train": 1.0}
    )
    config = RunConfig.from_mapping(values)
    grid = InProcessGrid(client_app, values, 6)
    strategy = build_strategy(config)
    strategy.federation.connect(grid, timeout=5)
    records: list = []
    strategy.start(
        grid,
        strategy.initial_arrays(grid, timeout=5),
        num_rounds=15,
        train_config=_config(config),
        evaluate_config=_config(config),
        on_round=records.append,
    )
    accuracies = [r.evaluate[protocol.ACCURACY] for r in records]
    assert accuracies[-1] > 0.65  # binary labels: chance is about 0.5
    assert accuracies[-1] > accuracies[0]


def test_a_client_sent_the_wrong_learners_is_refused_with_their_names() -> None:
    config = RunConfig.from_mapping(run_config(**{**MIXTURE, "algorithm": "fedem"}))
    node = Node(config, 0)
    arrays = node.initial_arrays()
    missing = next(name for name in arrays if name.startswith("learner1."))
    del arrays[missing]
    train = ConfigRecord({protocol.ROUND: 1, protocol.EPOCHS: 1, protocol.LR: 0.5})
    with pytest.raises(ValueError, match="expected learner 1 arrays"):
        node.fit(arrays, train)
    assert protocol.STATE_PERSONAL not in node.state  # nothing kept from a refused round
