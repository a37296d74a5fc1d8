"""Whole data sets as numpy arrays: generated, embedded, or read from a local root.

Nothing here downloads. A data set that needs files and does not find them raises
``DatasetNotFound`` with instructions. Raw arrays keep their compact dtype (uint8 for
images); ``Dataset.features`` turns a slice into the float32 inputs a model takes, so a
process holds one compact copy and converts only the samples a client uses.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from fedpers.atomic import save_npz
from fedpers.data.registry import DATASETS, FASHION_MNIST_SYSTEM_DIR, DatasetInfo
from fedpers.seeding import int_seed, isolated_global_numpy_and_random

MNIST1D_TRAIN_SPLIT = 0.8


class DatasetNotFound(FileNotFoundError):  # noqa: N818  # public name, kept
    """A data set that must come from a local root is not there."""


class DatasetCorrupt(DatasetNotFound):
    """A data set's file is there but cannot be read as what it should hold (truncated,
    not the format, wrong shape): caught wherever a missing data set is."""


@dataclass(frozen=True)
class Dataset:
    """Train and test split of one data set.

    Parameters
    ----------
    name : str
        Registry name of the data set.
    x_train, y_train, x_test, y_test : np.ndarray
        Raw inputs (any dtype) and integer labels.
    scale : float
        Raw inputs are divided by this before normalization.
    mean, std : tuple of float
        Per-channel normalization applied after scaling (empty: none).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    scale: float = 1.0
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    def features(self, raw: np.ndarray) -> np.ndarray:
        """Model inputs (float32, channels first for images) from raw samples."""
        x = raw.astype(np.float32) / np.float32(self.scale)
        if self.mean:
            shape = (1, len(self.mean)) + (1,) * (x.ndim - 2)
            x = (x - np.asarray(self.mean, np.float32).reshape(shape)) / np.asarray(
                self.std, np.float32
            ).reshape(shape)
        return x


Loader = Callable[[str, int], Dataset]  # (data root, seed) -> Dataset
_REGISTERED: dict[str, Loader] = {}


def register_dataset(name: str, info: DatasetInfo, loader: Loader) -> None:
    """Make data set ``name`` available to every run (``dataset = "<name>"``).

    Parameters
    ----------
    name : str
        The run-config value that selects it; must not name a built-in data set.
    info : DatasetInfo
        Its classes, input shape and default model (checked before a run starts).
    loader : callable
        ``(data_root, seed) -> Dataset`` with the whole train and test sets; fedpers
        partitions them over the clients with the run's partitioner.

    Raises
    ------
    ValueError
        If ``name`` is taken.
    """
    if DATASETS.get(name) == info and _REGISTERED.get(name) is loader:
        return  # the same registration again (an extension loaded by a fresh fedpers)
    if name in DATASETS:
        raise ValueError(f"data set '{name}' exists already; choose another name")
    DATASETS[name] = info
    _REGISTERED[name] = loader


def load_dataset(name: str, *, root: str, seed: int, train_size: int) -> Dataset:
    """Load (or generate) data set ``name``.

    Parameters
    ----------
    name : str
        A key of ``fedpers.data.registry.DATASETS`` other than ``linear``.
    root : str
        Local data root for data sets read from files; also holds the MNIST-1D cache.
    seed : int
        Seed of generated data sets (MNIST-1D) and of the digits train/test split.
    train_size : int
        Number of training samples to generate (MNIST-1D only).
    """
    if name == "mnist1d":
        return _mnist1d(train_size=train_size, seed=seed, root=root)
    if name == "digits":
        return _digits(seed, root)
    if name in ("mnist", "femnist", "cifar10", "cifar100"):
        return _torchvision(name, root)
    if name == "fashion-mnist":
        return _fashion_mnist(root)
    if name in _REGISTERED:
        return _REGISTERED[name](root, seed)
    raise ValueError(f"load_dataset: no loader for data set '{name}'")


def check_data_source(name: str, root: str) -> None:
    """Fail now, with the fix, if data set ``name`` cannot be read from ``root``: for
    scripts to call before Flower and Ray start (a run would otherwise find out on
    every client, after the start-up). Reads the files of a data set on disk once.

    Raises
    ------
    DatasetNotFound
        If the data set needs files and ``root`` is empty, missing or lacks them (or
        ``DatasetCorrupt``: a file is there but unreadable).
    """
    if name not in ("mnist", "femnist", "cifar10", "cifar100", "fashion-mnist"):
        return  # embedded, or a registered loader that checks its own files
    if root and not Path(root).is_dir():
        raise DatasetNotFound(
            f"dataset='{name}': data-root '{root}' is not a directory. "
            f"{DATASETS[name].how_to_get.replace('ROOT', root)}"
        )
    load_dataset(name, root=root, seed=0, train_size=0)


# --------------------------------------------------------------------- MNIST-1D
def _mnist1d(*, train_size: int, seed: int, root: str) -> Dataset:
    """MNIST-1D (Greydanus, 2020) generated offline with its reference generator.

    ``train_size`` training samples plus a quarter as many test samples (the package's
    80/20 split). Generation takes seconds for tens of thousands of samples, so the
    result is cached as .npz under the data root (or ``~/.cache/fedpers``).
    """
    from mnist1d.data import get_dataset_args, make_dataset

    num_samples = int(np.ceil(train_size / MNIST1D_TRAIN_SPLIT / 10)) * 10
    args = get_dataset_args(as_dict=True)
    args.update(num_samples=num_samples, train_split=MNIST1D_TRAIN_SPLIT)
    args["seed"] = int_seed(seed, "mnist1d") % (2**32 - 1)
    args.pop("url", None)
    cache = _cache_dir(root) / f"mnist1d-{_digest(args)}.npz"
    if cache.exists():
        with np.load(cache) as stored:
            arrays = {k: stored[k] for k in ("x", "y", "x_test", "y_test")}
    else:

        class _Args:
            def __init__(self, values: dict[str, object]) -> None:
                self.__dict__.update(values)

        with isolated_global_numpy_and_random():
            generated = make_dataset(_Args(args))
        arrays = {
            "x": generated["x"].astype(np.float32),
            "y": generated["y"].astype(np.int64),
            "x_test": generated["x_test"].astype(np.float32),
            "y_test": generated["y_test"].astype(np.int64),
        }
        _atomic_savez(cache, arrays)
    return Dataset("mnist1d", arrays["x"], arrays["y"], arrays["x_test"], arrays["y_test"])


ClientSamples = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def mnist1d_clients(
    seed: int, clients: Sequence[tuple[int, Sequence[int]]], train: int, test: int
) -> list[ClientSamples]:
    """Clients' MNIST-1D samples, each generated from its own seed alone: for each
    ``(partition id, classes)``, ``train`` + ``test`` samples spread evenly over its
    classes, each drawn from the package's templates and transforms, normalized with
    the generator's own statistics (``_mnist1d_scale``) so that every client sees the
    same scale. Nobody generates the other clients' data; generating several at once
    (a cohort's) draws each one's parameters from its own seed and transforms all their
    samples together, the same bits as one at a time."""
    count = train + test
    labels, draws = [], []
    for partition_id, classes in clients:
        mine = np.asarray(classes)[np.arange(count) % len(classes)]
        order = np.random.default_rng(
            int_seed(seed, "mnist1d-client-order", partition_id)
        ).permutation(count)
        labels.append(mine[order])
        state = np.random.RandomState(int_seed(seed, "mnist1d-client", partition_id) % (2**32 - 1))
        draws.append(_mnist1d_draws(state, count))
    if not labels:
        return []
    joined = tuple(np.concatenate(parts) for parts in zip(*draws, strict=True))
    mean, std = _mnist1d_scale()
    x = ((_mnist1d_transform(np.concatenate(labels), joined) - mean) / std).astype(np.float32)
    out = []
    for k, y in enumerate(labels):
        mine = x[k * count : (k + 1) * count]
        out.append(
            (mine[:train], y[:train].astype(np.int64), mine[train:], y[train:].astype(np.int64))
        )
    return out


@lru_cache(maxsize=1)
def _mnist1d_scale() -> tuple[float, float]:
    """Mean and standard deviation of the generator's raw output (2,000 samples, fixed
    seed): the scalar normalization ``make_dataset`` applies to a whole data set."""
    x = _mnist1d_samples(np.arange(2000) % 10, 0)
    return float(x.mean()), float(x.std())


def _mnist1d_samples(labels: np.ndarray, numpy_seed: int) -> np.ndarray:
    """Raw MNIST-1D signals of ``labels``: the package's templates and transform
    (``mnist1d.transform.transform``: pad, dilate, scale, translate, correlated and iid
    noise, shear, subsample), the same bits as the package's loop over the samples
    drawing from numpy's global RNG seeded with ``numpy_seed`` (tests/fedpers/
    test_data.py compares them), computed for all samples at once.

    The random draws stay one sample at a time, in the package's order, from a
    ``RandomState`` of that seed (the global one is not touched); the transforms run
    on all samples together (``np.interp``'s formula for every row, the first
    interpolation per padding length): 2.8 ms for a 125-sample client instead of 27."""
    draws = _mnist1d_draws(np.random.RandomState(numpy_seed), len(labels))
    return _mnist1d_transform(labels, draws)


def _mnist1d_transform(
    labels: np.ndarray, draws: tuple[np.ndarray, ...], eps: float = 1e-8
) -> np.ndarray:
    """The package's transform of every label's template with its drawn parameters
    (``_mnist1d_draws``), all samples at once."""
    from mnist1d.data import get_dataset_args, get_templates
    from scipy.ndimage import gaussian_filter1d

    args, templates = get_dataset_args(), get_templates()
    count, length = len(labels), args.template_len + args.padding[1]
    pads, scales, shifts, correlated, iid, shears = draws
    grid = np.linspace(0, 1, length)
    x = np.empty((count, length))
    base = templates["x"][labels] + eps
    for pad in np.unique(pads):
        rows = np.flatnonzero(pads == pad)
        padded = np.concatenate([base[rows], np.zeros((len(rows), pad))], axis=1)
        x[rows] = _interp_rows(grid, np.linspace(0, 1, padded.shape[1]), padded)
    x *= scales[:, None]
    x = np.take_along_axis(x, (np.arange(length)[None, :] - shifts[:, None]) % length, axis=1)
    mask = x != 0
    x = mask * x + (1 - mask) * gaussian_filter1d(correlated, 2, axis=-1)
    x = x + iid
    x = x - shears[:, None] * np.linspace(-0.5, 0.5, length)[None, :]
    return _interp_rows(np.linspace(0, 1, args.final_seq_length), grid, x)


def _mnist1d_draws(state: np.random.RandomState, count: int) -> tuple[np.ndarray, ...]:
    """Every sample's random parameters, drawn as ``mnist1d.transform`` draws them, one
    sample after another: its padding, scale, translation, correlated noise, iid noise
    and shear."""
    from mnist1d.data import get_dataset_args

    args = get_dataset_args()
    low, high = args.padding
    length = args.template_len + high
    pads = np.empty(count, dtype=np.int64)
    shifts = np.empty(count, dtype=np.int64)
    scales, shears = np.empty(count), np.empty(count)
    correlated, iid = np.empty((count, length)), np.empty((count, length))
    # choice(n) of an int draws randint(0, n): the same draw, without choice's checks
    rand, randn, randint = state.rand, state.randn, state.randint
    for i in range(count):
        pads[i] = low + int(rand() * (high - low + 1))
        scales[i] = 1 + args.scale_coeff * (rand() - 0.5)
        shifts[i] = randint(0, args.max_translation)
        correlated[i] = randn(length)
        iid[i] = randn(length)
        shears[i] = args.shear_scale * (rand() - 0.5)
    return (
        pads,
        scales,
        shifts,
        args.corr_noise_scale * correlated,
        args.iid_noise_scale * iid,
        shears,
    )


def _interp_rows(x: np.ndarray, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
    """``np.interp(x, xp, row)`` for every row of ``fp``, its formula written out for
    all rows at once (the same bits: ``x`` within ``xp``'s range, ``xp`` increasing)."""
    j = np.clip(np.searchsorted(xp, x, side="right") - 1, 0, len(xp) - 2)
    slope = (fp[:, j + 1] - fp[:, j]) / (xp[j + 1] - xp[j])
    out = slope * (x - xp[j]) + fp[:, j]
    exact = x == xp[j]
    out[:, exact] = fp[:, j[exact]]
    out[:, x == xp[-1]] = fp[:, -1:]
    return out


# ----------------------------------------------------------------------- digits
def _digits(seed: int, root: str) -> Dataset:
    """scikit-learn's 8x8 handwritten digits, 75/25 stratified train/test split (cached
    as .npz: importing scikit-learn costs a second in every fresh client process)."""
    cache = _cache_dir(root) / f"digits-{_digest({'seed': seed})}.npz"
    if cache.exists():
        with np.load(cache) as stored:
            arrays = {k: stored[k] for k in ("x", "y", "x_test", "y_test")}
    else:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        bunch = load_digits()
        x_train, x_test, y_train, y_test = train_test_split(
            bunch.data.astype(np.float32),
            bunch.target.astype(np.int64),
            test_size=0.25,
            stratify=bunch.target,
            random_state=int_seed(seed, "digits") % 2**32,
        )
        arrays = {"x": x_train, "y": y_train, "x_test": x_test, "y_test": y_test}
        _atomic_savez(cache, arrays)
    return Dataset(
        "digits", arrays["x"], arrays["y"], arrays["x_test"], arrays["y_test"], scale=16.0
    )


# ------------------------------------------------------------------ torchvision
_IMAGE_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "femnist": ((0.1722,), (0.3309,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


def _torchvision(name: str, root: str) -> Dataset:
    """MNIST, FEMNIST (EMNIST letters a-j) and CIFAR-10/100 from a local root."""
    import torchvision

    if not root:
        raise DatasetNotFound(
            f"dataset='{name}' is read from a local data root, and run-config key "
            f"'data-root' is empty. {DATASETS[name].how_to_get}"
        )
    classes = {
        "mnist": torchvision.datasets.MNIST,
        "femnist": torchvision.datasets.EMNIST,
        "cifar10": torchvision.datasets.CIFAR10,
        "cifar100": torchvision.datasets.CIFAR100,
    }
    kwargs = {"split": "letters"} if name == "femnist" else {}
    splits = []
    for train in (True, False):
        try:
            data = classes[name](root, train=train, download=False, **kwargs)
        except RuntimeError as error:  # torchvision: "Dataset not found ..."
            raise DatasetNotFound(
                f"dataset='{name}' not found under data-root '{root}' ({error}). "
                f"{DATASETS[name].how_to_get.replace('ROOT', root)}"
            ) from error
        x = np.asarray(data.data)
        y = np.asarray(data.targets, dtype=np.int64)
        # grey images: add the channel axis; CIFAR stores HWC
        x = x[:, None, :, :] if x.ndim == 3 else x.transpose(0, 3, 1, 2)
        if name == "femnist":
            # EMNIST letters: labels 1..26 for a..z; the FedRep paper keeps a-j. The
            # images are stored transposed.
            keep = (y >= 1) & (y <= 10)
            x, y = x[keep].transpose(0, 1, 3, 2), y[keep] - 1
        splits.append((np.ascontiguousarray(x), y))
    (x_train, y_train), (x_test, y_test) = splits
    mean, std = _IMAGE_STATS[name]
    return Dataset(name, x_train, y_train, x_test, y_test, scale=255.0, mean=mean, std=std)


# ---------------------------------------------------------------- Fashion-MNIST
def _fashion_mnist(root: str) -> Dataset:
    """Fashion-MNIST (Xiao et al., 2017): 60,000 + 10,000 grey 28x28 images of 10 kinds
    of clothing, from its four IDX files (each may be gzipped). With a data root they
    are read from ROOT/fashion-mnist, ROOT/FashionMNIST/raw (torchvision's layout) or
    ROOT itself; with none, from where Debian's package dataset-fashion-mnist puts
    them. Normalized by the training split's pixel mean and deviation."""
    folder = _fashion_mnist_folder(root)
    splits = []
    for prefix in ("train", "t10k"):
        images = _read_idx(folder, f"{prefix}-images-idx3-ubyte", ndim=3)
        labels = _read_idx(folder, f"{prefix}-labels-idx1-ubyte", ndim=1)
        if images.shape[1:] != (28, 28) or len(images) != len(labels):
            raise DatasetCorrupt(
                f"dataset='fashion-mnist': {folder} holds {images.shape[0]} images of "
                f"{images.shape[1:]} pixels and {len(labels)} labels in its '{prefix}' "
                "files; expected 28x28 images, one label each. Re-install or re-copy them: "
                f"{DATASETS['fashion-mnist'].how_to_get}"
            )
        if labels.size and labels.max() > 9:
            raise DatasetCorrupt(
                f"dataset='fashion-mnist': label {int(labels.max())} in {folder}'s "
                f"'{prefix}' labels is outside 0..9; re-install or re-copy the files."
            )
        splits.append((images[:, None], labels.astype(np.int64)))
    (x_train, y_train), (x_test, y_test) = splits
    return Dataset(
        "fashion-mnist", x_train, y_train, x_test, y_test, scale=255.0,
        mean=(0.2860,), std=(0.3530,),
    )  # fmt: skip


_IDX_NAMES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def _fashion_mnist_folder(root: str) -> Path:
    """The first folder that holds all four files (plain or gzipped)."""
    base = Path(root)
    places = (
        [base / "fashion-mnist", base / "FashionMNIST" / "raw", base]
        if root
        else [Path(FASHION_MNIST_SYSTEM_DIR)]
    )
    for folder in places:
        if all(_idx_file(folder, name) for name in _IDX_NAMES):
            return folder
    hint = DATASETS["fashion-mnist"].how_to_get.replace("ROOT", root or "ROOT")
    where = " or ".join(str(p) for p in places)
    raise DatasetNotFound(
        f"dataset='fashion-mnist': the four IDX files are not in {where}"
        f"{'' if root else ' (data-root is empty)'}. {hint}"
    )


def _idx_file(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _read_idx(folder: Path, name: str, *, ndim: int) -> np.ndarray:
    """IDX file ``name`` (or ``name.gz``) of unsigned bytes, LeCun's MNIST format: two
    zero bytes, type 0x08, the number of dimensions, each a big-endian uint32, the data."""
    import gzip

    path = _idx_file(folder, name)
    if path is None:
        raise DatasetNotFound(f"{folder / name}[.gz] is missing (it was there a moment ago)")
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as handle:
            raw = handle.read()
    except (OSError, EOFError) as error:  # a truncated or not-gzip .gz
        raise DatasetCorrupt(
            f"{path} cannot be read ({error}); re-install or re-copy it"
        ) from error
    header = 4 + 4 * ndim
    if len(raw) < header or raw[:4] != bytes((0, 0, 0x08, ndim)):
        raise DatasetCorrupt(
            f"{path} is not an IDX file of {ndim}-dimensional unsigned bytes (its first "
            f"bytes are {raw[:4].hex()}, expected 000008{ndim:02x}); re-install or re-copy it"
        )
    dims = tuple(int(d) for d in np.frombuffer(raw[4:header], ">u4"))
    if len(raw) != header + math.prod(dims):
        raise DatasetCorrupt(
            f"{path} holds {len(raw) - header} data bytes, its header says {dims} "
            f"({math.prod(dims)} bytes): truncated or padded; re-install or re-copy it"
        )
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims).copy()  # writable


# ---------------------------------------------------------------------- caching
def cached_index_lists(
    root: str, name: str, inputs: dict[str, object], compute: Callable[[], list[np.ndarray]]
) -> list[np.ndarray]:
    """A list of index arrays, computed once and kept as .npz in the data cache.

    Partitions are pure functions of their inputs; deployed clients start a fresh
    process for every message, so recomputing them (and importing the libraries that
    compute them) each time would dominate a message's cost.
    """
    path = _cache_dir(root) / f"{name}-{_digest(inputs)}.npz"
    if path.exists():
        with np.load(path) as stored:
            return [stored[f"a{i}"] for i in range(len(stored.files))]
    arrays = compute()
    _atomic_savez(path, {f"a{i}": np.asarray(a) for i, a in enumerate(arrays)})
    return arrays


def _cache_dir(root: str) -> Path:
    if root:
        return Path(root) / ".cache"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedpers"


def _digest(values: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def _atomic_savez(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write an .npz so that concurrent readers see either nothing or the whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_npz(path, arrays)
