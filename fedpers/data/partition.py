"""Split a labelled data set over clients.

Training splits:
- ``classes``: S classes per client (the FedRep paper's scheme), by flwr-datasets'
  ``PathologicalPartitioner`` (first class deterministic, the others random; a class
  is split evenly among the clients that hold it).
- ``dirichlet``: label proportions per client from Dirichlet(alpha), by flwr-datasets'
  ``DirichletPartitioner``.
- ``lognormal``: S classes per client with log-normal client sizes (the FEMNIST setting
  of FedRep, after Li et al. 2019); no library partitioner combines the two.

Test splits follow the training splits (``split_test_like_train``): each client's test
samples are drawn from the test split over the same classes, in proportion to its
training labels, disjoint across clients.
"""

from __future__ import annotations

import numpy as np

from fedpers.seeding import int_seed, rng


def partition_classes(
    labels: np.ndarray, num_clients: int, classes_per_client: int, seed: int
) -> list[np.ndarray]:
    """Indices per client, ``classes_per_client`` distinct classes each.

    Returns
    -------
    list of np.ndarray
        ``num_clients`` arrays of indices into ``labels``.
    """
    from flwr_datasets.partitioner import PathologicalPartitioner

    partitioner = PathologicalPartitioner(
        num_partitions=num_clients,
        partition_by="label",
        num_classes_per_partition=classes_per_client,
        class_assignment_mode="first-deterministic",
        shuffle=True,
        seed=int_seed(seed, "partition-classes") % 2**32,
    )
    return _run_partitioner(partitioner, labels, num_clients)


def partition_dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, seed: int
) -> list[np.ndarray]:
    """Indices per client with Dirichlet(``alpha``) label proportions."""
    from flwr_datasets.partitioner import DirichletPartitioner

    # Small data sets cannot give every client 10 samples under a skewed Dirichlet:
    # ask for what a quarter of the average share allows.
    min_size = max(1, min(10, len(labels) // (4 * num_clients)))
    partitioner = DirichletPartitioner(
        num_partitions=num_clients,
        partition_by="label",
        alpha=alpha,
        min_partition_size=min_size,
        self_balancing=False,
        shuffle=True,
        seed=int_seed(seed, "partition-dirichlet") % 2**32,
    )
    return _run_partitioner(partitioner, labels, num_clients)


def partition_lognormal(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    mean_size: float,
    sigma: float,
    seed: int,
) -> list[np.ndarray]:
    """S classes per client and client sizes ~ LogNormal with mean ``mean_size``.

    Client ``i`` holds class ``i mod C`` and ``S - 1`` further random classes. Its size is
    split evenly across its classes. Where the demand for a class exceeds its samples,
    every demand on that class is scaled down by the same factor.
    """
    generator = rng(seed, "partition-lognormal")
    classes = np.unique(labels)
    mu = np.log(mean_size) - sigma**2 / 2  # E[size] = mean_size
    sizes = np.maximum(1, np.round(generator.lognormal(mu, sigma, num_clients)))
    held = []
    for client in range(num_clients):
        first = classes[client % len(classes)]
        others = generator.permutation(classes[classes != first])[: classes_per_client - 1]
        held.append(np.concatenate([[first], others]))
    demand = np.zeros((num_clients, len(classes)))
    for client, client_classes in enumerate(held):
        demand[client, np.searchsorted(classes, client_classes)] = (
            sizes[client] / classes_per_client
        )
    pools = [generator.permutation(np.flatnonzero(labels == c)) for c in classes]
    supply = np.array([len(pool) for pool in pools], dtype=float)
    scale = np.minimum(1.0, supply / np.maximum(demand.sum(axis=0), 1e-12))
    counts = np.floor(demand * scale).astype(int)
    counts[(demand > 0) & (counts == 0)] = 1  # every held class has a sample...
    for c, pool in enumerate(pools):  # ...unless the class has fewer samples than holders
        column = counts[:, c]
        for _ in range(int(column.sum()) - len(pool)):
            column[np.argmax(column)] -= 1
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, pool in enumerate(pools):
        offsets = np.concatenate([[0], np.cumsum(counts[:, c])])
        for holder in np.flatnonzero(counts[:, c]):
            parts[holder].append(pool[offsets[holder] : offsets[holder + 1]])
    return [
        generator.permutation(np.concatenate(p)) if p else np.array([], dtype=np.int64)
        for p in parts
    ]


def split_test_like_train(
    train_labels: list[np.ndarray], test_labels: np.ndarray, seed: int
) -> list[np.ndarray]:
    """Give each client test samples with its training label distribution.

    The test samples of class ``c`` are shuffled and divided among the clients in
    proportion to how many training samples of class ``c`` each holds (largest
    remainder rounding), so every client is tested on its own classes, no test sample
    is used twice, and a client with no sample of a class gets no test sample of it.
    """
    generator = rng(seed, "split-test")
    num_clients = len(train_labels)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in np.unique(test_labels):
        pool = generator.permutation(np.flatnonzero(test_labels == c))
        held = np.array([np.count_nonzero(y == c) for y in train_labels], dtype=float)
        if held.sum() == 0:
            continue
        share = held / held.sum() * len(pool)
        counts = np.floor(share).astype(int)
        remainder = len(pool) - int(counts.sum())
        order = np.argsort(-(share - counts), kind="stable")
        counts[order[:remainder]] += 1
        offsets = np.concatenate([[0], np.cumsum(counts)])
        for client in np.flatnonzero(counts):
            parts[client].append(pool[offsets[client] : offsets[client + 1]])
    return [np.sort(np.concatenate(p)) if p else np.array([], dtype=np.int64) for p in parts]


def _run_partitioner(partitioner: object, labels: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Apply a flwr-datasets partitioner to a label vector; return index arrays."""
    from datasets import Dataset as HFDataset

    table = HFDataset.from_dict({"label": labels.astype(np.int64), "index": np.arange(len(labels))})
    partitioner.dataset = table  # type: ignore[attr-defined]
    return [
        np.asarray(partitioner.load_partition(i)["index"], dtype=np.int64)  # type: ignore[attr-defined]
        for i in range(num_clients)
    ]


def target_classes(count: int, num_classes: int, seed: int) -> list[frozenset[int]]:
    """Each client's target classes under the pilot protocol's shift
    (``partition_shift``; Sheaf-FRL's agents): 3 or 4 (alternating), drawn from the seed
    (the stream keeps its first user's name)."""
    generator = rng(seed, "sheaf-targets")
    return [
        frozenset(int(c) for c in generator.choice(num_classes, 3 + i % 2, replace=False))
        for i in range(count)
    ]


def partition_shift(
    labels: np.ndarray, targets: list[frozenset[int]], shift: float, seed: int
) -> list[np.ndarray]:
    """Sheaf-FRL's distribution-shift partition with parameter ``s``.

    Agent ``i``'s weight for class ``k`` is ``theta_i[k] = (1 - s) / C + s 1[k in T_i] /
    |T_i|``; the samples of each class are split among the agents by a multinomial draw
    with probabilities ``theta_i[k] / sum_m theta_m[k]``. ``s = 0`` is uniform; at
    ``s = 1`` an agent sees only its target classes ``T_i``.
    """
    generator = rng(seed, "partition-shift")
    classes = np.unique(labels)
    theta = np.full((len(targets), len(classes)), (1.0 - shift) / len(classes))
    for i, held in enumerate(targets):
        for c in held:
            theta[i, np.searchsorted(classes, c)] += shift / len(held)
    parts: list[list[np.ndarray]] = [[] for _ in targets]
    for column, c in enumerate(classes):
        pool = generator.permutation(np.flatnonzero(labels == c))
        weights = theta[:, column]
        if weights.sum() == 0:
            continue
        owner = generator.choice(len(targets), size=len(pool), p=weights / weights.sum())
        for i in range(len(targets)):
            parts[i].append(pool[owner == i])
    return [np.sort(np.concatenate(p)) for p in parts]
