"""Before and around the Flower runs of a script: every run validated, the output
directory prepared, and every method run with every seed."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any, cast

from fedpers.results import ResultsExistError, holding_every_run
from fedpers.simulations.flags import parallelism, resources


def validate_runs(runs: Sequence[Mapping[str, Any]]) -> None:
    """Validate every run config, and that its data can be read, before anything
    starts (clear error, no Flower or Ray start-up)."""
    from fedpers.config import ConfigError
    from fedpers.data.sources import DatasetNotFound, check_data_source
    from fedpers.simulations.launch import resolved_config

    checked: set[tuple[str, str]] = set()
    for overrides in runs:
        try:
            config = resolved_config(overrides)
        except ConfigError as error:
            raise SystemExit(f"error: {error}") from error
        _check_directories(config.results_dir, config.run_name, config.data_root)
        if config.tensorboard:
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                raise SystemExit(
                    "error: run-config key 'tensorboard' = true needs the tensorboard "
                    "package: pip install -e '.[tensorboard]'"
                ) from None
        source = (config.dataset, config.data_root)
        if source not in checked:
            checked.add(source)
            try:
                check_data_source(*source)
            except DatasetNotFound as error:
                raise SystemExit(f"error: {error}") from error


def _check_directories(results_dir: str, run_name: str, data_root: str) -> None:
    """Refuse a results-dir (or run directory) or data-root that exists and is not a
    directory: the ServerApp, or every client (data-root also caches generated data),
    would fail to use it only after Flower and Ray started."""
    paths = [("results-dir", results_dir, Path(results_dir))]
    paths.append(("results-dir", results_dir, Path(results_dir) / run_name))
    if data_root:
        paths.append(("data-root", data_root, Path(data_root)))
    for key, value, path in paths:
        if path.exists() and not path.is_dir():
            raise SystemExit(
                f"error: run-config key '{key}' = '{value}': {path} exists and is not a "
                f"directory; choose another {key}{' (or run-name)' * (path.name == run_name)}"
                ", or move that file away"
            )


MARKER = ".fedpers-results"  # in every output directory a script made


def prepare_output(
    out: Path,
    *,
    overwrite: bool,
    resume: bool = False,
    discard_interrupted: bool = False,
    resumable: bool = True,
) -> Path:
    """Create ``out``; refuse to clobber earlier results unless ``overwrite``, and then
    delete only a directory that a fedpers script made (it holds ``MARKER``), in which
    no run is writing (no run directory's lock is held) and which holds no interrupted
    run (unless ``discard_interrupted``). With ``resume``, keep what ``out`` holds (a
    fedpers script's output directory). ``resumable=False``: a script without
    ``--resume`` (its interrupted runs are not kept from ``--overwrite``).

    Called before any run starts, so a wrong directory costs nothing.
    """
    from fedpers.simulations import interrupt

    out = out.expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {out} is a file, not a folder; choose another --out")
    if resume and overwrite:
        raise SystemExit(
            "error: --resume keeps what --out holds and --overwrite deletes it; give one"
        )
    if resume:
        if not (out / MARKER).is_file():
            raise SystemExit(
                f"error: --resume continues the runs of a fedpers script in --out, and {out} "
                f"is not such a directory (it has no {MARKER}); check --out"
            )
        return out
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            kept = resumable and any(interrupt.resumable(d) for d in out.glob("runs/*"))
            raise SystemExit(
                f"error: {out} is not empty; "
                + ("add --resume to continue its interrupted runs, " if kept else "")
                + "pass --overwrite to replace its contents or choose another --out"
            )
        if resumable and not discard_interrupted:
            interrupt.refuse_overwriting_resumable(out)
        if not (out / MARKER).is_file():
            raise SystemExit(
                f"error: --overwrite deletes only an output directory of a fedpers script, "
                f"and {out} is not one (it has no {MARKER}); remove it yourself or choose "
                "another --out"
            )
        try:
            with holding_every_run(out):  # no run starts writing there while it goes
                shutil.rmtree(out)
        except ResultsExistError as error:
            raise SystemExit(
                f"error: --overwrite would delete {out}, but {error}; wait until that run "
                "ends (or stop it), or choose another --out"
            ) from None
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER).write_text("made by a fedpers script; --overwrite may delete this folder\n")
    except OSError as error:
        raise SystemExit(
            f"error: --out {out} cannot be made or written ({error.strerror}: "
            f"{error.filename}); choose a folder you can write"
        ) from None
    return out


def run_methods(
    args: argparse.Namespace,
    values: Mapping[str, Any],
    methods: Sequence[str],
    seeds: Sequence[int],
    *,
    algorithm: Mapping[str, str] | None = None,
    shared: Mapping[str, str] | None = None,
    method_values: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[tuple[str, int], Path]:
    """Run every method with every seed (``runs/METHOD-seedK``) and return the run
    directories by (method, seed). ``algorithm`` maps a method to the algorithm it runs
    (default: itself); a method in ``shared`` takes the run of another method (FedAvg's
    numbers come from the FedAvg+FT run); ``method_values`` are a method's own settings,
    under ``values`` (what the user set wins). Validates every run, and that ``--out``
    may be written, before the SuperLink starts."""
    root = args.out.expanduser().resolve() / "runs"
    algorithm = algorithm or {}
    shared = {m: s for m, s in (shared or {}).items() if s in methods}
    keys = [(m, seed) for seed in seeds for m in methods if m not in shared]
    own = method_values or {}
    runs = [
        {
            **own.get(m, {}),
            **values,
            "algorithm": algorithm.get(m, m),
            "seed": seed,
            "results-dir": str(root),
            "run-name": f"{m}-seed{seed}",
        }
        for m, seed in keys
    ]
    directories = dict(zip(keys, run_all(args, runs), strict=True))
    for method, source in shared.items():
        for seed in seeds:
            directories[(method, seed)] = directories[(source, seed)]
    return directories


def run_all(args: argparse.Namespace, runs: Sequence[Mapping[str, Any]]) -> list[Path]:
    """Validate every run and that ``--out`` may be written, then run them all on one
    local simulation SuperLink (``--parallel`` at a time, ``--cpus-per-client`` ...);
    returns their run directories, in order."""
    from fedpers.simulations import interrupt

    resume = bool(getattr(args, "resume", False))
    runs = interrupt.with_client_state(runs, args.out)
    validate_runs(runs)
    kwargs = resources(args)
    out = prepare_output(
        args.out,
        overwrite=args.overwrite,
        resume=resume,
        discard_interrupted=bool(getattr(args, "discard_interrupted", False)),
    )
    pending, finished = interrupt.plan(runs) if resume else ([dict(r) for r in runs], [])
    if resume:
        print(
            f"--resume: {len(finished)} of {len(runs)} runs finished before, "
            f"{sum(bool(r.get('resume')) for r in pending)} go on from their last round, "
            f"{sum(not r.get('resume') for r in pending)} start",
            flush=True,
        )
    try:
        with interrupt.sigterm_interrupts():
            done = _run_pending(args, pending, kwargs)
    except BaseException as error:
        if not interrupt.is_interruption(error):
            raise
        signum = interrupt.signal_of(error)
        print(interrupt.report(out, runs, signum), flush=True)
        raise SystemExit(128 + signum) from None
    directories = iter(done)
    return [
        interrupt.directory_of(run) if index in finished else next(directories)
        for index, run in enumerate(runs)
    ]


def _run_pending(
    args: argparse.Namespace, runs: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any]
) -> list[Path]:
    from fedpers.simulations.launch import LocalSimulation

    if not runs:
        return []
    if getattr(args, "in_process", False) or batched(runs):  # every run gave a Path
        return cast(list[Path], run_in_process_pool(runs, parallelism(args), keep_going=False))
    with LocalSimulation() as simulation:
        return simulation.run_all(runs, parallel=parallelism(args), **kwargs)


def batched(runs: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the runs ask for the batched engine (``engine = "batched"``): then they
    run in this script's processes (``run_in_process_pool``), not through `flwr run`.

    Raises
    ------
    SystemExit
        If some do and others do not (a script runs all its runs on one engine).
    """
    from fedpers.config import Engine
    from fedpers.simulations.launch import resolved_config

    engines = {resolved_config(r).engine for r in runs}
    if len(engines) > 1:
        raise SystemExit("error: the runs ask for different engines; give one --engine")
    return engines == {Engine.BATCHED}


PARENT_POLL_SECONDS = 1.0


def follow_parent(parent: int) -> None:
    """A pool worker's initializer: the worker ends (exit status 1) within
    ``PARENT_POLL_SECONDS`` of the script that started it, so that a script stopped by
    SIGTERM or SIGKILL, which runs no clean-up, leaves no orphan training on."""

    # Ctrl-C reaches the whole foreground process group: the script handles it (it
    # stops the workers and records what was kept), the workers do not.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="follow-parent", daemon=True).start()


def run_in_process_pool(
    runs: Sequence[Mapping[str, Any]], parallel: int, *, keep_going: bool
) -> list[Path | None]:
    """``runs`` in process (a script's ``--in-process``), each in a fresh process of a
    pool of ``parallel``: the ServerApp on an in-process grid of the real ClientApps,
    the numbers ``flwr run`` gives to 1e-9 (``fedpers.simulations.inprocess``; the tests
    check it on each script's first run) without the SuperLink, Ray and their start-up.

    A run that did not finish (a failed run, a crashed worker) gives None where
    ``keep_going`` (said on stdout, so a table keeps the rest), else raises
    ``FlowerRunError`` and the runs not yet started are cancelled."""
    from fedpers.simulations.inprocess import run_in_process

    if not runs:
        return []
    context = multiprocessing.get_context("spawn")  # nothing of one run leaks into another
    with ProcessPoolExecutor(
        parallel,
        mp_context=context,
        max_tasks_per_child=1,
        initializer=follow_parent,
        initargs=(os.getpid(),),
    ) as pool:
        threads = max(1, (os.cpu_count() or 1) // parallel)  # the batched engine's share
        futures: list[Future[Path]] = [pool.submit(run_in_process, dict(r), threads) for r in runs]

        try:
            return _collect(pool, futures, runs, keep_going)
        except (KeyboardInterrupt, SystemExit):  # interrupted: the runs stop now, not at their end
            pool.shutdown(wait=False, cancel_futures=True)
            children = multiprocessing.active_children()
            for child in children:
                child.terminate()
            for child in children:  # gone before the script records what they left
                child.join(timeout=10)
            raise


def _collect(
    pool: ProcessPoolExecutor,
    futures: Sequence[Future[Path]],
    runs: Sequence[Mapping[str, Any]],
    keep_going: bool,
) -> list[Path | None]:
    """Each run's directory, in order (None for a run that failed, with ``keep_going``)."""
    from fedpers.simulations.launch import FlowerRunError

    done: list[Path | None] = []
    for future, overrides in zip(futures, runs, strict=True):
        try:
            done.append(future.result())
        except Exception as error:  # FlowerRunError, BrokenProcessPool, a bug in one run
            reason = str(error) if isinstance(error, FlowerRunError) else repr(error)
            if not keep_going:
                pool.shutdown(cancel_futures=True)
                raise FlowerRunError(
                    f"run '{overrides['run-name']}' did not finish: {reason}"
                ) from error
            print(f"run '{overrides['run-name']}' did not finish: {reason}", flush=True)
            done.append(None)
    return done
