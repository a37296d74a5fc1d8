"""The ServerApp: read the run config once, build the strategy, run it, write results."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import Array, ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result

from fedpers import flower_waits, publish, records, reports
from fedpers.atomic import save_npz
from fedpers.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    CheckpointError,
    CheckpointWriter,
    ResumeError,
    configuration_digest,
    load_checkpoint,
)
from fedpers.config import ConfigError, Engine, RunConfig
from fedpers.families import RunSummary
from fedpers.logs import explain_errors, route_to_flower
from fedpers.privacy import DpMode, PrivacySettings
from fedpers.protocol import FinalTestResult
from fedpers.results import (
    SUMMARY_FILE,
    ResultsExistError,
    RoundRecord,
    RunRecorder,
    RunStoppedError,
    final_mean,
    read_releases,
    read_token,
    run_directory,
    write_failure,
    write_json,
)
from fedpers.strategies import build_strategy, stopping
from fedpers.strategies.federation import PopulationError
from fedpers.strategies.resume import restore_devices
from fedpers.strategies.rounds import BYTES_RECEIVED, BYTES_SENT, EVALUATE_BYTES

if TYPE_CHECKING:
    from fedpers.strategies.base import FedpersStrategy

logger = logging.getLogger(__name__)
app = ServerApp()
# A process that has imported Flower's in-memory LinkState may hold a simulation's
# LinkState: index it by node so the dispatcher's sweeps cost nodes + messages, not
# nodes x messages. Flower 1.42's deployed flwr-serverapp imports that module too (and
# holds no LinkState: the patch is idle there), so whether a *run* is a simulation is
# decided by its grid (``simulated``), not by this.
SIMULATION = "flwr.server.superlink.linkstate.in_memory_linkstate" in sys.modules
SETTLED_SECONDS = 5.0  # a simulation's node count unchanged this long is final
if SIMULATION:
    from fedpers.strategies import flower_patches

    flower_patches.install()


def simulated(grid: Grid) -> bool:
    """Is the run on ``grid`` a simulation? Anything but Flower's deployed grid (its
    ``HttpGrid``, to a SuperLink) is: Flower's in-memory grid, whose virtual nodes all
    registered before the ServerApp started and whose messages carry their objects, and
    fedpers' in-process grid."""
    from flwr.superlink.grid.http_grid import HttpGrid

    return not isinstance(grid, HttpGrid)


# Errors whose message names what was wrong and the fix: Flower logs them as one line
# ("ServerApp stopped: ..."), not a traceback (fedpers.logs.ExplainedErrors).
EXPLAINED = (ConfigError, ResumeError, PopulationError, ResultsExistError)
INITIAL_FILE = "initial.json"  # server metrics of the starting model (server-evaluated runs)


def check_engine(config: RunConfig, grid: Grid) -> None:
    """A run that asks for the batched engine runs on it: the scripts and ``fedpers
    run`` start it (``fedpers.simulations.batched``); ``flwr run`` runs Flower's.

    Raises
    ------
    ConfigError
        Before anything is written, naming the key and the fix.
    """
    running = getattr(grid, "engine", Engine.FLOWER)
    if config.engine is Engine.BATCHED and running != Engine.BATCHED:
        raise ConfigError(
            "run-config key 'engine' = 'batched' asks for fedpers' batched engine, which "
            "the scripts and `fedpers run` start (--engine batched, or this key); "
            "`flwr run` and a deployment run Flower's engine: set engine = 'flower' there."
        )


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run one algorithm for ``num-rounds`` rounds and write its results directory.

    The run's family (``fedpers.families``) says what its progress line shows, whether
    the server evaluates the global arrays after every round, and what its summary
    holds; the keys every run has are added here."""
    started = {"serverapp_started": time.time()}
    clock = time.monotonic()  # the recorder's wall_seconds count from here, as the start-up
    route_to_flower()
    explain_errors(EXPLAINED)
    config = RunConfig.from_mapping(context.run_config)
    check_engine(config, grid)
    if simulated(grid):  # deployed, each node's state-dir is checked before round 1
        config.check_client_state()

    run_name = (
        config.run_name or f"{config.algorithm}-{config.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    directory = run_directory(config.results_dir, run_name)
    checkpoint = _checkpoint_to_resume(config, directory)
    releases = _releases_before(config, directory, checkpoint)
    recorder = RunRecorder(
        directory,
        {**config.to_mapping(), "run-name": run_name, "results-dir": str(directory.parent)},
        name=run_name,
        total_rounds=config.num_rounds,
        progress_metric=config.family.progress_metric,
        resume_after=checkpoint.round if checkpoint is not None else None,
        resume_rounds=checkpoint.rounds if checkpoint is not None else None,
        tensorboard=config.tensorboard,
        started=clock,
    )
    logger.info(
        "results of this run: %s%s",
        directory,
        f" (resumed after round {checkpoint.round})" if checkpoint is not None else "",
    )
    strategy = build_strategy(config)
    strategy.run_token = recorder.token
    if strategy.private is not None and strategy.shared:  # each release counted on disk first
        strategy.private.releases = releases
        strategy.private.on_release = recorder.count_release
    # Deployed, the SuperLink stores a device's reply before its objects, and Flower's
    # grid retried a missing object after 1 s, doubling to 10 s (fedpers.flower_waits).
    waits = contextlib.nullcontext() if simulated(grid) else flower_waits.object_backoff()
    # `flwr stop` (or a signal to this process) ends the run through Flower's exit
    # handlers: the run records it, and writes nothing after (strategies/stopping.py).
    hint = stopping.resume_hint(config, run_name, simulated=simulated(grid))
    try:
        with stopping.on_flower_exit(stopping.stop_handler(recorder, hint)):
            with waits:
                result, final = _run(grid, config, strategy, recorder, checkpoint, started)
            if recorder.stopped:
                return
            written = _write_results(config, strategy, recorder, result, final, started)
    except RunStoppedError:
        return
    except Exception as error:
        recorder.fail(f"{type(error).__name__}: {error}")  # no-op after finish's own
        raise
    logger.info("summary: %s", _loggable(written, directory))


def _write_results(
    config: RunConfig,
    strategy: FedpersStrategy,
    recorder: RunRecorder,
    result: Result,
    final: FinalTestResult | None,
    started: dict[str, float],
) -> dict[str, Any]:
    """A finished run's final arrays and summary, and with ``publish-dir`` the set that
    may be published apart from them (``fedpers.publish``): the summary as written."""
    arrays = {name: array.numpy() for name, array in result.arrays.items()}
    save_npz(recorder.directory / "final_arrays.npz", arrays)
    summary = _summary(config, strategy, recorder, final, started)
    written = recorder.finish(
        summary, plots=[config.family.progress_metric], plot=reports.plot_rounds
    )
    if config.publish_dir:  # what may be shared, apart from the operator's files
        target = Path(config.publish_dir) / recorder.name
        publish.write_published(target, recorder.records, written, arrays)
    return written


def _loggable(summary: dict[str, Any], directory: Path, most: int = 20) -> dict[str, Any]:
    """``summary`` for the log: a mapping of more than ``most`` entries (a per-client
    figure of 10,000 clients is a line of 150 kB) is named by its size and the file that
    holds it."""
    return {
        key: (
            f"<{len(value)} entries: {directory / SUMMARY_FILE}>"
            if isinstance(value, dict) and len(value) > most
            else value
        )
        for key, value in summary.items()
    }


def _checkpoint_to_resume(config: RunConfig, directory: Path) -> Checkpoint | None:
    """The checkpoint a resumed run continues from (None for a fresh run): the run's own
    (its token, ``run.json``), of this configuration; any other fails the run before
    anything starts (``fedpers.checkpoint``)."""
    if not config.resume:
        return None
    try:
        return load_checkpoint(
            directory,
            num_rounds=config.num_rounds,
            token=read_token(directory),
            configuration=configuration_digest(config.to_mapping()),
        )
    except ResumeError as error:
        write_failure(directory, f"{type(error).__name__}: {error}")
        raise


def _releases_before(config: RunConfig, directory: Path, checkpoint: Checkpoint | None) -> int:
    """The noised models a resumed private run released before (``releases.json``: at
    least its checkpoint's rounds); 0 for a fresh or non-private run. A count that is
    missing or damaged fails the run before anything starts."""
    private = config.group(PrivacySettings).dp is not DpMode.NONE and bool(config.spec.shared)
    if checkpoint is None or not private:
        return 0
    try:
        return read_releases(directory, checkpoint.round)
    except ResumeError as error:
        write_failure(directory, f"{type(error).__name__}: {error}")
        raise


def _run(
    grid: Grid,
    config: RunConfig,
    strategy: FedpersStrategy,
    recorder: RunRecorder,
    checkpoint: Checkpoint | None,
    started: dict[str, float],
) -> tuple[Result, FinalTestResult | None]:
    """Connect to the nodes, find the initial arrays (or check the checkpoint's and the
    nodes' state), run the rounds and the final test; ``started`` gets the start-up's
    timestamps."""
    directory = recorder.directory
    family = config.family
    evaluate_fn = family.evaluate_fn(config) if family.evaluate_fn is not None else None
    evaluate_config = strategy.evaluate_config()
    _connect(grid, config, strategy, recorder)
    started["partitions_known"] = time.time()
    initial = _starting_arrays(grid, config, strategy, recorder, checkpoint, evaluate_fn)
    checkpoints = CheckpointWriter(
        directory,
        recorder.token,
        configuration_digest(config.to_mapping()),
        dict(checkpoint.trained) if checkpoint is not None else {},
    )

    def on_round(record: RoundRecord) -> None:
        recorder.record(record)
        if recorder.stopped:  # by Flower, in another thread: no further round
            raise RunStoppedError(f"{directory}: stopped during round {record.round}")
        checkpoints.trained_in(record.round, record.trained)

    def on_checkpoint(server_round: int, arrays: ArrayRecord) -> None:
        with recorder.writing() as running:  # a stopped run's checkpoint stays as it was
            if running:
                arrays_now = {k: v.numpy() for k, v in arrays.items()}
                checkpoints.save(
                    server_round, arrays_now, recorder.rounds_digest(), strategy.server_state()
                )

    started["rounds_started"] = time.time()  # the start-up (CLI, Ray, nodes, model) is behind us
    recorder.startup(_first_round_line(checkpoint))
    result = strategy.start(
        grid,
        initial,
        num_rounds=config.num_rounds,
        timeout=config.round_timeout,
        evaluate_config=evaluate_config,
        evaluate_fn=evaluate_fn,
        first_round=checkpoint.round + 1 if checkpoint is not None else 1,
        on_round=on_round,
        on_checkpoint=on_checkpoint,
    )
    final = strategy.final_test(
        grid,
        result.arrays,
        evaluate_config,
        server_round=config.num_rounds + 1,
        timeout=config.round_timeout,
    )
    return result, final


def _starting_arrays(
    grid: Grid,
    config: RunConfig,
    strategy: FedpersStrategy,
    recorder: RunRecorder,
    checkpoint: Checkpoint | None,
    evaluate_fn: Any,
) -> ArrayRecord:
    """The global arrays round 1 (or the round after the checkpoint) starts from: the
    checkpoint's, once they fit and the nodes restored their state; else the initial
    model, whose server metrics go to ``initial.json``."""
    directory = recorder.directory
    if checkpoint is not None:
        where = directory / CHECKPOINT_FILE
        initial = _resumed_start(grid, config, strategy, checkpoint, where)
        strategy.resume_after(recorder.records)
        strategy.restore_server_state(checkpoint.server, checkpoint.arrays, where)
        return initial
    initial = strategy.initial_arrays(grid, timeout=config.startup_timeout)
    if evaluate_fn is not None:
        write_json(directory / INITIAL_FILE, _plain_metrics(evaluate_fn(0, initial)))
    return initial


def _first_round_line(checkpoint: Checkpoint | None) -> str:
    """The start-up's last line: where the rounds start."""
    if checkpoint is None:
        return "initial model ready; round 1 starts"
    return (
        f"checkpoint of round {checkpoint.round} and the nodes' state restored; "
        f"round {checkpoint.round + 1} starts"
    )


def _connect(
    grid: Grid, config: RunConfig, strategy: FedpersStrategy, recorder: RunRecorder
) -> None:
    """Wait for the run's nodes and learn their partitions, saying so."""
    recorder.startup(f"waiting for {config.num_clients} nodes and their partitions")
    strategy.federation.connect(
        grid,
        timeout=config.node_wait_timeout,
        settled=SETTLED_SECONDS if simulated(grid) else None,
    )
    recorder.startup("nodes registered, partitions known; choosing the initial model")


def _resumed_start(
    grid: Grid, config: RunConfig, strategy: FedpersStrategy, checkpoint: Checkpoint, where: Path
) -> ArrayRecord:
    """The checkpoint's arrays, once they fit the model and every node that keeps state
    restored the state the checkpoint saw (``strategies.resume``); else an error."""
    initial = ArrayRecord({k: Array(v) for k, v in checkpoint.arrays.items()})
    expected = strategy.initial_arrays(grid, timeout=config.startup_timeout)
    if reason := strategy.state_defect(initial, expected):
        raise CheckpointError(
            f"{where} does not fit this run ({reason}); "
            "resume it with the configuration that wrote it, or start afresh"
        )
    if config.spec.keeps_state:
        restore_devices(strategy, grid, checkpoint, where=where, timeout=config.startup_timeout)
    return initial


def _summary(
    config: RunConfig,
    strategy: FedpersStrategy,
    recorder: RunRecorder,
    final: FinalTestResult | None,
    started: dict[str, float],
) -> dict[str, object]:
    """The family's summary, then what every run reports: start-up, loss, bytes, and
    the privacy guarantee of a private run."""
    initial_file = recorder.directory / INITIAL_FILE
    summary = config.family.summary(
        RunSummary(
            run=config,
            records=recorder.records,
            final=final,
            initial=json.loads(initial_file.read_text()) if initial_file.is_file() else {},
        )
    )
    summary["algorithm"] = config.algorithm
    summary["startup_rejections"] = list(strategy.startup_rejections)
    summary["rounds_started_unix"] = started["rounds_started"]
    # the ServerApp's start-up (nodes, their data, the initial model) apart from the rounds
    summary["startup_seconds"] = started["rounds_started"] - started["serverapp_started"]
    # where the start-up went (wall clock, seconds since the epoch)
    summary["startup_unix"] = {
        "serverapp_started": started["serverapp_started"],
        "nodes_registered": strategy.federation.registered_at,
        "partitions_known": started["partitions_known"],
        "rounds_started": started["rounds_started"],
    }
    records_ = recorder.records
    summary["final_train_loss"] = final_mean(records_, "train.loss", config.final_rounds)
    sent = sum(r.server.get(BYTES_SENT, 0.0) for r in records_)
    received = sum(r.server.get(BYTES_RECEIVED, 0.0) for r in records_)
    summary["bytes_sent"] = sent
    summary["bytes_received"] = received
    summary["megabytes_total"] = (sent + received) / 1e6  # training messages, both ways
    summary["evaluate_megabytes"] = sum(r.server.get(EVALUATE_BYTES, 0.0) for r in records_) / 1e6
    private = strategy.private
    if private is not None:  # client-level DP: the guarantee, recomputable elsewhere
        guarantee = private.mechanism.record(private.releases)
        if private.audit is not None:  # the canaries' lower bound, beside the accountant's
            guarantee["audit"] = private.audit.result(private.mechanism.delta)
        summary["privacy"] = guarantee
    return summary


def _plain_metrics(metrics: MetricRecord | None) -> dict[str, float]:
    return {} if metrics is None else records.numbers(metrics)
