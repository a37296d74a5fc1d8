"""Named, independent random streams derived from the run seed.

Every random choice in fedpers draws from a stream named by what it is for (``"sample"``,
``"partition"``, ``"batches"``) and by the ids it concerns (partition id, round), so
results do not depend on the order in which clients run or on global RNG state.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np


def _key(part: int | str) -> int:
    if isinstance(part, str):
        return zlib.crc32(part.encode())
    if part < 0:
        raise ValueError(f"stream keys must be non-negative integers, got {part}")
    return part


def stream_seed(seed: int, *keys: int | str) -> np.random.SeedSequence:
    """A SeedSequence for the stream ``(seed, *keys)``."""
    return np.random.SeedSequence([_key(seed), *(_key(k) for k in keys)])


def rng(seed: int, *keys: int | str) -> np.random.Generator:
    """A numpy Generator for the stream ``(seed, *keys)``."""
    return np.random.default_rng(stream_seed(seed, *keys))


def int_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit integer seed for libraries that take one (torch, sklearn)."""
    return int(stream_seed(seed, *keys).generate_state(2, np.uint32).view(np.uint64)[0] >> 1)


def seed_torch(seed: int, device_type: str = "cpu") -> None:
    """Seed torch's global generator for ``device_type``, as ``torch.manual_seed`` does.

    On the CPU only the CPU generator is seeded: ``torch.manual_seed`` also queues a
    seeding of every accelerator, and with CUDA built in but not started each queued call
    formats the Python stack (``torch.cuda._lazy_call``), which cost seconds per script
    run when clients seed dropout for every training call. CPU draws (weight initialisation,
    dropout) come from the CPU generator alone, so the results are the same bits. On an
    accelerator, ``torch.manual_seed`` seeds its generator too.
    """
    import torch

    if device_type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


@contextmanager
def isolated_global_numpy_and_random() -> Iterator[None]:
    """Restore numpy's and Python's global RNG state on exit.

    For libraries that call ``np.random.seed`` (mnist1d does): their seeding must not
    leak into anything else that happens in the same process.
    """
    import random

    numpy_state = np.random.get_state()  # noqa: NPY002 - the legacy global state itself
    python_state = random.getstate()
    try:
        yield
    finally:
        np.random.set_state(numpy_state)  # noqa: NPY002
        random.setstate(python_state)
