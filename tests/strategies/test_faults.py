"""Faults injected on purpose, in process (no Ray): what is left out, why, and when a
round fails. Determinism: the same seed gives the same rounds, for every algorithm."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import Message

from fedpers.clients.client_app import app as client_app
from fedpers.config import RunConfig
from fedpers.results import RoundRecord
from fedpers.strategies import build_strategy
from fedpers.strategies.rounds import RoundFailedError
from tests.helpers import InProcessGrid, run_config


def _run(
    rounds: int,
    *,
    drop: set[int] | None = None,
    recorded: list[RoundRecord] | None = None,
    timeout: float = 5,
    **overrides: Any,
) -> tuple[list[RoundRecord], Any, InProcessGrid]:
    values = run_config(
        **{"dataset": "digits", "num_clients": 6, "fraction_train": 1.0, **overrides}
    )
    config = RunConfig.from_mapping(values)

    def fail(node: int, message: Message) -> str | None:  # nodes that never answer TRAIN
        dropped = {grid.node_of(p) for p in drop or set()}
        training = message.metadata.message_type == "train"
        return InProcessGrid.DROP if training and node in dropped else None

    grid = InProcessGrid(client_app, values, config.num_clients, fail=fail)
    strategy = build_strategy(config)
    strategy.federation.connect(grid, timeout=5)
    records: list[RoundRecord] = [] if recorded is None else recorded
    result = strategy.start(
        grid,
        strategy.initial_arrays(grid, timeout=5),
        num_rounds=rounds,
        timeout=timeout,
        on_round=records.append,
    )
    return records, result, grid


def test_faulty_replies_are_left_out_with_their_reasons() -> None:
    records, result, _ = _run(2, fault_injection="nan:2@1,shape:3@1,dtype:4@1,raise:1@2")
    first, second = records
    assert (first.sampled, first.replies, first.failures) == (6, 3, 3)
    assert first.rejections == [
        "partition 2: non-finite values in array 'arrays/body.0.weight'",
        "partition 3: array 'body.0.weight' is float32[129, 64], expected float32[128, 64]",
        "partition 4: array 'body.0.weight' is float16[128, 64], expected float32[128, 64]",
    ]
    assert (second.replies, second.failures) == (5, 1)
    assert second.rejections[0].startswith("partition 1: client error: ")
    assert "injected fault in round 2" in second.rejections[0]
    assert all(np.all(np.isfinite(a.numpy())) for a in result.arrays.values())


def test_a_missing_reply_is_recorded() -> None:
    records, _, _ = _run(1, drop={5}, timeout=1)
    assert records[0].failures == 1
    assert records[0].rejections == ["partition 5: no reply within 1 s"]


def test_too_few_usable_replies_fail_the_round_after_recording_it() -> None:
    recorded: list[RoundRecord] = []
    with pytest.raises(
        RoundFailedError, match="round 2: 3 usable replies of 6, fewer than min-replies = 4"
    ):
        _run(3, min_replies=4, fault_injection="raise:0@2,raise:1@2,raise:2@2", recorded=recorded)
    assert [r.round for r in recorded] == [1, 2]  # the failing round is written first
    assert recorded[1].failures == 3


@pytest.mark.parametrize(
    "overrides",
    [
        {"algorithm": "fedrep"},
        {"algorithm": "fedper"},
        {"algorithm": "fedavg"},
        {"algorithm": "lg-fedavg"},
        {"algorithm": "local"},
        {"algorithm": "fedavg-ft"},
        {"algorithm": "fedrep", "dataset": "linear"},
        {"algorithm": "fedsgd", "dataset": "linear"},
        {"algorithm": "fedem", "dataset": "mixture", "samples_per_client": 120, "mixture_dim": 4},
        {"algorithm": "fedgmm", "dataset": "mixture", "samples_per_client": 120, "mixture_dim": 4},
        {"algorithm": "sheaf-frl", "epochs": 1},
        {"algorithm": "non-cooperative", "epochs": 1},
    ],
    ids=lambda o: "-".join(str(v) for v in o.values()),
)
def test_same_seed_same_rounds(overrides: dict[str, Any]) -> None:
    first, result_a, _ = _run(2, **overrides)
    second, result_b, _ = _run(2, **overrides)
    for a, b in zip(first, second, strict=True):
        assert (a.train, a.evaluate, a.server) == (b.train, b.evaluate, b.server)
    for name, array in result_a.arrays.items():
        np.testing.assert_array_equal(array.numpy(), result_b.arrays[name].numpy())
