"""Fashion-MNIST from its IDX files: the loader against torchvision's IDX reader on files
the tests write (plain and gzipped, in each layout it looks in), its errors for missing
and damaged files (hypothesis: any damage is a DatasetNotFound, never a crash or wrong
arrays), and the real data set where Debian's dataset-fashion-mnist is installed."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchvision.datasets.mnist import read_image_file, read_label_file

from fedpers.data import sources
from fedpers.data.registry import FASHION_MNIST_SYSTEM_DIR
from fedpers.data.sources import (
    DatasetCorrupt,
    DatasetNotFound,
    check_data_source,
    load_dataset,
)

NAMES = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}


def _idx_bytes(array: np.ndarray) -> bytes:
    """The IDX format as its specification writes it (big-endian int32 dimensions)."""
    header = bytes((0, 0, 8, array.ndim)) + np.array(array.shape, ">i4").tobytes()
    return header + array.astype(np.uint8).tobytes()


def _write(folder: Path, gzipped: set[str] = frozenset(), seed: int = 0) -> dict[str, bytes]:
    """Four small IDX files (30 train, 12 test images); those named in ``gzipped`` as
    .gz. Returns each file's plain bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {
        NAMES["train", "images"]: rng.integers(0, 256, (30, 28, 28)),
        NAMES["train", "labels"]: rng.integers(0, 10, 30),
        NAMES["test", "images"]: rng.integers(0, 256, (12, 28, 28)),
        NAMES["test", "labels"]: rng.integers(0, 10, 12),
    }
    plain = {}
    for name, array in arrays.items():
        plain[name] = _idx_bytes(array)
        if name in gzipped:
            (folder / f"{name}.gz").write_bytes(gzip.compress(plain[name]))
        else:
            (folder / name).write_bytes(plain[name])
    return plain


@pytest.mark.parametrize("layout", ["fashion-mnist", "FashionMNIST/raw", "."])
def test_loader_matches_torchvisions_idx_reader(tmp_path: Path, layout: str) -> None:
    folder = tmp_path / "root" / layout
    plain = _write(folder, gzipped={NAMES["train", "images"], NAMES["test", "labels"]})
    dataset = load_dataset("fashion-mnist", root=str(tmp_path / "root"), seed=0, train_size=0)
    oracle = tmp_path / "oracle"
    oracle.mkdir()
    for name, data in plain.items():
        (oracle / name).write_bytes(data)
    for split, x, y in (
        ("train", dataset.x_train, dataset.y_train),
        ("test", dataset.x_test, dataset.y_test),
    ):
        images = read_image_file(str(oracle / NAMES[split, "images"])).numpy()
        labels = read_label_file(str(oracle / NAMES[split, "labels"])).numpy()
        np.testing.assert_array_equal(x, images[:, None])
        np.testing.assert_array_equal(y, labels)
        assert x.dtype == np.uint8
        assert y.dtype == np.int64
    features = dataset.features(dataset.x_test)
    expected = (torch.from_numpy(dataset.x_test).float() / 255 - 0.2860) / 0.3530
    np.testing.assert_allclose(features, expected.numpy(), rtol=1e-6, atol=1e-6)


def test_empty_data_root_reads_the_system_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "FASHION_MNIST_SYSTEM_DIR", str(tmp_path / "system"))
    with pytest.raises(DatasetNotFound, match="apt-get install dataset-fashion-mnist") as caught:
        load_dataset("fashion-mnist", root="", seed=0, train_size=0)
    assert "data-root is empty" in str(caught.value)
    _write(tmp_path / "system", gzipped=set(NAMES.values()))
    assert len(load_dataset("fashion-mnist", root="", seed=0, train_size=0).y_train) == 30


def test_a_data_root_without_the_files_names_where_it_looked(tmp_path: Path) -> None:
    _write(tmp_path / "fashion-mnist")
    (tmp_path / "fashion-mnist" / NAMES["test", "labels"]).unlink()
    with pytest.raises(DatasetNotFound, match="the four IDX files are not in") as caught:
        check_data_source("fashion-mnist", str(tmp_path))
    assert str(tmp_path / "FashionMNIST" / "raw") in str(caught.value)
    assert "place the four IDX files" in str(caught.value)
    with pytest.raises(DatasetNotFound, match="is not a directory"):
        check_data_source("fashion-mnist", str(tmp_path / "nowhere"))


def _damage(folder: Path, name: str, change: str) -> None:
    path = folder / name
    data = bytearray(path.read_bytes())
    if change == "truncated":
        path.write_bytes(bytes(data[:-1]))
    elif change == "padded":
        path.write_bytes(bytes(data) + b"\0")
    elif change == "magic":
        data[2] = 0x0D  # float32 instead of unsigned bytes
        path.write_bytes(bytes(data))
    elif change == "not-gzip":
        path.unlink()
        (folder / f"{name}.gz").write_bytes(bytes(data))
    elif change == "label-10":
        data[-1] = 10
        path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        (NAMES["train", "images"], "truncated", "truncated or padded"),
        (NAMES["test", "labels"], "padded", "truncated or padded"),
        (NAMES["train", "labels"], "magic", "is not an IDX file of 1-dimensional unsigned"),
        (NAMES["test", "images"], "not-gzip", "cannot be read"),
        (NAMES["train", "labels"], "label-10", r"label 10 .* is outside 0\.\.9"),
    ],
)
def test_damaged_files_are_named_with_the_fix(
    tmp_path: Path, name: str, change: str, message: str
) -> None:
    folder = tmp_path / "fashion-mnist"
    _write(folder)
    _damage(folder, name, change)
    with pytest.raises(DatasetCorrupt, match=message) as caught:
        check_data_source("fashion-mnist", str(tmp_path))
    assert "re-install or re-copy" in str(caught.value)


def test_image_and_label_counts_must_agree(tmp_path: Path) -> None:
    folder = tmp_path / "fashion-mnist"
    _write(folder)
    labels = np.zeros(29, np.uint8)  # one label short of the 30 train images
    (folder / NAMES["train", "labels"]).write_bytes(_idx_bytes(labels))
    with pytest.raises(DatasetCorrupt, match=r"30 images .* and 29 labels"):
        load_dataset("fashion-mnist", root=str(tmp_path), seed=0, train_size=0)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    which=st.sampled_from(sorted(NAMES.values())),
    cut=st.integers(0, 30 * 784 + 16),
    noise=st.binary(max_size=40),
    zipped=st.booleans(),
)
def test_any_damage_is_a_clear_error_or_a_consistent_data_set(
    tmp_path: Path, which: str, cut: int, noise: bytes, zipped: bool
) -> None:
    """Whatever replaces a file (a cut-off prefix, then arbitrary bytes, gzipped or not),
    loading raises DatasetNotFound (naming the file or folder) or returns arrays that
    agree with the headers: never another exception, never a silent wrong shape."""
    root = tmp_path / f"r{abs(hash((which, cut, noise, zipped)))}"
    folder = root / "fashion-mnist"
    plain = _write(folder)
    damaged = plain[which][:cut] + noise
    (folder / which).unlink()
    target = folder / (f"{which}.gz" if zipped else which)
    target.write_bytes(gzip.compress(damaged) if zipped else damaged)
    try:
        dataset = load_dataset("fashion-mnist", root=str(root), seed=0, train_size=0)
    except DatasetNotFound as error:
        message = str(error)
    else:
        message = ""
        assert dataset.x_train.shape[1:] == (1, 28, 28)
        assert len(dataset.x_train) == len(dataset.y_train)
        assert len(dataset.x_test) == len(dataset.y_test)
        assert dataset.y_train.max(initial=0) <= 9
        assert dataset.y_test.max(initial=0) <= 9
    finally:
        shutil.rmtree(root)
    assert not message or str(folder) in message


installed = pytest.mark.skipif(
    not Path(FASHION_MNIST_SYSTEM_DIR).is_dir(),
    reason="Debian's dataset-fashion-mnist is not installed (.ci/run installs it)",
)


@installed
def test_the_installed_data_set_is_the_whole_of_fashion_mnist() -> None:
    dataset = load_dataset("fashion-mnist", root="", seed=0, train_size=0)
    assert dataset.x_train.shape == (60000, 1, 28, 28)
    assert dataset.x_test.shape == (10000, 1, 28, 28)
    # 6,000 training and 1,000 test images of each of the 10 kinds (Xiao et al., 2017)
    assert np.bincount(dataset.y_train).tolist() == [6000] * 10
    assert np.bincount(dataset.y_test).tolist() == [1000] * 10
    # the normalization's constants are the training split's own mean and deviation
    features = dataset.features(dataset.x_train)
    assert abs(float(features.mean())) < 1e-3
    assert abs(float(features.std()) - 1.0) < 1e-3
