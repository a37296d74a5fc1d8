"""The ServerApp: read the run config once, build the strategy, run it, write results."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
from fedpers.strategies import build_strategy
from fedpers.strategies.rounds import BYTES_RECEIVED, BYTES_SENT, EVALUATE_BYTES, EvaluateFn
from flwr.app import Array, ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedpers import linear, protocol
from fedpers.checkpoint import CHECKPOINT_FILE, CheckpointError, load_checkpoint, save_checkpoint
from fedpers.config import RunConfig
from fedpers.data.synthetic import LinearTasks
from fedpers.logs import route_to_flower
from fedpers.protocol import CommunicationTest, FinalTestResult, FinetunedTest, UnseenTest
from fedpers.results import (
    RoundRecord,
    RunRecorder,
    final_mean,
    run_directory,
    write_failure,
    write_json,
)

logger = logging.getLogger(__name__)
app = ServerApp()
# A simulation: this process also holds Flower's LinkState, and every virtual node has
# registered before the ServerApp starts.
SIMULATION = "flwr.server.superlink.linkstate.in_memory_linkstate" in sys.modules
SETTLED_SECONDS = 5.0  # a simulation's node count unchanged this long is final
if SIMULATION:
    # Index the LinkState by node so the dispatcher's sweeps cost nodes + messages, not
    # nodes x messages.
    from fedpers.strategies import flower_patches

    flower_patches.install()

DISTANCE = "principal-angle-distance"
INITIAL_FILE = "initial.json"  # server metrics of the starting model (linear runs)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run one algorithm for ``num-rounds`` rounds and write its results directory."""
    serverapp_started = time.time()
    route_to_flower()
    config = RunConfig.from_mapping(context.run_config)
    run_name = (
        config.run_name or f"{config.algorithm}-{config.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    directory = run_directory(config.results_dir, run_name)
    progress = f"server.{DISTANCE}" if config.is_linear else "evaluate.accuracy"
    try:
        checkpoint_round, checkpoint_arrays = (
            load_checkpoint(directory, num_rounds=config.num_rounds) if config.resume else (0, {})
        )
    except CheckpointError as error:
        write_failure(directory, f"{type(error).__name__}: {error}")
        raise
    recorder = RunRecorder(
        directory,
        {**config.to_mapping(), "run-name": run_name, "results-dir": str(directory.parent)},
        name=run_name,
        total_rounds=config.num_rounds,
        progress_metric=progress,
        resume_after=checkpoint_round if config.resume else None,
        tensorboard=config.tensorboard,
    )
    logger.info(
        "results of this run: %s%s",
        directory,
        f" (resumed after round {checkpoint_round})" if config.resume else "",
    )
    strategy = build_strategy(config)
    strategy.run_token = recorder.token
    evaluate_fn = _distance_to_truth(config) if config.is_linear else None
    evaluate_config = strategy.evaluate_config()
    try:
        strategy.federation.connect(
            grid,
            timeout=config.node_wait_timeout,
            settled=SETTLED_SECONDS if SIMULATION else None,
        )
        partitions_known = time.time()
        if config.resume:
            initial = ArrayRecord({k: Array(v) for k, v in checkpoint_arrays.items()})
            expected = strategy.initial_arrays(grid, timeout=config.round_timeout)
            if reason := strategy.state_defect(initial, expected):
                raise CheckpointError(
                    f"{directory / CHECKPOINT_FILE} does not fit this run ({reason}); "
                    "resume it with the configuration that wrote it, or start afresh"
                )
        else:
            initial = strategy.initial_arrays(grid, timeout=config.round_timeout)
            if evaluate_fn is not None:
                write_json(directory / INITIAL_FILE, _plain_metrics(evaluate_fn(0, initial)))
        rounds_started = time.time()  # the start-up (CLI, Ray, nodes, model) is behind us
        result = strategy.start(
            grid,
            initial,
            num_rounds=config.num_rounds,
            timeout=config.round_timeout,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_fn,
            first_round=checkpoint_round + 1,
            on_round=recorder.record,
            on_checkpoint=lambda server_round, arrays: _checkpoint(directory, server_round, arrays),
        )
        final = strategy.final_test(
            grid,
            result.arrays,
            evaluate_config,
            server_round=config.num_rounds + 1,
            timeout=config.round_timeout,
        )
    except Exception as error:
        recorder.fail(f"{type(error).__name__}: {error}")
        raise
    _save_arrays(directory / "final_arrays.npz", result.arrays)
    if config.is_linear:
        distances = [r.server[DISTANCE] for r in recorder.records]
        initial_distance = json.loads((directory / INITIAL_FILE).read_text())[DISTANCE]
        below = [r.round for r in recorder.records if r.server[DISTANCE] < 1e-2]
        summary: dict[str, object] = {
            "initial_principal_angle_distance": initial_distance,
            "final_principal_angle_distance": distances[-1],
            "first_round_below_0.01": below[0] if below else None,
        }
    elif config.is_sheaf:
        summary = _sheaf_summary(config, recorder.records, final)
    else:
        before = final_mean(recorder.records, "evaluate.accuracy", config.final_rounds)
        last = _last_client_accuracy(recorder.records)
        summary = {"final_accuracy": before, "client_accuracy": last}
        if isinstance(final, FinetunedTest):
            summary = {
                "final_accuracy": final.accuracy,
                "final_accuracy_before_finetune": before,
                "client_accuracy": final.clients,
                "client_accuracy_before_finetune": last,
            }
        elif isinstance(final, UnseenTest):
            summary["unseen_accuracy"] = final.accuracy
            summary["unseen_client_accuracy"] = final.clients
        mixture = [r.train.get(protocol.LOG_LIKELIHOOD) for r in recorder.records]
        if any(v is not None for v in mixture):
            summary["train_log_likelihood"] = [v for v in mixture if v is not None]
    summary["algorithm"] = config.algorithm
    summary["startup_rejections"] = strategy.rejections.get(0, [])
    summary["rounds_started_unix"] = rounds_started
    # where the start-up went (wall clock, seconds since the epoch)
    summary["startup_unix"] = {
        "serverapp_started": serverapp_started,
        "nodes_registered": strategy.federation.registered_at,
        "partitions_known": partitions_known,
        "rounds_started": rounds_started,
    }
    summary["final_train_loss"] = final_mean(recorder.records, "train.loss", config.final_rounds)
    sent = sum(r.server.get(BYTES_SENT, 0.0) for r in recorder.records)
    received = sum(r.server.get(BYTES_RECEIVED, 0.0) for r in recorder.records)
    summary["bytes_sent"] = sent
    summary["bytes_received"] = received
    summary["megabytes_total"] = (sent + received) / 1e6  # training messages, both ways
    summary["evaluate_megabytes"] = (
        sum(r.server.get(EVALUATE_BYTES, 0.0) for r in recorder.records) / 1e6
    )
    written = recorder.finish(summary, plots=[progress])
    logger.info("summary: %s", written)


def _sheaf_summary(
    config: RunConfig, records: list[RoundRecord], final: FinalTestResult | None
) -> dict[str, object]:
    """Private accuracy (mean over agents, last rounds), communication accuracy per
    whitening, per agent and per directed edge, and bytes per round."""
    test = final if isinstance(final, CommunicationTest) else CommunicationTest()
    return {
        "private_accuracy": final_mean(records, "evaluate.accuracy", config.final_rounds),
        "communication_accuracy": dict(test.by_whitening),
        "edge_accuracy": {
            f"{mode}.{sender}->{receiver}": value
            for mode, edges in test.edges.items()
            for (sender, receiver), value in edges.items()
        },
        "agent_private_accuracy": {str(agent): v for agent, v in test.private.items()},
        "bytes_per_round": final_mean(records, "server.bytes", config.num_rounds),
        "edges": [list(e) for e in config.sheaf_graph()],
        "latent_dims": [s.latent for s in config.agent_specs()],
    }


def _last_client_accuracy(records: list[RoundRecord]) -> dict[str, float]:
    """Each client's accuracy in the last round that evaluated clients."""
    for record in reversed(records):
        if record.clients:
            return {
                p: v[protocol.ACCURACY] for p, v in record.clients.items() if protocol.ACCURACY in v
            }
    return {}


def _checkpoint(directory: Path, server_round: int, arrays: ArrayRecord) -> None:
    save_checkpoint(directory, server_round, {k: v.numpy() for k, v in arrays.items()})


def _plain_metrics(metrics: MetricRecord | None) -> dict[str, float]:
    return {} if metrics is None else {k: float(v) for k, v in metrics.items()}  # type: ignore[arg-type]


def _distance_to_truth(config: RunConfig) -> EvaluateFn:
    """Principal angle distance of the global representation to the ground truth.

    The experiment's oracle: ``B*`` is regenerated from the seed, as every client does
    to draw its samples; it plays no part in training.
    """
    truth = LinearTasks(
        config.linear_dim, config.linear_rank, config.linear_noise_std, config.seed
    ).representation

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        estimate = arrays[protocol.LINEAR_BODY].numpy().T
        return MetricRecord({DISTANCE: linear.principal_angle_distance(estimate, truth)})

    return evaluate


def _save_arrays(path: Path, arrays: ArrayRecord) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as handle:
        np.savez(handle, **{n: a.numpy() for n, a in arrays.items()})  # type: ignore[arg-type]
    tmp.replace(path)
