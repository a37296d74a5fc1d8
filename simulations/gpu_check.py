"""The client-side training loop on a GPU against the CPU: same models, same data; one
client at a time, and whole cohorts (the batched engine).

    python -m simulations.gpu_check [--out result.json] [--clients 1000]

What a client does on a machine with CUDA (``device = "auto"`` picks it): fedpers'
training loop and evaluation, FedRep's two phases (head, then body, the other part
frozen), CIFAR augmentation on device tensors. Two workloads: the digits MLP (tiny:
kernel launches dominate) and FedRep's CIFAR-10 CNN on CIFAR-shaped random data (500
samples a client, as in the paper's 100-client split). It prints and writes seconds per
client update on each device, the losses reached (they agree up to the
non-determinism of GPU kernels), and whether the frozen part stayed bit-identical on
the GPU too. Only fedpers and torch are needed (no Flower), so it runs on a bare GPU
machine; the simulation runs the same code inside each ClientApp, and several ClientApps
share one GPU with ``--federation-config "client-resources-num-gpus=0.25"``.

Then the batched engine's workload (``cohort_round``): one round of FedRep's local
update for ``--clients`` MNIST-1D clients of the scale benchmark (``simulations.scale``:
100 samples each, 5 head epochs and 1 body epoch, batch 10), as cohorts of up to 1,000
on each device, against the same clients one at a time on the GPU (a sample of 20,
scaled up): seconds a round, and the largest difference between the devices' trained
bodies. On a machine with a GPU, ``python -m simulations.scale --engines batched
--batched-sizes 100000 --engine-workers 1 --device cuda`` gives the scale table at
10,000 clients a round (one Ray shard, holding the GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedpers.data.sources import load_dataset
from fedpers.models import build_model, part_arrays
from fedpers.training import (
    SGDSettings,
    random_crop_flip,
    resolve_device,
)
from fedpers.training import (
    evaluate_model as evaluate,
)
from fedpers.training import (
    train_model as train,
)


def fedrep_update(
    name: str,
    x: np.ndarray,
    y: np.ndarray,
    device: torch.device,
    *,
    head_epochs: int,
    body_epochs: int,
    batch_size: int,
    augment: bool,
) -> dict[str, Any]:
    """One FedRep client update on ``device``: head epochs, then body epochs."""
    model = build_model(name, 10, seed=0, input_shape=tuple(x.shape[1:])).to(device)
    xt, yt = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    settings = SGDSettings(lr=0.01, momentum=0.5, weight_decay=1e-4, batch_size=batch_size)
    transform = random_crop_flip() if augment else None
    body_before = part_arrays(model, ("body",))
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    train(
        model, xt, yt, parts=("head",), epochs=head_epochs, settings=settings,
        generator=torch.Generator().manual_seed(1), augment=transform,
    )  # fmt: skip
    body_frozen = all(
        np.array_equal(v, body_before[k]) for k, v in part_arrays(model, ("body",)).items()
    )
    stats = train(
        model, xt, yt, parts=("body",), epochs=body_epochs, settings=settings,
        generator=torch.Generator().manual_seed(2), augment=transform,
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "last_epoch_loss": stats.loss,
        "train_accuracy": evaluate(model, xt, yt).accuracy,
        "frozen_body_unchanged": body_frozen,
    }


def cohort_round(device: torch.device, clients: int, *, cohort_size: int = 1000) -> dict[str, Any]:
    """One round of FedRep's local update of ``clients`` clients on ``device``, as
    cohorts of up to ``cohort_size`` (``families.personalized.fit``): its seconds and
    the bodies it returns."""
    from flwr.app import ConfigRecord, RecordDict

    from fedpers.cohort import Cohort, Member
    from fedpers.config import load_run_config
    from fedpers.data.client import clients_data
    from fedpers.families import personalized
    from fedpers.seeding import int_seed
    from fedpers.simulations.scale import settings

    run = load_run_config({**settings(clients, 4), "device": device.type, "results-dir": "."})
    model = build_model(
        run.model_name, run.num_classes, int_seed(run.seed, "model"), run.input_shape
    )
    body = part_arrays(model, ("body",))
    config = ConfigRecord({"server-round": 1, "epochs": 1, "head-epochs": 5, "lr": run.lr})
    partitions = list(range(clients))
    clients_data(run, partitions)  # the data first: the round times the training alone
    replies = []
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for start in range(0, clients, cohort_size):
        members = [
            Member(p, RecordDict(), dict(body)) for p in partitions[start : start + cohort_size]
        ]
        replies += personalized.fit(Cohort(run, config, members))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - started, "bodies": [r[0] for r in replies]}


def cohorts(devices: list[torch.device], clients: int) -> dict[str, Any]:
    """The batched engine's round on each device, and the GPU one client at a time."""
    found: dict[str, Any] = {}
    bodies = {}
    for device in devices:
        cohort_round(device, 20)  # warm up
        measured = cohort_round(device, clients)
        bodies[device.type] = measured.pop("bodies")
        found[f"{device.type} cohorts"] = measured
        if device.type == "cuda":
            sample = cohort_round(device, 20, cohort_size=1)
            found["cuda one client at a time"] = {"seconds": sample["seconds"] * clients / 20}
    if len(bodies) > 1:
        found["largest body difference"] = max(
            float(np.max(np.abs(a[k] - b[k])))
            for a, b in zip(bodies["cpu"], bodies["cuda"], strict=True)
            for k in a
        )
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run both workloads on the CPU and, when visible, the GPU; then the cohorts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--clients", type=int, default=1000, help="clients of the cohort round")
    args = parser.parse_args(argv)
    devices = [torch.device("cpu")]
    if resolve_device("auto").type == "cuda":
        devices.append(torch.device("cuda"))
    digits = load_dataset("digits", root="", seed=0, train_size=0)
    x_digits, y_digits = digits.features(digits.x_train), digits.y_train
    generator = np.random.default_rng(0)
    x_images = generator.standard_normal((500, 3, 32, 32)).astype(np.float32)
    y_images = generator.integers(0, 10, 500).astype(np.int64)
    workloads: dict[str, tuple[np.ndarray, np.ndarray, dict[str, Any]]] = {
        "digits-mlp": (
            x_digits,
            y_digits,
            {"head_epochs": 10, "body_epochs": 5, "batch_size": 10, "augment": False},
        ),
        "cifar10-cnn": (
            x_images,
            y_images,
            {"head_epochs": 10, "body_epochs": 1, "batch_size": 10, "augment": True},
        ),
    }
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if len(devices) > 1 else None,
        "auto_device": str(resolve_device("auto")),
        "workloads": {},
    }
    for name, (x, y, options) in workloads.items():
        result["workloads"][name] = {}
        for device in devices:
            fedrep_update(
                name, x[:50], y[:50], device, **{**options, "head_epochs": 1, "body_epochs": 1}
            )  # warm up
            result["workloads"][name][device.type] = fedrep_update(name, x, y, device, **options)
        print(name, json.dumps(result["workloads"][name]), flush=True)
    result["cohorts"] = cohorts(devices, args.clients)
    print("cohorts", json.dumps(result["cohorts"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
