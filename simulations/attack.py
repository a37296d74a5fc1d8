"""What client-level DP buys, measured: membership inference on the released model.

    python -m simulations.attack --out DIR [--methods fedrep,fedavg] [--epsilons 1,8,inf]
        [--seeds 1] [--num-clients 100] [--num-rounds 30] [--run-config "key=value ..."]
        [--dataset digits|fashion-mnist] [--in-process] [--parallel N] [--quick]

Every (method, epsilon, seed) trains on scikit-learn's handwritten digits (scanned 8x8
images: the real images every machine has) or on Fashion-MNIST (28x28 photographs of
clothing, ``--dataset fashion-mnist``: Debian's ``dataset-fashion-mnist``, the FedRep
table's protocol of 600 images a client, ``DATASETS``), 2 classes a client; a finite
epsilon runs
``dp = "central"`` with ``dp-target-epsilon`` (``fedpers.privacy``), ``inf`` without DP.
The attacker holds what the guarantee covers, the released shared model
(``final_arrays.npz``), and the records it asks about: each client's training samples
(members) and its test samples (non-members, of the same clients and classes, never
trained on). It guesses by the record's loss (Yeom et al., "Privacy Risk in Machine
Learning", CSF 2018): the lower, the likelier a member. FedAvg releases the whole model:
the loss is the model's. FedRep releases the body only: the attacker completes it, for
each client, with the multinomial logistic-regression head that fits that client's
records best (members and non-members alike, as it cannot tell them apart), and takes
that head's loss.

Success: the area under the ROC curve of members against non-members (0.5: chance) and
the membership advantage ``max(TPR - FPR)`` (scikit-learn's ``roc_curve``), next to
the largest advantage an ``(epsilon, delta)`` guarantee allows,
``(e^eps' - 1 + 2 delta) / (e^eps' + 1)`` (Kairouz et al. 2015's hypothesis-testing
region), where ``eps' = 2 epsilon``: one record changed is a client removed and another
added under add-or-remove-one neighbours (group privacy of two).

A second attacker holds what the server sees: one client's update. After training, the
first ``UPDATE_TARGETS`` clients each make their next update from the released model as
their device makes it (the ClientApp through a grid, its DP mechanism included; their
personal state fresh), and the attacker scores each of the client's records by the
cosine between the update and the record's descent direction at the model sent, its
negative gradient of the loss with respect to the shared parts (the passive attack of
Li et al., "Effective Passive Membership Inference Attacks in Federated Learning against
Overparameterized Models", ICLR 2023: a member's gradient points along the update, a
non-member's is nearly orthogonal to it). FedRep's attacker completes the body with the
fitted head above. Under ``--dp central`` (the default) the device sends its update in
the clear, so the guarantee does not cover this attacker; under ``--dp distributed`` the
device clips and noises its update before it leaves (with fixed-size sampling, which
distributed DP needs), and the guarantee covers what the server sees.

Writes DIR/summary.json: ``final_accuracy``, ``attack_auc``, ``attack_advantage``,
``update_auc``, ``update_advantage``, ``advantage_bound`` and ``epsilon_spent``, each
``[method][epsilon]`` (mean over seeds; the bound from the largest epsilon spent),
``by_seed`` (the first five by seed, in the order of ``seeds``), DIR/table.md (the
accuracy and both AUCs as mean ± sample std over the seeds) and the runs under
DIR/runs/.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedpers.reports import read_summary
from fedpers.results import read_config
from fedpers.simulations.flags import (
    add_in_process_flag,
    add_key_flags,
    output_parser,
    seeds_of,
    settings,
)
from fedpers.simulations.privacy import INF, parse_epsilons, private_values
from fedpers.simulations.runs import run_all
from fedpers.simulations.tables import markdown_table, seeds_note, write_summary

METHODS = ("fedrep", "fedavg")
EPSILONS = "1,8,inf"
UPDATE_TARGETS = 10  # clients whose next update the update attack reads
DP_MODES = ("central", "distributed")
# The experiment: the digits, 100 clients x 2 classes (about 13 training and 4 test
# samples each), 20% of them a round (Poisson), 30 rounds of 5 local epochs. The clip
# (0.1) keeps FedAvg's noised model from diverging at epsilon 1 (z = 4.38: at 1.0, or
# with 20 clients, its weights grew past what screening accepts); it was set by that
# check, not tuned on validation data.
SCRIPT: dict[str, Any] = {
    "dataset": "digits",
    "partitioner": "classes",
    "classes-per-client": 2,
    "num-clients": 100,
    "num-rounds": 30,
    "fraction-train": 0.2,
    "final-rounds": 5,
    "epochs": 5,
    "dp-clip": 0.1,
    "dp-sampling": "poisson",
    "dp-delta": 1e-5,
}
QUICK = {"num-rounds": 3, "final-rounds": 1, "epochs": 1, "head-epochs": 2}
# Each data set's own keys over SCRIPT's. Fashion-MNIST: the FedRep table's partition
# (its whole training split, 600 images a client) and learning rate (0.01), one local
# epoch (that table's, the paper's CIFAR-10 column; five would cost a run five times
# its 5 minutes here), the digits' clip and schedule otherwise (not tuned on this data).
DATASETS: dict[str, dict[str, Any]] = {
    "digits": {},
    "fashion-mnist": {"dataset": "fashion-mnist", "lr": 0.01, "epochs": 1},
}


def record_losses(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    """Every member's and every non-member's loss under the model a run released
    (module docstring): two arrays, over all its seen clients."""
    import torch
    from torch.nn import functional

    from fedpers.config import RunConfig
    from fedpers.data.client import client_data
    from fedpers.models import build_model, load_part_arrays

    config = RunConfig.from_mapping(read_config(directory))
    model = build_model(config.model_name, config.num_classes, config.seed, config.input_shape)
    with np.load(directory / "final_arrays.npz") as released:
        load_part_arrays(model, {name: released[name] for name in released.files})
    whole = "head" in config.spec.shared
    members: list[np.ndarray] = []
    others: list[np.ndarray] = []
    model.eval()
    for partition in range(config.seen_clients):
        data = client_data(config, partition)
        with torch.no_grad():
            if whole:
                for x, y, out in (
                    (data.x_train, data.y_train, members),
                    (data.x_test, data.y_test, others),
                ):
                    # in float64: a memorized record's loss is below float32's resolution
                    logits = model(torch.as_tensor(x)).double()
                    out.append(
                        functional.cross_entropy(
                            logits, torch.as_tensor(y), reduction="none"
                        ).numpy()
                    )
                continue
            features = [
                model.body(torch.as_tensor(x)).double().numpy() for x in (data.x_train, data.x_test)
            ]
        train, test = _fitted_head_losses(features, (data.y_train, data.y_test))
        members.append(train)
        others.append(test)
    return np.concatenate(members), np.concatenate(others)


def _fitted_head_losses(
    features: Sequence[np.ndarray], labels: Sequence[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """The per-record losses of the logistic-regression head fitted on a client's
    records, members and non-members together."""
    x = np.concatenate(features)
    y = np.concatenate(labels)
    head = fitted_head(x, y)
    if head is None:  # one class: any head fits it perfectly
        zeros = [np.zeros(len(f)) for f in features]
        return zeros[0], zeros[1]
    log_probability = head.predict_log_proba(x)
    losses = -log_probability[np.arange(len(y)), np.searchsorted(head.classes_, y)]
    return losses[: len(features[0])], losses[len(features[0]) :]


def fitted_head(x: np.ndarray, y: np.ndarray) -> Any:
    """The multinomial logistic-regression head (scikit-learn) fitted on a client's
    records ``(x, y)``, members and non-members together; None for one class."""
    from sklearn.linear_model import LogisticRegression

    if len(np.unique(y)) < 2:
        return None
    return LogisticRegression(max_iter=1000).fit(x, y)


def attack_success(members: np.ndarray, others: np.ndarray) -> dict[str, float]:
    """The loss-threshold attack's ROC AUC and its membership advantage
    ``max(TPR - FPR)``: a lower loss scores as a member."""
    return score_success(-members, -others)


def score_success(members: np.ndarray, others: np.ndarray) -> dict[str, float]:
    """The ROC AUC of scores whose higher values say member, and the membership
    advantage ``max(TPR - FPR)`` (scikit-learn)."""
    from sklearn.metrics import roc_auc_score, roc_curve

    truth = np.concatenate([np.ones(len(members)), np.zeros(len(others))])
    score = np.concatenate([members, others])
    fpr, tpr, _ = roc_curve(truth, score)
    return {"auc": float(roc_auc_score(truth, score)), "advantage": float(np.max(tpr - fpr))}


def update_scores(directory: Path, targets: int) -> tuple[np.ndarray, np.ndarray]:
    """Every member's and every non-member's score under the update attack (module
    docstring) on the first ``targets`` seen clients of the run in ``directory``."""
    from fedpers.config import RunConfig
    from fedpers.data.client import client_data

    config = RunConfig.from_mapping(read_config(directory))
    with np.load(directory / "final_arrays.npz") as stored:
        released = {name: stored[name] for name in stored.files}
    partitions = list(range(min(targets, config.seen_clients)))
    updates = next_updates(directory, released, partitions)
    members: list[np.ndarray] = []
    others: list[np.ndarray] = []
    for partition, update in zip(partitions, updates, strict=True):
        data = client_data(config, partition)
        model = _attacker_model(config, released, data)
        for x, y, out in (
            (data.x_train, data.y_train, members),
            (data.x_test, data.y_test, others),
        ):
            out.append(gradient_cosines(model, update, x, y))
    return np.concatenate(members), np.concatenate(others)


def next_updates(
    directory: Path, released: Mapping[str, np.ndarray], partitions: Sequence[int]
) -> list[dict[str, np.ndarray]]:
    """Each partition's update (its reply's shared arrays less ``released``) in the
    round after the run's last, made by the real ClientApp on the batched engine's grid
    from a fresh device state: what the server would receive."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

    from fedpers import protocol, records
    from fedpers.config import RunConfig
    from fedpers.simulations.batched import BatchedGrid
    from fedpers.strategies import build_strategy

    values = read_config(directory)
    config = RunConfig.from_mapping(values)
    strategy = build_strategy(config)
    train: ConfigRecord = strategy.round_config(config.num_rounds + 1, strategy.train_config())
    grid = BatchedGrid(values, config.num_clients, keep_sent=False)
    sent = ArrayRecord({name: Array(np.ascontiguousarray(v)) for name, v in released.items()})
    messages = [
        Message(
            RecordDict({protocol.ARRAYS: sent, protocol.CONFIG: train}),
            dst_node_id=grid.node_of(p),
            message_type=MessageType.TRAIN,
        )
        for p in partitions
    ]
    updates = []
    for reply in grid.send_and_receive(messages):
        if reply.has_error():
            raise RuntimeError(f"a target's update failed: {reply.error.reason}")
        returned = reply.content.array_records[protocol.ARRAYS]
        updates.append(
            {
                name: records.values(array).astype(np.float64) - released[name]
                for name, array in returned.items()
            }
        )
    return updates


def _attacker_model(config: Any, released: Mapping[str, np.ndarray], data: Any) -> Any:
    """The released model as the attacker completes it for one client: whole (FedAvg),
    or the body with the logistic-regression head fitted on the client's records."""
    import torch

    from fedpers.models import build_model, load_part_arrays

    model = build_model(config.model_name, config.num_classes, config.seed, config.input_shape)
    load_part_arrays(model, dict(released))
    model = model.double()
    if "head" in config.spec.shared:
        return model
    with torch.no_grad():
        x = torch.as_tensor(np.concatenate([data.x_train, data.x_test])).double()
        features = model.body(x).numpy()
    y = np.concatenate([data.y_train, data.y_test])
    weight = np.zeros((config.num_classes, features.shape[1]))
    bias = np.full(config.num_classes, -1e4)  # classes the client lacks: never predicted
    classes = np.unique(y)
    bias[classes] = 0.0
    head = fitted_head(features, y)
    if head is not None:
        if len(classes) == 2:  # one row: the log-odds of the second class
            weight[classes[1]], bias[classes[1]] = head.coef_[0], head.intercept_[0]
        else:
            weight[classes], bias[classes] = head.coef_, head.intercept_
    linear = torch.nn.Linear(features.shape[1], config.num_classes).double()
    with torch.no_grad():
        linear.weight.copy_(torch.as_tensor(weight))
        linear.bias.copy_(torch.as_tensor(bias))
    model.head = linear
    return model


def gradient_cosines(
    model: Any, update: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray, batch: int = 64
) -> np.ndarray:
    """For each record, the cosine between ``update`` (the shared arrays it names) and
    the record's negative gradient of the cross-entropy with respect to them, at
    ``model`` (float64)."""
    import torch
    from torch.func import functional_call, grad, vmap
    from torch.nn import functional

    names = list(update)
    params = {k: v.detach() for k, v in model.named_parameters() if k in update}
    if set(params) != set(names):
        raise ValueError(f"the update names {sorted(set(names) - set(params))}, not parameters")
    step = torch.cat([torch.as_tensor(update[k]).reshape(-1) for k in names]).double()
    fixed = {k: v.detach() for k, v in model.named_parameters() if k not in update}

    def loss(shared: dict[str, Any], xi: Any, yi: Any) -> Any:
        out = functional_call(model, {**fixed, **shared}, (xi.unsqueeze(0),))
        return functional.cross_entropy(out, yi.unsqueeze(0))

    per_record = vmap(grad(loss), in_dims=(None, 0, 0))
    scores = []
    for start in range(0, len(y), batch):
        xb = torch.as_tensor(x[start : start + batch]).double()
        yb = torch.as_tensor(y[start : start + batch]).long()
        grads = per_record(params, xb, yb)
        flat = torch.cat([grads[k].reshape(len(yb), -1) for k in names], dim=1)
        cosine = -(flat @ step) / (flat.norm(dim=1) * step.norm()).clamp_min(1e-300)
        scores.append(cosine.numpy())
    return np.concatenate(scores) if scores else np.zeros(0)


def advantage_bound(epsilon: float, delta: float) -> float:
    """The largest membership advantage a record-level ``(2 epsilon, 2 delta)``
    guarantee allows (module docstring); 1 without a guarantee."""
    if math.isinf(epsilon):
        return 1.0
    grown = math.exp(2 * epsilon)
    return min(1.0, (grown - 1 + 4 * delta) / (grown + 1))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the grid, attack every run, and write the summary; returns it."""
    parser = output_parser(__doc__.split("\n\n")[0], seeds="1", quick_seeds="1")
    add_key_flags(parser, ["num-clients", "num-rounds", "data-root"], SCRIPT)
    parser.add_argument(
        "--dataset",
        default="digits",
        choices=sorted(DATASETS),
        help="the images (default: %(default)s; fashion-mnist needs its files: "
        "apt-get install dataset-fashion-mnist, or data-root)",
    )
    parser.add_argument("--epsilons", default=EPSILONS, help="default: %(default)s")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}"
    )
    parser.add_argument(
        "--dp",
        default="central",
        choices=DP_MODES,
        help="the mechanism of the private runs (default: %(default)s; distributed runs "
        "sample a fixed-size cohort, as it needs)",
    )
    parser.add_argument(
        "--update-targets",
        type=int,
        default=UPDATE_TARGETS,
        help="clients whose next update the update attack reads (default: %(default)s)",
    )
    add_in_process_flag(parser)
    args = parser.parse_args(argv)
    if args.update_targets < 1:
        parser.error(f"--update-targets {args.update_targets}: at least 1")
    epsilons = parse_epsilons(args.epsilons)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or set(methods) - set(METHODS):
        parser.error(f"--methods: choose from {', '.join(METHODS)}")
    seeds = seeds_of(args)
    values = settings(args, {**SCRIPT, **DATASETS[args.dataset]}, QUICK)
    root = args.out.expanduser().resolve() / "runs"
    keys = [(m, e, s) for s in seeds for e in epsilons for m in methods]
    runs = [
        {**values, **mechanism(e, m, args.dp, values), "algorithm": m, "seed": s,
         "results-dir": str(root), "run-name": f"{m}-eps{e}-seed{s}"}
        for m, e, s in keys
    ]  # fmt: skip
    directories = dict(zip(keys, run_all(args, runs), strict=True))
    result = _summary(directories, methods, epsilons, seeds, values, args.update_targets)
    result["dp"] = args.dp
    out = args.out.expanduser().resolve()
    write_summary(out, result)
    table = _table(result)
    title = (
        f"Membership inference on the released model and on one update: {args.dataset}, "
        f"{values['num-clients']} clients, dp = {args.dp}"
    )
    (out / "table.md").write_text(f"# {title}\n\n{seeds_note(seeds)}\n\n{table}")
    print(f"\n{title}\n\n{table}\nresults: {out}")
    return result


def mechanism(
    epsilon: str, method: str, dp: str, values: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The run-config keys of ``method`` at ``epsilon`` under ``dp`` (``DP_MODES``) for
    the runs of ``values``: distributed DP takes the noise multiplier that central DP
    calibrates for the same sampling (its devices size their noise from it)."""
    found = private_values(epsilon, method)
    if dp != "distributed" or found["dp"] == "none":
        return found
    from fedpers import privacy
    from fedpers.config import load_run_config

    fixed = {"dp-sampling": "without-replacement"}
    central = load_run_config({**(values or {}), **found, **fixed, "algorithm": method})
    calibrated = privacy.run_mechanism(central)
    assert calibrated is not None  # a finite epsilon is a private run
    return {"dp": "distributed", **fixed, "dp-noise-multiplier": calibrated.noise_multiplier}


def _summary(
    directories: Mapping[tuple[str, str, int], Path],
    methods: Sequence[str],
    epsilons: Sequence[str],
    seeds: Sequence[int],
    values: Mapping[str, Any],
    targets: int,
) -> dict[str, Any]:
    figures: dict[str, dict[str, dict[str, list[float]]]] = {}
    for (method, epsilon, _), directory in directories.items():
        run = read_summary(directory)
        success = attack_success(*record_losses(directory))
        update = score_success(*update_scores(directory, targets))
        spent = float((run.get("privacy") or {}).get("epsilon") or math.inf)
        found = {
            "final_accuracy": run["final_accuracy"],
            "epsilon_spent": spent,
            **success,
            "update_auc": update["auc"],
            "update_advantage": update["advantage"],
        }
        cell = figures.setdefault(method, {}).setdefault(epsilon, {})
        for key, value in found.items():
            cell.setdefault(key, []).append(float(value))
    summary: dict[str, Any] = {"methods": list(methods), "epsilons": list(epsilons)}
    for key, name in (("final_accuracy", "final_accuracy"), ("auc", "attack_auc"),
                      ("advantage", "attack_advantage"), ("update_auc", "update_auc"),
                      ("update_advantage", "update_advantage")):  # fmt: skip
        summary[name] = {
            m: {e: float(np.mean(figures[m][e][key])) for e in epsilons} for m in methods
        }
        summary.setdefault("by_seed", {})[name] = {
            m: {e: figures[m][e][key] for e in epsilons} for m in methods
        }
    summary["epsilon_spent"] = {
        m: {e: _finite_or_none(max(figures[m][e]["epsilon_spent"])) for e in epsilons}
        for m in methods
    }
    delta = float(values["dp-delta"])
    summary["advantage_bound"] = {
        m: {e: advantage_bound(max(figures[m][e]["epsilon_spent"]), delta) for e in epsilons}
        for m in methods
    }
    summary.update(seeds=list(seeds), clients=values["num-clients"], rounds=values["num-rounds"])
    summary["update_targets"] = targets
    summary["settings"] = {k: v for k, v in values.items() if k not in ("results-dir", "run-name")}
    return summary


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _spread(
    summary: Mapping[str, Any], key: str, method: str, epsilon: str, form: str, scale: float = 1
) -> str:
    """The mean of ``key`` over the seeds, and its sample std where there are several."""
    mean = form.format(scale * summary[key][method][epsilon])
    values = summary.get("by_seed", {}).get(key, {}).get(method, {}).get(epsilon, [])
    if len(values) < 2:
        return mean
    return f"{mean} ± {form.format(scale * float(np.std(values, ddof=1)))}"


def _table(summary: Mapping[str, Any]) -> str:
    rows = []
    for method in summary["methods"]:
        for epsilon in summary["epsilons"]:
            rows.append(
                [
                    method,
                    "none" if epsilon == INF else epsilon,
                    _spread(summary, "final_accuracy", method, epsilon, "{:.1f}", 100),
                    _spread(summary, "attack_auc", method, epsilon, "{:.3f}"),
                    f"{summary['attack_advantage'][method][epsilon]:.3f}",
                    _spread(summary, "update_auc", method, epsilon, "{:.3f}"),
                    f"{summary['update_advantage'][method][epsilon]:.3f}",
                    f"{summary['advantage_bound'][method][epsilon]:.3f}",
                ]
            )
    header = [
        "method", "epsilon", "accuracy %", "model: AUC", "model: advantage",
        "update: AUC", "update: advantage", "DP's bound",
    ]  # fmt: skip
    return markdown_table(header, rows)


if __name__ == "__main__":
    main(sys.argv[1:])
