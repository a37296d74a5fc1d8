"""What FedAMP's server costs a round at many clients: its cloud models, two ways.

    python -m simulations.server_cost [--clients 1000] [--fraction 0.1]
                                      [--model mnist1d-mlp] [--reps 3]

FedAMP's server keeps every client's last model and sends each sampled client its cloud
model, the attention-weighted mix of all of them (``fedpers.strategies.fedamp``): per
round, sampled x clients x parameters for the distances and as much again for the mixes.
This benchmark calls the strategy's ``train_contents`` on a state of ``--clients``
models (the seeded ``--model`` with a different random perturbation per client) and
times it two ways, interleaved rep by rep (this machine's speed drifts within minutes):

- ``one at a time``: each sampled client's cloud model alone, its mix by
  ``fedpers.aggregation.weighted_mean`` (``FedAMP.cloud_model``, the server's path
  under a robust ``aggregation``);
- ``all at once``: the server as it runs under the weighted mean
  (``FedAMP.cloud_models``: every sampled client's mix in one pass over the models).

Both compute the distances a block of rows at a time
(``fedpers.algorithms.fedamp.squared_distances``).

It prints each one's median and fastest round, the ratio, the SHA-256 of every array
sent by each (equal: the two are the same sums in the same order), and the state's
size per client. One thread of numpy's own (no BLAS call is made).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedpers import protocol
from fedpers.algorithms.fed_mtl import TASK
from fedpers.config import load_run_config
from fedpers.models import MODELS, build_model
from fedpers.strategies import build_strategy
from fedpers.strategies.fedamp import FedAMP


def state(model: str, clients: int, seed: int = 0) -> ArrayRecord:
    """``clients`` models: the seeded ``model`` plus 0.01 standard normal noise each."""
    reference = build_model(model, 10, seed).state_dict()
    generator = np.random.default_rng(seed)
    return ArrayRecord(
        {
            f"{TASK}{p}.{name}": Array(
                (value.numpy() + 0.01 * generator.standard_normal(value.shape)).astype(np.float32)
            )
            for p in range(clients)
            for name, value in reference.items()
        }
    )


def digest(contents: dict[int, RecordDict]) -> str:
    """SHA-256 over every array sent, by client and name."""
    h = hashlib.sha256()
    for partition in sorted(contents):
        for name, array in contents[partition].array_records[protocol.ARRAYS].items():
            h.update(f"{partition}.{name}".encode())
            h.update(array.numpy().tobytes())
    return h.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--fraction", type=float, default=0.1, help="fraction-train")
    parser.add_argument("--model", default="mnist1d-mlp", choices=sorted(MODELS))
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    for flag in ("clients", "reps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if not 0 < args.fraction <= 1:
        parser.error(f"--fraction must be in (0, 1], got {args.fraction}")
    config = load_run_config(
        {
            "algorithm": "fedamp",
            "num-clients": args.clients,
            "fraction-train": args.fraction,
            "model": args.model,
        }
    )
    strategy = build_strategy(config)
    assert isinstance(strategy, FedAMP)
    arrays = state(args.model, args.clients)
    size = sum(a.numpy().nbytes for a in arrays.values())
    original = strategy.cloud_models

    def one_at_a_time(rows: list[int], everyone: list[int], flat: np.ndarray) -> list:
        return [strategy.cloud_model(i, everyone, flat) for i in rows]

    ways: dict[str, Callable] = {"one at a time": one_at_a_time, "all at once": original}
    times: dict[str, list[float]] = {way: [] for way in ways}
    digests: dict[str, str] = {}
    for rep in range(args.reps):
        for way, cloud_models in ways.items():
            strategy.cloud_models = cloud_models  # type: ignore[method-assign]
            start = time.perf_counter()
            contents = strategy.train_contents(1, arrays, ConfigRecord({}), None)  # type: ignore[arg-type]
            times[way].append(time.perf_counter() - start)
            digests[way] = digest(contents)
        print(
            f"rep {rep + 1}/{args.reps}: "
            + ", ".join(f"{w} {t[-1]:.2f} s" for w, t in times.items()),
            file=sys.stderr,
        )
    print(
        f"FedAMP's server, {args.model}, {args.clients} clients, "
        f"{len(contents)} sampled a round; state {size / 2**20:.1f} MB "
        f"({size // args.clients:,} bytes a client)"
    )
    print(f"{'way':<16}{'median s':>10}{'fastest s':>11}  sha-256 of the arrays sent")
    for way, values in times.items():
        print(
            f"{way:<16}{statistics.median(values):>10.3f}{min(values):>11.3f}  {digests[way][:16]}"
        )
    ratio = statistics.median(times["all at once"]) / statistics.median(times["one at a time"])
    same = "equal" if len(set(digests.values())) == 1 else "DIFFERENT"
    print(f"all at once / one at a time: {ratio:.3f}; arrays sent {same}")
    return 0 if same == "equal" else 1


if __name__ == "__main__":
    sys.exit(main())
