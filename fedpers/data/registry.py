"""Static facts about the data sets fedpers knows (no loading, no heavy imports).

The configuration validates against these facts before any run starts, so a wrong
number of classes or an unknown data set is an error at the command line, not a crash
in a Ray actor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DatasetInfo:
    """What a data set is, independent of how it is loaded.

    Parameters
    ----------
    num_classes : int
        Number of labels (1 for the regression tasks).
    input_shape : tuple of int, optional
        Shape of one input sample as the model sees it (None: set by the run config).
    default_model : str
        Model used when the run config says ``model = "auto"``.
    embedded : bool
        True when the data set needs no files (generated or shipped with a package).
    how_to_get : str
        For data sets read from a local root: how to place the files there.
    image_shape : tuple of int, optional
        Channels-first image shape of the raw samples (None: not images), for the
        image transforms of the joint-distribution shift.
    raw_maximum : float
        Largest raw value (for the ``invert`` transform).
    run_family : str
        The family that every run on this data set belongs to, whatever its row (the
        linear tasks: ``fedpers.families.linear``); empty: the row's family.
    partitioned : bool
        False when clients draw fresh samples instead of holding a partition.
    per_client_split : bool
        True when each client splits its own data 60/20/20 (FedEM's protocol).
    train_samples, test_samples : int, optional
        Samples of the training and test splits, where they are fixed (None: the data
        set grows with the run, or does not say); the configuration refuses more
        clients than there are samples to split.
    """

    num_classes: int
    input_shape: tuple[int, ...] | None
    default_model: str
    embedded: bool
    how_to_get: str = ""
    image_shape: tuple[int, ...] | None = None
    raw_maximum: float = 255.0
    run_family: str = ""
    partitioned: bool = True
    per_client_split: bool = False
    train_samples: int | None = None
    test_samples: int | None = None


_TORCHVISION_HINT = (
    "On a machine with internet access run\n"
    "  python -c \"import torchvision; torchvision.datasets.{cls}('ROOT', download=True{extra})\"\n"
    "and copy ROOT/{folder} into the data root given by --run-config \"data-root='ROOT'\"."
)

# Where Debian's package dataset-fashion-mnist installs the four IDX files (gzipped).
FASHION_MNIST_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"
_FASHION_MNIST_HINT = (
    "Install it with 'apt-get install dataset-fashion-mnist' (Debian and Ubuntu; read from "
    f"{FASHION_MNIST_SYSTEM_DIR} when data-root is empty), or place the four IDX files "
    "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
    "t10k-labels-idx1-ubyte (each may end in .gz) in ROOT/fashion-mnist and pass "
    "--run-config \"data-root='ROOT'\"."
)

DATASETS: dict[str, DatasetInfo] = {
    "mnist1d": DatasetInfo(10, (40,), "mnist1d-mlp", embedded=True),
    "digits": DatasetInfo(
        10,
        (64,),
        "digits-mlp",
        embedded=True,
        image_shape=(1, 8, 8),
        raw_maximum=16.0,
        train_samples=1347,  # of scikit-learn's 1797, 75/25 (fedpers.data.sources)
        test_samples=450,
    ),
    "linear": DatasetInfo(1, None, "linear", embedded=True, run_family="linear", partitioned=False),
    "mixture": DatasetInfo(2, None, "logistic", embedded=True, per_client_split=True),
    "mnist": DatasetInfo(
        10,
        (1, 28, 28),
        "femnist-mlp",
        embedded=False,
        how_to_get=_TORCHVISION_HINT.format(cls="MNIST", extra="", folder="MNIST"),
        train_samples=60000,
        test_samples=10000,
        image_shape=(1, 28, 28),
    ),
    "femnist": DatasetInfo(
        10,
        (1, 28, 28),
        "femnist-mlp",
        embedded=False,
        how_to_get=_TORCHVISION_HINT.format(
            cls="EMNIST", extra=", split='letters'", folder="EMNIST"
        ),
        train_samples=48000,  # EMNIST letters a-j: 4,800 and 800 a letter
        test_samples=8000,
        image_shape=(1, 28, 28),
    ),
    "fashion-mnist": DatasetInfo(
        10,
        (1, 28, 28),
        "femnist-mlp",
        embedded=False,
        how_to_get=_FASHION_MNIST_HINT,
        train_samples=60000,
        test_samples=10000,
        image_shape=(1, 28, 28),
    ),
    "cifar10": DatasetInfo(
        10,
        (3, 32, 32),
        "cifar10-cnn",
        embedded=False,
        how_to_get=_TORCHVISION_HINT.format(cls="CIFAR10", extra="", folder="cifar-10-batches-py"),
        train_samples=50000,
        test_samples=10000,
        image_shape=(3, 32, 32),
    ),
    "cifar100": DatasetInfo(
        100,
        (3, 32, 32),
        "cifar100-cnn",
        embedded=False,
        how_to_get=_TORCHVISION_HINT.format(cls="CIFAR100", extra="", folder="cifar-100-python"),
        train_samples=50000,
        test_samples=10000,
        image_shape=(3, 32, 32),
    ),
}

# Which models accept which input shape (checked by the configuration).
MODEL_INPUTS: dict[str, tuple[int, ...] | None] = {
    "mnist1d-mlp": (40,),
    "digits-mlp": (64,),
    "femnist-mlp": (1, 28, 28),
    "mnist1d-mlp-bn": (40,),
    "digits-mlp-bn": (64,),
    "femnist-mlp-bn": (1, 28, 28),
    "cifar10-cnn": (3, 32, 32),
    "cifar100-cnn": (3, 32, 32),
    "cifar10-cnn-bn": (3, 32, 32),
    "cifar100-cnn-bn": (3, 32, 32),
    "logistic": None,  # any input, flattened
    "linear": None,  # any vector input
}
BUILT_IN_MODELS = frozenset(MODEL_INPUTS)  # before any extension registers its own
# The built-in models with BatchNorm layers (FedBN keeps them on the device): a server
# that never imports torch knows them by name.
BATCH_NORM_MODELS = frozenset(
    {"mnist1d-mlp-bn", "digits-mlp-bn", "femnist-mlp-bn", "cifar10-cnn-bn", "cifar100-cnn-bn"}
)
