"""FedGMM's Table 3 analogue: out-of-distribution detection on the digits.

    python -m simulations.fedgmm_ood --out DIR [--quick] [--seeds 3] [--num-clients 50]

FedGMM, FedEM, FedAvg and FedProx train through Flower on untransformed digits (50 clients,
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
- ``fedavg``: the maximum softmax of the global model;
- ``fedprox``: the same, of FedProx's global model (``fedprox-mu`` as in Table 1);
- ``fedavg-plus``: the maximum softmax of each client's adapted copy of FedAvg's global
  model on that client's samples. FedAvg+ trains exactly as FedAvg (the same run), and
  adapts before every test: here, as before its final test, the run's ``epochs`` on the
  client's training data.

Reported with in-distribution as the positive class: AUROC, average precision and the
maximum F1 over thresholds (scikit-learn). Flipped digits are reported but many digits
are nearly mirror-symmetric, so every method sits low there.

Writes DIR/summary.json ``{"auroc": {TRANSFORM: {METHOD: mean over seeds}}, "ap": {...},
"max_f1": {...}}``, each with ``_std``, ``_ci95`` and ``_per_seed``, DIR/table.md,
DIR/scores.png (first seed) and the runs under DIR/runs/.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, RecordDict
from sklearn.metrics import average_precision_score, precision_recall_curve, roc_auc_score

from fedpers import gmm, protocol
from fedpers.algorithms import fedgmm
from fedpers.config import RunConfig
from fedpers.data.client import client_data
from fedpers.families import mixture as mixture_family
from fedpers.reports import read_config
from fedpers.simulations.flags import add_key_flags, output_parser, seeds_of, settings
from fedpers.simulations.runs import run_methods
from fedpers.simulations.stats import add_statistics
from fedpers.simulations.tables import markdown_table, seeds_note, with_spread, write_summary

TRANSFORMS = ("rot90", "invert", "flip")
SCORES = ("fedgmm", "fedgmm-px", "fedem", "fedavg", "fedprox", "fedavg-plus")
TRAINED = ("fedgmm", "fedem", "fedavg", "fedprox")


SETTINGS: dict[str, Any] = {
    "dataset": "digits",
    "num-clients": 50,
    "num-rounds": 100,
    "fraction-train": 0.3,
    "partitioner": "dirichlet",
    "dirichlet-alpha": 0.4,
    "test-split": "per-client",
    "gmm-embedding": "pca",
    "gmm-embedding-dim": 16,
    "lr": 0.05,
    "momentum": 0.5,
    "batch-size": 10,
    "epochs": 5,
}
QUICK = {"num-clients": 20, "num-rounds": 8}  # AUROC 0.997+ on rot90 and invert, as at 15


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train the four methods, score in- and out-of-distribution samples."""
    parser = output_parser(__doc__.split("\n\n")[0])
    add_key_flags(
        parser,
        ["num-clients", "num-rounds", "gmm-embedding-dim"],
        SETTINGS,
        aliases={
            "num-clients": "clients",
            "num-rounds": "rounds",
            "gmm-embedding-dim": "embedding-dim",
        },
    )
    args = parser.parse_args(argv)
    seeds = seeds_of(args)
    values = settings(args, SETTINGS, QUICK)
    directories = run_methods(args, values, TRAINED, seeds)
    out = args.out.expanduser().resolve()
    per_seed: dict[str, Any] = {
        metric: {t: {m: [] for m in SCORES} for t in TRANSFORMS}
        for metric in ("auroc", "ap", "max_f1")
    }
    samples: dict[str, int] = {}
    first: dict[str, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = {}
    for seed in seeds:
        runs = {m: directories[(m, seed)] for m in TRAINED}
        scores = {t: score_all(runs, transform=t) for t in TRANSFORMS}
        if seed == seeds[0]:
            first = scores
        for transform, (inside, outside) in scores.items():
            samples[transform] = len(inside["fedavg"])
            for method in SCORES:
                for metric, value in detection_metrics(inside[method], outside[method]).items():
                    per_seed[metric][transform][method].append(value)
    result: dict[str, Any] = {"seeds": seeds}
    for metric, tree in per_seed.items():
        add_statistics(result, metric, tree)
    result["samples"] = samples
    result["settings"] = values
    write_summary(out, result)
    tables = _tables(result)
    (out / "table.md").write_text(
        f"# OOD detection on digits\n\n{seeds_note(seeds)}\n\n" + "\n".join(tables)
    )
    _plot(out / "scores.png", first)
    print("\n" + "\n".join(tables) + f"\nresults: {out}")
    return result


def _tables(result: dict[str, Any]) -> list[str]:
    """A markdown table per detection metric: each score under each transform."""
    tables = []
    for metric in ("auroc", "ap", "max_f1"):
        rows = [
            (
                m,
                *[
                    with_spread(
                        result[metric][t][m], result[f"{metric}_std"][t][m], scale=1, digits=3
                    )
                    for t in TRANSFORMS
                ],
            )
            for m in SCORES
        ]
        tables.append(f"## {metric}\n\n" + markdown_table(["score", *TRANSFORMS], rows))
    return tables


def detection_metrics(inside: np.ndarray, outside: np.ndarray) -> dict[str, float]:
    """AUROC, average precision and the best F1 over thresholds, in-distribution the
    positive class (scikit-learn)."""
    values = np.concatenate([inside, outside])
    labels = np.concatenate([np.ones(len(inside)), np.zeros(len(outside))])
    precision, recall, _ = precision_recall_curve(labels, values)
    f1 = 2 * precision * recall / np.maximum(precision + recall, 1e-12)
    return {
        "auroc": float(roc_auc_score(labels, values)),
        "ap": float(average_precision_score(labels, values)),
        "max_f1": float(f1.max()),
    }


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
            for method, value in sample_scores(runs, x, partition).items():
                target[method].append(value)
    return (
        {m: np.concatenate(v) for m, v in inside.items()},
        {m: np.concatenate(v) for m, v in outside.items()},
    )


def sample_scores(
    runs: dict[str, tuple[RunConfig, dict[str, np.ndarray]]], x: np.ndarray, partition: int
) -> dict[str, np.ndarray]:
    """The scores of samples ``x`` of client ``partition`` under the final global models
    (FedAvg+: the client's adapted copy of FedAvg's)."""
    out = {}
    for method in ("fedgmm", "fedem"):
        config, arrays = runs[method]
        densities = fedgmm.GAUSSIANS if method == "fedgmm" else mixture_family.NO_DENSITY
        log_weights = np.log(arrays[mixture_family.MIXTURE_WEIGHTS])
        log_gauss = densities.log_densities(config, x, arrays)
        probs = gmm.predict_proba(log_weights, log_gauss, np.exp(_log_probs(config, arrays, x)))
        confidence = np.log(np.maximum(probs.max(axis=1), 1e-300))
        if method == "fedgmm":
            log_px = gmm.log_marginal(log_weights, log_gauss)
            out["fedgmm"] = log_px + confidence
            out["fedgmm-px"] = log_px
        else:
            out["fedem"] = probs.max(axis=1)
    import torch

    def max_softmax(model: torch.nn.Module) -> np.ndarray:
        with torch.no_grad():
            model.eval()
            logits = model(torch.from_numpy(x))
            return torch.softmax(logits, dim=1).max(dim=1).values.numpy().astype(float)

    for method in ("fedavg", "fedprox"):
        config, arrays = runs[method]
        out[method] = max_softmax(_global_model(config, arrays))
    config, arrays = runs["fedavg"]
    last = ConfigRecord({protocol.ROUND: config.num_rounds, protocol.LR: config.lr})
    out["fedavg-plus"] = max_softmax(_adapted_copy(config, arrays, last, partition))
    return out


def _adapted_copy(
    config: RunConfig, arrays: dict[str, np.ndarray], settings: ConfigRecord, partition: int
) -> Any:
    """Client ``partition``'s copy of the global model after FedAvg+'s adaptation before
    a test (``fedpers.algorithms.fedavg_plus``: the run's epochs on its training data)."""
    from fedpers import update
    from fedpers.algorithms import fedavg_plus
    from fedpers.cohort import Cohort, Member

    member = Member(partition, RecordDict(), arrays)
    local = update.Personalized(Cohort(config, settings, [member]))
    model = _global_model(config, arrays)
    fedavg_plus.adapted(local, local.train_data()).load(0, model)
    return model


def _log_probs(config: RunConfig, arrays: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Every learner's ``log softmax(f_m(x))`` (n, M2, K) under the final global
    learners (the mixture family's update for a cohort of one)."""
    from fedpers import mixture_update
    from fedpers.cohort import Cohort, Member

    member = Member(0, RecordDict(), arrays)
    local = mixture_update.Mixture(
        Cohort(config, ConfigRecord(), [member]), mixture_family.NO_DENSITY
    )
    unlabelled = local.cohort_data([x], [np.zeros(len(x), dtype=np.int64)])  # labels unused
    return local.log_probs(local.stacked(), unlabelled)[0]


def _global_model(config: RunConfig, arrays: dict[str, np.ndarray]) -> Any:
    """The seeded model with the run's final global arrays."""
    from fedpers.models import build_model, load_part_arrays
    from fedpers.seeding import int_seed

    model = build_model(
        config.model_name, config.num_classes, int_seed(config.seed, "model"), config.input_shape
    )
    load_part_arrays(model, arrays)
    return model


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
