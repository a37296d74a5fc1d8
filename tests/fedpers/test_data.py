"""Data sets and partitions: generated and embedded sets, torchvision loaders on files
the test writes in torchvision's formats, and the partitioners' guarantees."""

import pickle
import random
from pathlib import Path

import numpy as np
import pytest

from fedpers.config import load_run_config
from fedpers.data.client import DataKey, client_data, partitions
from fedpers.data.partition import (
    partition_classes,
    partition_dirichlet,
    partition_lognormal,
    split_test_like_train,
)
from fedpers.data.sources import DatasetNotFound, load_dataset


def _labels(count: int, seed: int, classes: int = 10) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, classes, count)


# ------------------------------------------------------------------ partitioners
def test_classes_partition_gives_each_client_exactly_s_classes_disjointly() -> None:
    labels = _labels(5000, 0)
    parts = partition_classes(labels, num_clients=50, classes_per_client=2, seed=1)
    assert all(len(np.unique(labels[p])) == 2 for p in parts)
    joined = np.concatenate(parts)
    assert len(joined) == len(np.unique(joined))  # disjoint
    assert len(joined) == len(labels)  # every sample used (all classes are held)
    assert [p.tolist() for p in parts] == [
        p.tolist() for p in partition_classes(labels, 50, 2, seed=1)
    ]  # deterministic


def test_test_split_follows_training_classes_and_proportions() -> None:
    train_labels, test_labels = _labels(6000, 2), _labels(1500, 3)
    parts = partition_classes(train_labels, num_clients=30, classes_per_client=3, seed=4)
    tests = split_test_like_train([train_labels[p] for p in parts], test_labels, seed=5)
    joined = np.concatenate(tests)
    assert len(joined) == len(np.unique(joined)) == len(test_labels)
    for train_part, test_part in zip(parts, tests, strict=True):
        assert set(np.unique(test_labels[test_part])) <= set(np.unique(train_labels[train_part]))
    # Proportional: each client's share of class c in test matches its share in train
    # within one sample (largest-remainder rounding).
    for c in range(10):
        held = np.array([np.count_nonzero(train_labels[p] == c) for p in parts])
        got = np.array([np.count_nonzero(test_labels[t] == c) for t in tests])
        expected = held / held.sum() * np.count_nonzero(test_labels == c)
        assert np.all(np.abs(got - expected) < 1.0 + 1e-9)


def test_dirichlet_partition_is_disjoint_and_skewed() -> None:
    labels = _labels(4000, 6)
    parts = partition_dirichlet(labels, num_clients=20, alpha=0.1, seed=7)
    joined = np.concatenate(parts)
    assert len(joined) == len(np.unique(joined)) == len(labels)
    # With alpha = 0.1 a typical client is dominated by few classes.
    dominant = [np.bincount(labels[p], minlength=10).max() / len(p) for p in parts]
    assert np.median(dominant) > 0.5


def test_lognormal_partition_sizes_and_classes() -> None:
    labels = _labels(60000, 8)
    parts = partition_lognormal(labels, 150, 3, mean_size=148, sigma=1.0, seed=9)
    sizes = np.array([len(p) for p in parts])
    assert abs(sizes.mean() - 148) < 0.25 * 148  # mean of LogNormal(mu, 1) draws
    assert sizes.std() > 0.5 * sizes.mean()  # heavy spread
    assert all(len(np.unique(labels[p])) <= 3 for p in parts)
    joined = np.concatenate(parts)
    assert len(joined) == len(np.unique(joined))


# --------------------------------------------------------------------- data sets
def test_mnist1d_generation_leaves_global_random_state_untouched(tmp_path: Path) -> None:
    # The legacy global RNG is what mnist1d reseeds: this test must use it.
    np.random.seed(123)  # noqa: NPY002
    random.seed(123)
    expected_numpy, expected_python = np.random.rand(), random.random()  # noqa: NPY002
    np.random.seed(123)  # noqa: NPY002
    random.seed(123)
    dataset = load_dataset("mnist1d", root=str(tmp_path), seed=0, train_size=400)
    assert (np.random.rand(), random.random()) == (expected_numpy, expected_python)  # noqa: NPY002
    assert dataset.x_train.shape == (400, 40)
    assert dataset.x_test.shape == (100, 40)
    assert set(np.unique(dataset.y_train)) == set(range(10))
    cached = load_dataset("mnist1d", root=str(tmp_path), seed=0, train_size=400)
    np.testing.assert_array_equal(cached.x_train, dataset.x_train)  # from the .npz cache


def test_digits_split_is_stratified_and_scaled() -> None:
    dataset = load_dataset("digits", root="", seed=0, train_size=0)
    assert len(dataset.y_train) + len(dataset.y_test) == 1797
    features = dataset.features(dataset.x_train)
    assert features.dtype == np.float32
    assert features.min() >= 0.0
    assert features.max() <= 1.0


def _write_idx(path: Path, array: np.ndarray) -> None:
    kind = 3 if array.ndim == 3 else 1
    header = np.array([8 * 256 + kind, *array.shape], dtype=">i4").tobytes()
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def _fake_mnist(root: Path, folder: str, prefix: dict[bool, str], labels_max: int) -> None:
    raw = root / folder / "raw"
    raw.mkdir(parents=True)
    generator = np.random.default_rng(0)
    for train, count in ((True, 60), (False, 20)):
        images = generator.integers(0, 256, (count, 28, 28))
        labels = np.arange(count) % labels_max + (1 if folder == "EMNIST" else 0)
        _write_idx(raw / f"{prefix[train]}-images-idx3-ubyte", images)
        _write_idx(raw / f"{prefix[train]}-labels-idx1-ubyte", labels)


def test_mnist_loader_reads_torchvision_files(tmp_path: Path) -> None:
    _fake_mnist(tmp_path, "MNIST", {True: "train", False: "t10k"}, 10)
    dataset = load_dataset("mnist", root=str(tmp_path), seed=0, train_size=0)
    assert dataset.x_train.shape == (60, 1, 28, 28)
    assert dataset.features(dataset.x_test).shape == (20, 1, 28, 28)
    assert set(dataset.y_train) == set(range(10))


def test_femnist_keeps_letters_a_to_j(tmp_path: Path) -> None:
    _fake_mnist(
        tmp_path, "EMNIST", {True: "emnist-letters-train", False: "emnist-letters-test"}, 26
    )
    dataset = load_dataset("femnist", root=str(tmp_path), seed=0, train_size=0)
    assert set(dataset.y_train) == set(range(10))  # letters a..j, relabelled 0..9
    assert len(dataset.y_train) == sum(1 for i in range(60) if i % 26 < 10)


def write_cifar(root: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small CIFAR-10 or CIFAR-100 files in torchvision's format under ``root`` (12
    random images a file, labels 0, 1, ... modulo the classes); only torchvision's MD5
    check against the real archive is bypassed."""
    import torchvision

    generator = np.random.default_rng(0)
    folder = root / ("cifar-10-batches-py" if name == "cifar10" else "cifar-100-python")
    folder.mkdir()
    key = "labels" if name == "cifar10" else "fine_labels"
    classes = 10 if name == "cifar10" else 100
    files = (
        [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        if name == "cifar10"
        else ["train", "test"]
    )
    for file in files:
        batch = {
            "data": generator.integers(0, 256, (12, 3072), dtype=np.uint8),
            key: [i % classes for i in range(12)],
        }
        (folder / file).write_bytes(pickle.dumps(batch))
    meta_file, meta_key = (
        ("batches.meta", "label_names") if name == "cifar10" else ("meta", "fine_label_names")
    )
    (folder / meta_file).write_bytes(pickle.dumps({meta_key: [str(i) for i in range(classes)]}))
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_loaders_read_torchvision_pickles(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_cifar(tmp_path, name, monkeypatch)
    dataset = load_dataset(name, root=str(tmp_path), seed=0, train_size=0)
    train_batches = 5 if name == "cifar10" else 1
    assert dataset.x_train.shape == (12 * train_batches, 3, 32, 32)
    assert dataset.features(dataset.x_test[:2]).dtype == np.float32


@pytest.mark.parametrize("name", ["mnist", "femnist", "cifar10", "cifar100"])
def test_missing_dataset_says_how_to_get_it(tmp_path: Path, name: str) -> None:
    with pytest.raises(DatasetNotFound, match="download=True"):
        load_dataset(name, root=str(tmp_path), seed=0, train_size=0)
    with pytest.raises(DatasetNotFound, match="'data-root' is empty"):
        load_dataset(name, root="", seed=0, train_size=0)


def test_client_data_is_the_clients_own_partition() -> None:
    config = load_run_config({"dataset": "digits", "num-clients": 10, "classes-per-client": 2})
    train, test = partitions(DataKey.of(config))
    data = client_data(config, 3)
    assert len(data.y_train) == len(train[3])
    assert len(data.y_test) == len(test[3])
    assert set(np.unique(data.y_test)) <= set(np.unique(data.y_train))
    assert len(np.unique(data.y_train)) == 2
    with pytest.raises(ValueError, match=r"partition-id 10 is outside 0\.\.9"):
        client_data(config, 10)


def _rows(x: np.ndarray) -> set[bytes]:
    return {np.ascontiguousarray(row).tobytes() for row in x}


@pytest.mark.parametrize(
    "overrides",
    [
        {"dataset": "digits", "test-split": "per-client", "partitioner": "dirichlet"},
        {"dataset": "mixture", "samples-per-client": 60},
        {"dataset": "digits"},  # FedRep's protocol: validation held out of training
        {"dataset": "mnist1d", "partitioner": "generated", "samples-per-client": 40},
    ],
)
def test_validation_and_test_splits_are_disjoint(overrides: dict[str, object]) -> None:
    config = load_run_config({"num-clients": 10, **overrides})
    validation = load_run_config({"num-clients": 10, **overrides, "evaluate-split": "validation"})
    for partition in (0, 3, 9):
        test = client_data(config, partition)
        chosen = client_data(validation, partition)
        held = _rows(chosen.x_test)
        assert len(chosen.y_test) > 0
        # what a tuning run evaluates on is neither the test samples nor trained on
        assert held.isdisjoint(_rows(test.x_test))
        assert held.isdisjoint(_rows(chosen.x_train))
        # and it comes out of the client's own data, not from elsewhere
        assert held <= _rows(test.x_train) | _rows(test.x_val)
        assert _rows(chosen.x_train) | held <= _rows(test.x_train) | _rows(test.x_val)


@pytest.mark.parametrize("seed", [0, 7, 2**31 + 5])
def test_generated_mnist1d_is_the_packages_transform_bit_for_bit(seed: int) -> None:
    """The samples of ``partitioner = "generated"`` (drawn for all samples at once)
    against the package's own loop: ``mnist1d.transform.transform`` of each template,
    drawing from numpy's global RNG seeded with the same seed."""
    from mnist1d.data import get_dataset_args, get_templates
    from mnist1d.transform import transform

    from fedpers.data.sources import _mnist1d_samples

    labels = np.random.default_rng(seed).integers(0, 10, 300)
    args, templates = get_dataset_args(), get_templates()
    state = np.random.get_state()  # noqa: NPY002
    np.random.seed(seed % 2**32)  # noqa: NPY002
    expected = np.stack([transform(templates["x"][y], templates["t"], args)[0] for y in labels])
    np.random.set_state(state)  # noqa: NPY002
    np.testing.assert_array_equal(_mnist1d_samples(labels, seed % 2**32), expected)


def test_generated_clients_built_together_are_each_built_alone_bit_for_bit() -> None:
    """A cohort's generated MNIST-1D clients, built together (``clients_data``: one
    vectorized draw for all of them), are the bits each client builds alone
    (``client_data`` in a fresh cache); a client's data differs from its neighbour's
    (the control: the check would see a mix-up)."""
    from fedpers.data import client as data_client

    config = load_run_config(
        {"dataset": "mnist1d", "partitioner": "generated", "num-clients": 12, "seed": 3}
    )
    cohort = [7, 0, 11, 3, 5]
    data_client._GENERATED.clear()
    together = data_client.clients_data(config, cohort)
    alone = []
    for partition in cohort:
        data_client._GENERATED.clear()
        alone.append(client_data(config, partition))
    data_client._GENERATED.clear()
    for a, b in zip(together, alone, strict=True):
        for name in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(together[0].x_train, together[1].x_train)
