"""simulations.attack: the membership-inference attack on a released model, checked on
models whose leakage is known (one that memorized its members; one that never saw
them), and the quick form's summary against the attack recomputed from its runs."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedpers.config import load_run_config
from fedpers.simulations import attack

RUN = {"dataset": "digits", "partitioner": "classes", "classes-per-client": 2, "num-clients": 10}


def _random_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every client's labels drawn at random (seeded by the client): no model can
    predict a non-member's, only memorize a member's."""
    from fedpers.data import client

    real = client.client_data

    def shuffled(config: object, partition: int, **kwargs: object) -> client.ClientData:
        data = real(config, partition, **kwargs)  # type: ignore[arg-type]
        generator = np.random.default_rng(partition)
        return dataclasses.replace(
            data,
            y_train=generator.integers(0, 10, len(data.y_train)),
            y_test=generator.integers(0, 10, len(data.y_test)),
        )

    monkeypatch.setattr(client, "client_data", shuffled)


def _released(tmp_path: Path, algorithm: str, steps: int) -> Path:
    """A run directory whose released model is the seeded model trained centrally,
    ``steps`` full-batch steps over every client's training samples (the members) and
    nothing else: ``steps = 0`` never saw them."""
    import torch
    from torch.nn import functional

    from fedpers.data import client
    from fedpers.models import build_model, part_arrays

    config = load_run_config({**RUN, "algorithm": algorithm})
    model = build_model(config.model_name, config.num_classes, config.seed, config.input_shape)
    data = [client.client_data(config, p) for p in range(config.seen_clients)]
    x = torch.as_tensor(np.concatenate([d.x_train for d in data]))
    y = torch.as_tensor(np.concatenate([d.y_train for d in data]))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    directory = tmp_path / f"{algorithm}-{steps}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config.to_mapping()))
    np.savez(directory / "final_arrays.npz", **part_arrays(model, config.spec.shared))
    return directory


@pytest.mark.long
@pytest.mark.parametrize(("algorithm", "least"), [("fedavg", 0.9), ("fedrep", 0.75)])
def test_the_attack_finds_members_a_model_memorized_and_not_those_it_never_saw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str, least: float
) -> None:
    """Under random labels a model can only memorize its members: after 1,000
    full-batch steps the attack's AUC is near 1 for the whole model (measured 0.98),
    well above chance for FedRep's body alone, completed by heads the attacker fits on
    each client's records, members and non-members together (measured 0.82). The
    seeded model never saw either: members and non-members are exchangeable, so its AUC
    is 0.5 within four standard deviations of the Mann-Whitney statistic under the
    null."""
    _random_labels(monkeypatch)
    members, others = attack.record_losses(_released(tmp_path, algorithm, 1000))
    assert attack.attack_success(members, others)["auc"] > least
    members, others = attack.record_losses(_released(tmp_path, algorithm, 0))
    n, m = len(members), len(others)
    spread = math.sqrt((n + m + 1) / (12 * n * m))
    assert abs(attack.attack_success(members, others)["auc"] - 0.5) < 4 * spread


def _attacked_clients(directory: Path) -> list[tuple[object, object]]:
    """For every client of the run in ``directory``: the attacker's model of the
    released arrays and the client's data."""
    from fedpers.config import RunConfig
    from fedpers.data import client

    config = RunConfig.from_mapping(json.loads((directory / "config.json").read_text()))
    with np.load(directory / "final_arrays.npz") as stored:
        released = {name: stored[name] for name in stored.files}
    found = []
    for partition in range(config.seen_clients):
        data = client.client_data(config, partition)
        found.append((attack._attacker_model(config, released, data), data))
    return found


def test_the_update_attack_scores_each_record_by_its_gradient_against_the_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random labels (so only members shape an update): each client's update, one
    full-batch gradient step on its members, scores the 10 clients' members above
    their non-members, beyond chance by more than four standard deviations of the
    Mann-Whitney statistic under the null (measured AUC 0.582, 1,347 members and 450
    non-members, 4 standard deviations 0.063: on these 8x8 images and a small model a
    gradient's shared direction dominates); an update of Gaussian noise scores them as
    chance, within four (measured 0.502). Each score equals the cosine computed record by
    record with torch.autograd (to 1e-9)."""
    import torch
    from torch.nn import functional

    _random_labels(monkeypatch)
    scored: dict[str, list[np.ndarray]] = {"step": [], "noise": [], "others": [], "pure": []}
    generator = np.random.default_rng(0)
    for model, data in _attacked_clients(_released(tmp_path, "fedavg", 0)):
        params = dict(model.named_parameters())
        x = torch.as_tensor(data.x_train).double()
        loss = functional.cross_entropy(model(x), torch.as_tensor(data.y_train))
        steps = torch.autograd.grad(loss, list(params.values()))
        update = {k: -0.1 * g.numpy() for k, g in zip(params, steps, strict=True)}
        noise = {k: generator.normal(size=v.shape) for k, v in update.items()}
        members = attack.gradient_cosines(model, update, data.x_train, data.y_train)
        scored["step"].append(members)
        scored["others"].append(attack.gradient_cosines(model, update, data.x_test, data.y_test))
        scored["noise"].append(attack.gradient_cosines(model, noise, data.x_train, data.y_train))
        scored["pure"].append(attack.gradient_cosines(model, noise, data.x_test, data.y_test))
        flat = np.concatenate([v.ravel() for v in update.values()])
        record = functional.cross_entropy(model(x[:1]), torch.as_tensor(data.y_train[:1]))
        grads = torch.autograd.grad(record, list(params.values()))
        g = np.concatenate([t.numpy().ravel() for t in grads])
        expected = -g @ flat / (np.linalg.norm(g) * np.linalg.norm(flat))
        assert members[0] == pytest.approx(expected, abs=1e-9)
    joined = {k: np.concatenate(v) for k, v in scored.items()}
    n, m = len(joined["step"]), len(joined["others"])
    spread = math.sqrt((n + m + 1) / (12 * n * m))
    assert attack.score_success(joined["step"], joined["others"])["auc"] > 0.5 + 4 * spread
    assert abs(attack.score_success(joined["noise"], joined["pure"])["auc"] - 0.5) < 4 * spread


def test_distributed_runs_take_the_noise_central_dp_calibrates_for_a_fixed_size_sample() -> None:
    from fedpers import privacy

    values = {**attack.SCRIPT, "num-rounds": 30}
    keys = attack.mechanism("1", "fedavg", "distributed", values)
    assert keys["dp"] == "distributed"
    assert keys["dp-sampling"] == "without-replacement"
    expected = privacy.calibrate(
        1.0, privacy.DpSampling.WITHOUT_REPLACEMENT, 0.2, 100, 20.0, 30, 1e-5
    )
    assert keys["dp-noise-multiplier"] == pytest.approx(expected)
    assert attack.mechanism("inf", "fedavg", "distributed", values) == {"dp": "none"}
    assert attack.mechanism("1", "fedavg", "central", values)["dp"] == "central"


def test_the_bound_is_the_hypothesis_testing_region_of_twice_epsilon() -> None:
    assert attack.advantage_bound(math.inf, 1e-5) == 1.0
    assert attack.advantage_bound(0.0, 0.0) == 0.0
    assert attack.advantage_bound(1.0, 0.0) == pytest.approx(math.tanh(1.0))


@pytest.mark.script  # the script's --quick form: make test, not make check
def test_attack_quick(tmp_path: Path) -> None:
    out = tmp_path / "attack"
    summary = attack.main(
        ["--out", str(out), "--quick", "--in-process", "--methods", "fedavg",
         "--epsilons", "2,inf"]
    )  # fmt: skip
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert "| fedavg | 2 |" in (out / "table.md").read_text()
    for epsilon in ("2", "inf"):
        run = out / "runs" / f"fedavg-eps{epsilon}-seed0"
        success = attack.attack_success(*attack.record_losses(run))
        assert summary["attack_auc"]["fedavg"][epsilon] == pytest.approx(success["auc"])
        assert summary["attack_advantage"]["fedavg"][epsilon] == pytest.approx(success["advantage"])
        # central DP noises the server's release, not the update: the update repeats
        update = attack.score_success(*attack.update_scores(run, summary["update_targets"]))
        assert summary["update_auc"]["fedavg"][epsilon] == pytest.approx(update["auc"])
        assert summary["by_seed"]["update_auc"]["fedavg"][epsilon] == [pytest.approx(update["auc"])]
    spent = summary["epsilon_spent"]["fedavg"]["2"]
    assert 1.9 < spent <= 2.0
    assert summary["advantage_bound"]["fedavg"]["2"] == pytest.approx(
        attack.advantage_bound(spent, 1e-5)
    )
    assert summary["epsilon_spent"]["fedavg"]["inf"] is None
    assert summary["attack_advantage"]["fedavg"]["2"] <= summary["advantage_bound"]["fedavg"]["2"]


def test_the_table_gives_the_seeds_spread_where_there_are_several() -> None:
    import statistics

    cell = {"fedavg": {"inf": 0.0}}
    seeds = {"fedavg": {"inf": [0.5, 0.6]}}
    summary = {
        "methods": ["fedavg"], "epsilons": ["inf"], "advantage_bound": {"fedavg": {"inf": 1.0}},
        "final_accuracy": {"fedavg": {"inf": 0.8}}, "attack_auc": {"fedavg": {"inf": 0.55}},
        "attack_advantage": cell, "update_auc": {"fedavg": {"inf": 0.55}},
        "update_advantage": cell,
        "by_seed": {"final_accuracy": {"fedavg": {"inf": [0.7, 0.9]}},
                    "attack_auc": seeds, "update_auc": seeds},
    }  # fmt: skip
    row = attack._table(summary).splitlines()[-1]
    std = statistics.stdev([0.5, 0.6])
    assert f"| 80.0 ± {100 * statistics.stdev([0.7, 0.9]):.1f} |" in row
    assert row.count(f"0.550 ± {std:.3f}") == 2
    del summary["by_seed"]  # one seed, or a summary written before: the mean alone
    assert "±" not in attack._table(summary)
