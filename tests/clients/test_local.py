"""Local's two budgets: with local-all-clients every client trains in every round, and
its models are then those of the same run at fraction-train 1 (bit for bit: the same
updates, drawn by the same seeds); without it, only the round's sample trains."""

from __future__ import annotations

import numpy as np
import pytest

from fedpers import protocol
from fedpers.config import load_run_config
from fedpers.settings import ConfigError
from tests.clients.test_fedprox import tiny_rounds
from tests.helpers import InProcessGrid

ROUNDS = 3


def _personal_models(grid: InProcessGrid, num_clients: int) -> dict[int, dict[str, np.ndarray]]:
    models = {}
    for partition in range(num_clients):
        state = grid.contexts[grid.node_of(partition)].state
        if protocol.STATE_PERSONAL in state:
            models[partition] = {k: v.numpy() for k, v in state[protocol.STATE_PERSONAL].items()}
    return models


def test_every_client_every_round_is_fraction_one_bit_for_bit() -> None:
    config, _, _, sampled, grid = tiny_rounds(
        ROUNDS, algorithm="local", fraction_train=0.25, local_all_clients=True
    )
    assert config.clients_per_round == 1
    assert sampled == [list(range(config.num_clients))] * ROUNDS
    everyone = _personal_models(grid, config.num_clients)
    assert sorted(everyone) == list(range(config.num_clients))
    _, _, _, full, full_grid = tiny_rounds(ROUNDS, algorithm="local", fraction_train=1.0)
    assert full == sampled
    expected = _personal_models(full_grid, config.num_clients)
    for partition, model in everyone.items():
        for name, value in model.items():
            np.testing.assert_array_equal(value, expected[partition][name])
    # and the default trains only the round's sample: one client a round here
    _, _, _, few, few_grid = tiny_rounds(ROUNDS, algorithm="local", fraction_train=0.25)
    assert [len(s) for s in few] == [1] * ROUNDS
    trained = {p for s in few for p in s}
    assert sorted(_personal_models(few_grid, config.num_clients)) == sorted(trained)


def test_every_client_local_is_refused_under_dp() -> None:
    with pytest.raises(ConfigError, match="'local-all-clients' = true trains every client"):
        load_run_config({"algorithm": "local", "local-all-clients": True, "dp": "central"})
    load_run_config({"algorithm": "local", "dp": "central"})  # the sampled budget: allowed
