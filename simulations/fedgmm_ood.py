"""FedGMM's Table 3 analogue: out-of-distribution detection on the digits.

    python -m simulations.fedgmm_ood --out DIR [--quick] [--clients 50] [--rounds 100]

FedGMM, FedEM and FedAvg train through Flower on untransformed digits (50 clients,
labels split with Dir(0.4), per-client 60/20/20 splits, FedGMM's Gaussians on a pooled
PCA-16 embedding). Then every client's test samples (in-distribution) are scored
against the same samples transformed (out-of-distribution): rotated by 90 degrees,
inverted, or flipped horizontally, one set per transform. Scores, higher meaning "in
distribution", all from the final global model and the global mixture weights
``pi ~ sum_c gamma_c``:

- ``fedgmm``: the paper's combined score ``log p(x) + log max_y p(y | x)``
  (``log p(x, y_hat)``; no label is needed at test time);
- ``fedgmm-px``: ``log p(x)`` alone;
- ``fedem``: the maximum of FedEM's mixture prediction (maximum softmax);
- ``fedavg``: the maximum softmax of the global model.

Reported with in-distribution as the positive class: AUROC, average precision and the
maximum F1 over thresholds (scikit-learn). Flipped digits are reported but many digits
are nearly mirror-symmetric, so every method sits low there.

Writes DIR/summary.json ``{"auroc": {TRANSFORM: {METHOD: v}}, "ap": {...},
"max_f1": {...}}``, DIR/table.md, DIR/scores.png and the runs under DIR/runs/.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import RecordDict
from sklearn.metrics import average_precision_score, precision_recall_curve, roc_auc_score

from fedpers import gmm, protocol
from fedpers.config import RunConfig
from fedpers.data.client import client_data
from fedpers.results import read_config
from simulations.common import (
    config_help,
    markdown_table,
    output_parser,
    parallelism,
    prepare_output,
    validate_runs,
    write_summary,
)
from simulations.launch import LocalSimulation

TRANSFORMS = ("rot90", "invert", "flip")
SCORES = ("fedgmm", "fedgmm-px", "fedem", "fedavg")
TRAINED = ("fedgmm", "fedem", "fedavg")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train the three methods, score in- and out-of-distribution samples."""
    parser = output_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--clients", type=int, default=50, help=config_help("num-clients", script=True)
    )
    parser.add_argument(
        "--rounds", type=int, default=100, help=config_help("num-rounds", script=True)
    )
    parser.add_argument(
        "--embedding-dim", type=int, default=16, help=config_help("gmm-embedding-dim", script=True)
    )
    parser.add_argument("--seed", type=int, default=0, help=config_help("seed", script=True))
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.rounds = 20, 15
    settings = {
        "dataset": "digits",
        "num-clients": args.clients,
        "num-rounds": args.rounds,
        "fraction-train": 0.3,
        "partitioner": "dirichlet",
        "dirichlet-alpha": 0.4,
        "test-split": "per-client",
        "gmm-embedding": "pca",
        "gmm-embedding-dim": args.embedding_dim,
        "lr": 0.05,
        "momentum": 0.5,
        "batch-size": 10,
        "epochs": 5,
        "seed": args.seed,
        "results-dir": str(args.out.expanduser().resolve() / "runs"),
    }
    runs = [{**settings, "algorithm": m, "run-name": m} for m in TRAINED]
    validate_runs(runs)
    out = prepare_output(args.out, overwrite=args.overwrite)
    with LocalSimulation() as simulation:
        directories = dict(
            zip(TRAINED, simulation.run_all(runs, parallel=parallelism(args)), strict=True)
        )
    scores = {t: score_all(directories, transform=t) for t in TRANSFORMS}
    result: dict[str, Any] = {"auroc": {}, "ap": {}, "max_f1": {}}
    for transform, (inside, outside) in scores.items():
        for metric in result:
            result[metric][transform] = {}
        for method in SCORES:
            values = np.concatenate([inside[method], outside[method]])
            labels = np.concatenate([np.ones(len(inside[method])), np.zeros(len(outside[method]))])
            result["auroc"][transform][method] = float(roc_auc_score(labels, values))
            result["ap"][transform][method] = float(average_precision_score(labels, values))
            precision, recall, _ = precision_recall_curve(labels, values)
            f1 = 2 * precision * recall / np.maximum(precision + recall, 1e-12)
            result["max_f1"][transform][method] = float(f1.max())
    result["samples"] = {t: len(inside["fedavg"]) for t, (inside, _) in scores.items()}
    result["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    write_summary(out, result)
    tables = []
    for metric in ("auroc", "ap", "max_f1"):
        rows = [(m, *[result[metric][t][m] for t in TRANSFORMS]) for m in SCORES]
        tables.append(f"## {metric}\n\n" + markdown_table(["score", *TRANSFORMS], rows))
    (out / "table.md").write_text("# OOD detection on digits\n\n" + "\n".join(tables))
    _plot(out / "scores.png", scores)
    print("\n" + "\n".join(tables) + f"\nresults: {out}")
    return result


def score_all(
    directories: dict[str, Path], *, transform: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Scores of every client's test samples and of their transformed copies."""
    inside: dict[str, list[np.ndarray]] = {m: [] for m in SCORES}
    outside: dict[str, list[np.ndarray]] = {m: [] for m in SCORES}
    runs = {m: _load(d) for m, d in directories.items()}
    config = runs["fedgmm"][0]
    for partition in range(config.num_clients):
        clean = client_data(config, partition).x_test
        moved = client_data(config, partition, transforms=(transform,)).x_test
        for target, x in ((inside, clean), (outside, moved)):
            if len(x) == 0:
                continue
            for method, value in sample_scores(runs, x).items():
                target[method].append(value)
    return (
        {m: np.concatenate(v) for m, v in inside.items()},
        {m: np.concatenate(v) for m, v in outside.items()},
    )


def sample_scores(
    runs: dict[str, tuple[RunConfig, dict[str, np.ndarray]]], x: np.ndarray
) -> dict[str, np.ndarray]:
    """The four scores of samples ``x`` under the final global models."""
    out = {}
    for method in ("fedgmm", "fedem"):
        config, arrays = runs[method]
        client = config.spec.client_class()(config, 0, RecordDict())
        client.load_learners(arrays)
        log_weights = np.log(arrays[protocol.MIXTURE_WEIGHTS])
        log_gauss = client.log_densities(x, arrays)
        probs = gmm.predict_proba(log_weights, log_gauss, np.exp(client.learner_log_probs(x)))
        confidence = np.log(np.maximum(probs.max(axis=1), 1e-300))
        if method == "fedgmm":
            log_px = gmm.log_marginal(log_weights, log_gauss)
            out["fedgmm"] = log_px + confidence
            out["fedgmm-px"] = log_px
        else:
            out["fedem"] = probs.max(axis=1)
    config, arrays = runs["fedavg"]
    client = config.spec.client_class()(config, 0, RecordDict())
    client.load_shared(arrays)
    import torch

    with torch.no_grad():
        client.model.eval()
        logits = client.model(torch.from_numpy(x))
        out["fedavg"] = torch.softmax(logits, dim=1).max(dim=1).values.numpy().astype(float)
    return out


def _load(directory: Path) -> tuple[RunConfig, dict[str, np.ndarray]]:
    config = RunConfig.from_mapping(read_config(directory))
    with np.load(directory / "final_arrays.npz") as stored:
        return config, {k: stored[k] for k in stored.files}


def _plot(
    path: Path, scores: dict[str, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(len(scores), 2, figsize=(9, 2.6 * len(scores)))
    for row, (transform, (inside, outside)) in enumerate(scores.items()):
        for col, method in enumerate(("fedgmm", "fedavg")):
            ax = axes[row, col]
            ax.hist(inside[method], bins=40, alpha=0.6, density=True, label="in distribution")
            ax.hist(outside[method], bins=40, alpha=0.6, density=True, label=transform)
            ax.set_title(f"{method} score, {transform}", fontsize=9)
            ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    main(sys.argv[1:])
