"""Strategies, tested without Ray: aggregation against hand-computed averages on fake
replies, and whole rounds through an in-process grid that runs the real ClientApp."""

import io
from collections.abc import Iterable

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
from scipy.linalg import orth

from fedpers import linear, protocol
from fedpers.clients.client_app import app as client_app
from fedpers.config import RunConfig
from fedpers.families import linear as linear_family
from fedpers.families import personalized as personalized_family
from fedpers.results import RoundRecord
from fedpers.strategies import build_strategy
from fedpers.strategies.base import FedpersStrategy
from fedpers.strategies.federation import PopulationError
from fedpers.strategies.fedrep import FedRepLinear
from tests.helpers import InProcessGrid, run_config


def _strategy(**overrides: object) -> FedpersStrategy:
    return build_strategy(RunConfig.from_mapping(run_config(**overrides)))


def _reply(to_node: int, arrays: dict[str, np.ndarray], num_examples: float) -> Message:
    request = Message(content=RecordDict(), message_type=MessageType.TRAIN, dst_node_id=to_node)
    request.metadata.__dict__["_message_id"] = f"m{to_node}"
    content = RecordDict(
        {
            protocol.ARRAYS: ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            protocol.METRICS: MetricRecord(
                {protocol.NUM_EXAMPLES: num_examples, protocol.LOSS: 1.0}
            ),
        }
    )
    return Message(content=content, reply_to=request)


def _sent(strategy: FedpersStrategy, arrays: dict[str, np.ndarray]) -> None:
    """What the strategy sent this round (the replies are screened against it)."""
    record = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    strategy.train_contents(1, record, ConfigRecord(), grid=None)  # type: ignore[arg-type]


def test_fedrep_averages_the_body_weighted_by_examples() -> None:
    strategy = _strategy(num_clients=3)
    _sent(strategy, {"body.w": np.zeros((2, 2), dtype=np.float32)})
    bodies = [np.full((2, 2), v, dtype=np.float32) for v in (1.0, 2.0, 4.0)]
    replies = [
        _reply(n, {"body.w": b}, w) for n, (b, w) in enumerate(zip(bodies, (1, 1, 2), strict=True))
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None
    assert metrics is not None
    assert_allclose(arrays["body.w"].numpy(), (1.0 + 2.0 + 2 * 4.0) / 4)
    assert metrics[protocol.LOSS] == pytest.approx(1.0)


def test_linear_fedrep_orthonormalizes_the_average() -> None:
    strategy = _strategy(num_clients=2, dataset="linear", linear_rank=2)
    assert isinstance(strategy, FedRepLinear)
    generator = np.random.default_rng(0)
    b1, b2 = generator.standard_normal((6, 2)), generator.standard_normal((6, 2))
    _sent(strategy, {"body.weight": np.zeros((2, 6))})
    replies = [_reply(0, {"body.weight": b1.T}, 5), _reply(1, {"body.weight": b2.T}, 5)]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    result = arrays["body.weight"].numpy().T
    assert_allclose(result.T @ result, np.eye(2), atol=1e-12)
    average_space = orth((b1 + b2) / 2)  # scipy's SVD basis of the same column space
    assert linear.principal_angle_distance(result, average_space) < 1e-10


def test_sampling_is_seeded_sized_and_by_partition() -> None:
    strategy = _strategy(num_clients=100, fraction_train=0.1, seed=3)
    samples = [strategy.sample(r) for r in range(1, 51)]
    assert all(len(s) == 10 and len(set(s)) == 10 for s in samples)
    again = _strategy(num_clients=100, fraction_train=0.1, seed=3)
    assert samples == [again.sample(r) for r in range(1, 51)]
    other = _strategy(num_clients=100, fraction_train=0.1, seed=4)
    assert samples != [other.sample(r) for r in range(1, 51)]
    # Over 200 rounds every partition is drawn (a uniform sampler misses one with
    # probability 100 * 0.9**200 < 1e-7) and none is drawn far too often.
    draws = np.concatenate([strategy.sample(r) for r in range(1, 201)])
    counts = np.bincount(draws, minlength=100)
    assert counts.min() >= 1
    assert counts.max() <= 45
    assert len(_strategy(num_clients=10, fraction_train=0.1).sample(1)) == 1


def _grid(num_nodes: int, **overrides: object) -> tuple[InProcessGrid, RunConfig]:
    values = run_config(dataset="digits", num_clients=num_nodes, **overrides)
    return InProcessGrid(client_app, values, num_nodes), RunConfig.from_mapping(values)


def test_connect_maps_partitions_to_scrambled_node_ids() -> None:
    grid, config = _grid(6)
    strategy = build_strategy(config)
    strategy.federation.connect(grid, timeout=5)
    assert strategy.federation.node_of_partition == {p: grid.node_of(p) for p in range(6)}
    assert sum(strategy.federation.train_sizes.values()) > 0


def test_connect_fails_clearly_when_nodes_are_missing_or_duplicated() -> None:
    grid, _ = _grid(3)
    with pytest.raises(PopulationError, match="num-supernodes=5"):
        _strategy(num_clients=5).federation.connect(grid, timeout=0.3, poll=0.1)
    grid.contexts[grid.node_of(2)].node_config["partition-id"] = 1
    with pytest.raises(PopulationError, match="both hold partition 1"):
        _strategy(num_clients=3).federation.connect(grid, timeout=1)


class _Recorder:
    def __init__(self) -> None:
        self.records: list[RoundRecord] = []

    def __call__(self, record: RoundRecord) -> None:
        self.records.append(record)


def _train_config(config: RunConfig) -> ConfigRecord:
    return ConfigRecord(
        {
            protocol.EPOCHS: 1,
            protocol.HEAD_EPOCHS: 2,
            protocol.LR: config.lr,
        }
    )


def _run(
    strategy: FedpersStrategy, grid: InProcessGrid, config: RunConfig, rounds: int
) -> _Recorder:
    recorder = _Recorder()
    strategy.federation.connect(grid, timeout=5)
    strategy.start(
        grid,
        strategy.initial_arrays(grid, timeout=5),
        num_rounds=rounds,
        train_config=_train_config(config),
        evaluate_config=_train_config(config),
        on_round=recorder,
    )
    return recorder


def _messages(grid: InProcessGrid, kind: str) -> list[Message]:
    return [m for m in grid.sent if m.metadata.message_type == kind]


def test_fedrep_rounds_send_only_the_body_and_evaluate_every_node() -> None:
    grid, config = _grid(10, fraction_train=0.3)
    strategy = build_strategy(config)
    recorder = _run(strategy, grid, config, rounds=2)
    trains = _messages(grid, MessageType.TRAIN)
    evaluations = _messages(grid, MessageType.EVALUATE)
    assert len(trains) == 2 * 3
    assert len(evaluations) == 2 * 10
    assert all({k.split(".")[0] for k in m.content[protocol.ARRAYS]} == {"body"} for m in trains)
    assert [r.round for r in recorder.records] == [1, 2]
    assert all(r.sampled == 3 and r.replies == 3 and r.failures == 0 for r in recorder.records)
    # Evaluation is weighted by test samples: recompute it from the per-node numbers.
    assert 0.0 < recorder.records[-1].evaluate[protocol.ACCURACY] <= 1.0
    trained = {m.metadata.dst_node_id for m in trains}
    heads = {
        n: grid.contexts[n].state[protocol.STATE_PERSONAL]["head.weight"].numpy() for n in trained
    }
    assert len({h.tobytes() for h in heads.values()}) == len(heads)  # personal heads differ
    untrained = set(grid.contexts) - trained
    assert all(protocol.STATE_PERSONAL not in grid.contexts[n].state for n in untrained)


def test_local_sends_no_arrays() -> None:
    grid, config = _grid(4, algorithm="local", fraction_train=0.5)
    strategy = build_strategy(config)
    assert type(strategy).__mro__[1] is FedpersStrategy  # Local's: its sample only
    assert strategy.shared == ()
    _run(strategy, grid, config, rounds=1)
    assert all(len(m.content[protocol.ARRAYS]) == 0 for m in _messages(grid, MessageType.TRAIN))


@pytest.mark.parametrize("algorithm", ["fedavg-ft", "fedbabu"])
def test_final_test_finetunes_every_node(algorithm: str) -> None:
    grid, config = _grid(4, algorithm=algorithm, fraction_train=0.5)
    strategy = build_strategy(config)
    _run(strategy, grid, config, rounds=2)
    before = len(grid.sent)
    final = strategy.final_test(
        grid,
        strategy.initial_arrays(grid, timeout=5),
        _train_config(config),
        server_round=3,
        timeout=5,
    )
    finals = [m for m in grid.sent[before:] if m.metadata.message_type == MessageType.EVALUATE]
    assert len(finals) == 4
    assert all(
        m.content[protocol.CONFIG][protocol.FINETUNE_EPOCHS] == config.finetune_epochs
        for m in finals
    )
    assert isinstance(final, personalized_family.FinetunedTest)
    assert 0.0 <= final.accuracy <= 1.0


def test_evaluation_is_weighted_by_test_examples() -> None:
    strategy = _strategy(num_clients=2)
    replies: Iterable[Message] = [
        _metrics_reply(0, accuracy=1.0, examples=30),
        _metrics_reply(1, accuracy=0.0, examples=10),
    ]
    metrics = strategy.aggregate_evaluate(1, replies)
    assert metrics is not None
    assert metrics[protocol.ACCURACY] == pytest.approx(0.75)


def _metrics_reply(node: int, *, accuracy: float, examples: float) -> Message:
    request = Message(content=RecordDict(), message_type=MessageType.EVALUATE, dst_node_id=node)
    request.metadata.__dict__["_message_id"] = f"e{node}"
    record = MetricRecord({protocol.ACCURACY: accuracy, protocol.NUM_EXAMPLES: examples})
    return Message(content=RecordDict({protocol.METRICS: record}), reply_to=request)


def test_linear_fedrep_through_the_client_app_learns_the_subspace() -> None:
    values = run_config(dataset="linear", num_clients=20, fraction_train=0.5, linear_samples=20)
    grid = InProcessGrid(client_app, values, 20)
    config = RunConfig.from_mapping(values)
    strategy = build_strategy(config)
    strategy.federation.connect(grid, timeout=5)
    initial = strategy.initial_arrays(grid, timeout=5)
    from fedpers.data.synthetic import LinearTasks

    truth = LinearTasks(
        10, 2, linear_family.settings(config).linear_noise_std, config.seed
    ).representation
    start = linear.principal_angle_distance(initial["body.weight"].numpy().T, truth)
    train = ConfigRecord({protocol.LR: 0.4})
    result = strategy.start(grid, initial, num_rounds=40, train_config=train)
    end = linear.principal_angle_distance(result.arrays["body.weight"].numpy().T, truth)
    assert end < 1e-2 < start


@pytest.mark.parametrize("algorithm", ["fedrep", "fedgmm", "ifca"])
def test_evaluate_every_keeps_the_final_rounds_and_does_not_touch_training(
    algorithm: str,
) -> None:
    """Evaluating less often changes which rounds are evaluated, never what is learned:
    the same run evaluated every round and every 3rd round ends with identical metrics
    (the final rounds are always evaluated, since the final accuracy is their mean)."""
    final: dict[int, dict[str, float]] = {}
    for every in (1, 3):
        grid, config = _grid(
            6, algorithm=algorithm, fraction_train=0.5, evaluate_every=every, final_rounds=2
        )
        recorder = _run(build_strategy(config), grid, config, rounds=5)
        evaluated = [r.round for r in recorder.records if r.evaluate]
        assert evaluated == ([1, 2, 3, 4, 5] if every == 1 else [3, 4, 5])
        final[every] = recorder.records[-1].evaluate
    assert final[1] == final[3]


def test_each_clients_accuracy_is_recorded_and_averages_to_the_round_figure() -> None:
    grid, config = _grid(6, algorithm="fedrep", fraction_train=0.5)
    records = _run(build_strategy(config), grid, config, rounds=2).records
    last = records[-1]
    assert set(last.clients) == {str(p) for p in range(6)}
    # Oracle: the test-weighted mean of the per-client figures, computed here.
    weights = np.array([v[protocol.NUM_EXAMPLES] for v in last.clients.values()])
    accuracies = np.array([v[protocol.ACCURACY] for v in last.clients.values()])
    assert float(weights @ accuracies / weights.sum()) == pytest.approx(
        last.evaluate[protocol.ACCURACY], rel=1e-12
    )


def test_round_bytes_are_what_the_messages_carry() -> None:
    grid, config = _grid(10, algorithm="fedrep", fraction_train=0.3)
    strategy = build_strategy(config)
    records = _run(strategy, grid, config, rounds=2).records
    body = sum(a.numpy().nbytes for a in strategy.initial_arrays(grid, timeout=5).values())
    for record in records:
        sampled = record.sampled
        sent, received = record.server["bytes-sent"], record.server["bytes-received"]
        # The arrays' data is the bulk; names, config and metrics add under 4 kB a message.
        assert sampled * body <= sent <= sampled * (body + 4096)
        assert record.replies * body <= received <= record.replies * (body + 4096)
        # evaluation: the body to all 10 clients, and their metrics back
        assert 10 * body <= record.server["evaluate-bytes"] <= 10 * (body + 8192)

    # Exactly: each array as NumPy serializes it (.npy: header + data), its name, and
    # the config record's keys and values.
    def npy(array: np.ndarray) -> int:
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        return len(buffer.getvalue())

    train_messages = _messages(grid, MessageType.TRAIN)
    assert sum(r.server["bytes-sent"] for r in records) == sum(
        sum(npy(a.numpy()) + len(k) for k, a in m.content[protocol.ARRAYS].items())
        + m.content[protocol.CONFIG].count_bytes()
        for m in train_messages
    )


def test_the_logged_summary_names_a_long_per_client_mapping_by_its_size() -> None:
    """The summary's log line stays short at 10,000 clients: a mapping of more than 20
    entries is named by its size and the file that holds it; the rest is as written."""
    from pathlib import Path

    from fedpers.strategies.server_app import _loggable

    clients = {str(c): c / 100 for c in range(10_000)}
    few = {str(c): c / 100 for c in range(20)}
    summary = {"final_accuracy": 0.43, "client_accuracy": clients, "few": few}
    logged = _loggable(summary, Path("runs/x"))
    assert logged["final_accuracy"] == 0.43
    assert logged["few"] == few
    assert logged["client_accuracy"] == "<10000 entries: runs/x/summary.json>"
    assert len(str(logged)) < 400 < len(str(summary))
