"""How far and how cheaply FedRep simulations scale, on Flower's engine and the batched one.

    python -m simulations.scale --out DIR [--quick] [--sizes 100,1000,5000,10000]
        [--batched-sizes 100,1000,10000,100000] [--engines flower,batched] [--main-job]

FedRep with the small MNIST-1D MLP (40-128-64 | 64-10); every client generates its own
100 training samples of 2 classes from its own seed (``partitioner = "generated"``), so
no process builds anyone else's data. 10% of the clients train per round, evaluation
only after the last round. Flower's engine (``engine = "flower"``, through a real `flwr
run`) runs 1 CPU per client (2 Ray actors on 2 cores); the batched engine (``engine =
"batched"``, ``fedpers.simulations.batched``) runs the same ServerApp in one process
with every round's clients as cohorts, on every core.

For each engine and size it measures:
- ``round_seconds``: the median wall time of the training exchanges of the steady
  rounds (all but the first and the last);
- ``plain_loop_seconds``: the same local training (same sampled clients, same data,
  model, epochs and averaging) in one process without Flower, one client after another
  on one thread, the bare computation as a client runs it (the median of the steady
  rounds; one round beyond 10,000 clients);
- ``ratio``: the two divided;
- ``startup_seconds``: from launching the run to the start of round 1 (Flower: CLI, run
  start, Ray, node registration, the initial model; batched: imports, the nodes, the
  partition query, the initial model), and, for Flower, split into its parts:
  ``startup_to_serverapp_seconds`` (CLI and run start), ``startup_nodes_seconds`` (the
  ServerApp waiting for the simulated nodes), ``startup_partition_query_seconds``
  (asking every node which partition it holds: Flower gives simulated nodes random
  ids; its dispatcher costs nodes x messages, see ``simulations.linkstate_cost``) and
  ``startup_initial_model_seconds`` (the vote on the first model);
- ``peak_rss_mb`` and ``peak_pss_mb``: the peak memory of the whole process tree
  (SuperLink, SuperExec, simulation, Ray and its workers; or the batched run's
  process), summed over processes, sampled every 0.5 s (RSS counts shared libraries
  once per process, PSS shares them), and ``simulation_process_rss_mb``, the peak of
  the ``flwr-simulation`` process alone (Flower);
- ``round_gflop`` and ``machine_share``: the arithmetic of a round's local training
  (the matrix products of the forward and backward passes) and the share of this
  machine's measured rate (a float32 matrix product on every core,
  ``machine.matmul_gflops``) that a round's wall time reaches: how far from the
  limit each engine runs;
- ``memory_per_client_kb`` (Flower, with two sizes or more): the slope of the
  simulation process's peak RSS between the smallest and the largest size, what one
  more virtual client holds; ``tree_memory_per_client_kb`` the same for the whole tree.

``--main-job`` also times the main job (``make run``: FedRep and FedAvg, 100 clients,
10 a round, 100 rounds, ``simulations.fedrep_images``) on each engine, as one wall time.

Writes DIR/summary.json: ``clients.<N>`` (Flower's engine, as before), and
``engines.<engine>.clients.<N>`` with the same keys for each engine, and
``engines.<engine>.main_job_seconds``; ``machine``; and DIR/table.md.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedpers import protocol
from fedpers.aggregation import weighted_mean
from fedpers.config import RunConfig
from fedpers.data.client import client_data
from fedpers.models import build_model, load_part_arrays, part_arrays
from fedpers.reports import read_rounds, read_summary
from fedpers.seeding import int_seed
from fedpers.simulations.flags import output_parser
from fedpers.simulations.inprocess import run_in_process
from fedpers.simulations.launch import (
    LocalSimulation,
    descendants,
    processes_with_home,
    resolved_config,
)
from fedpers.simulations.runs import prepare_output, validate_runs
from fedpers.simulations.tables import markdown_table, write_summary
from fedpers.strategies.base import FedpersStrategy
from fedpers.training import SGDSettings
from fedpers.training import train_model as train

SIZES = (100, 1000, 5000, 10000)
BATCHED_SIZES = (100, 1000, 10000, 100000)
ENGINES = ("flower", "batched")


def settings(clients: int, rounds: int) -> dict[str, Any]:
    """The run configuration of one size."""
    return {
        "algorithm": "fedrep",
        "dataset": "mnist1d",
        "partitioner": "generated",
        "samples-per-client": 100,
        "classes-per-client": 2,
        "num-clients": clients,
        "fraction-train": 0.1,
        "num-rounds": rounds,
        "evaluate-every": 0,
        "head-epochs": 5,
        "epochs": 1,
        "node-wait-timeout": 600.0,
        "round-timeout": 900.0,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure every size on every engine; returns the summary."""
    args = _parser().parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"error: --engines {','.join(unknown)}: choose from {','.join(ENGINES)}")
    sizes = {
        "flower": [int(n) for n in args.sizes.split(",") if n.strip()],
        "batched": [int(n) for n in args.batched_sizes.split(",") if n.strip()],
    }
    if args.quick:
        sizes, args.rounds = {"flower": [200], "batched": [200]}, 4
    runs = {
        (engine, n): {
            **settings(n, args.rounds),
            "engine": engine,
            **({"engine-workers": args.engine_workers} if engine == "batched" else {}),
            **({"device": args.device} if args.device else {}),
            "results-dir": str(args.out.expanduser().resolve() / "runs"),
            "run-name": f"{engine}-clients-{n}",
        }
        for engine in engines
        for n in sizes[engine]
    }
    validate_runs(list(runs.values()))
    out = prepare_output(args.out, overwrite=args.overwrite, resumable=False)
    machine = {"matmul_gflops": matmul_gflops(), "cores": os.cpu_count() or 1}
    result: dict[str, Any] = {"engines": {}, "rounds": args.rounds, "quick": args.quick}
    plain: dict[int, float] = {}
    for (engine, n), overrides in runs.items():
        measured = _measure(overrides) if engine == "flower" else _measure_batched(overrides)
        config = resolved_config(overrides)
        if n not in plain:
            # one steady round beyond 10,000 clients (10,000 clients one at a time: minutes)
            steady = _steady_rounds(args.rounds)
            plain[n] = plain_loop_seconds(config, steady if n <= 10_000 else steady[:1])
        _add_limits(measured, config, plain[n], machine["matmul_gflops"])
        clients = result["engines"].setdefault(engine, {}).setdefault("clients", {})
        clients[str(n)] = measured
        print(f"{engine}, {n} clients: {measured}", flush=True)
    if args.main_job:
        for engine in engines:
            seconds = main_job_seconds(engine, out)
            result["engines"].setdefault(engine, {})["main_job_seconds"] = seconds
            print(f"{engine}: the main job took {seconds:.1f} s", flush=True)
    flower = result["engines"].get("flower", {}).get("clients", {})
    result["clients"] = flower  # where earlier summaries kept Flower's figures
    result.update(_memory_slopes(flower))
    result["machine"] = machine
    write_summary(out, result)
    table = _tables(result)
    (out / "table.md").write_text(
        f"# FedRep at scale (MNIST-1D, {machine['cores']} cores)\n\n{table}"
    )
    print(f"\n{table}\nresults: {out}")
    return result


def _parser() -> Any:
    parser = output_parser(__doc__.split("\n\n")[0], resume=False)
    parser.add_argument(
        "--sizes", default=",".join(str(s) for s in SIZES), help="clients, Flower's engine"
    )
    parser.add_argument(
        "--batched-sizes",
        default=",".join(str(s) for s in BATCHED_SIZES),
        help="clients, the batched engine",
    )
    parser.add_argument("--engines", default=",".join(ENGINES), help="flower, batched or both")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--engine-workers",
        type=int,
        default=os.cpu_count() or 1,
        help="the batched engine's Ray actors (run-config key engine-workers; 0: in the "
        "run's process; default: one per core)",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default=None,
        help="run-config key device of every run (default: the key's own, auto); on a "
        "GPU machine: --engines batched --engine-workers 1 --device cuda (a Ray shard "
        "gets a GPU only where there is one per worker)",
    )
    parser.add_argument(
        "--main-job", action="store_true", help="also time `make run` on each engine"
    )
    return parser


def _steady_rounds(rounds: int) -> list[int]:
    return list(range(2, rounds)) or [rounds]


def _memory_slopes(measured: dict[str, dict[str, float]]) -> dict[str, float]:
    """What one more virtual client costs on Flower's engine: the slope of the
    simulation process's peak RSS (it holds every node's context and messages) and of
    the whole tree's, between the smallest and the largest size measured."""
    if len(measured) < 2:
        return {}
    sizes = sorted(int(n) for n in measured)
    small, large = measured[str(sizes[0])], measured[str(sizes[-1])]
    span = sizes[-1] - sizes[0]
    return {
        name: (large[key] - small[key]) * 1024 / span
        for key, name in (
            ("simulation_process_rss_mb", "memory_per_client_kb"),
            ("peak_rss_mb", "tree_memory_per_client_kb"),
        )
    }


def _measure(overrides: dict[str, Any]) -> dict[str, float]:
    """One size through a real `flwr run`: the figures of the module docstring."""
    n = int(overrides["num-clients"])
    with LocalSimulation() as simulation:
        memory = MemoryWatch(lambda: flower_tree(simulation))
        launched = time.time()
        directory = simulation.run(overrides)
        memory.stop()
    summary = read_summary(directory)
    startup = summary["startup_unix"]
    return {
        "round_seconds": _steady_seconds(directory),
        "startup_seconds": summary["rounds_started_unix"] - launched,
        # the start-up, split: CLI + run start to the ServerApp; the ServerApp
        # waiting for the simulated nodes to register; asking every node for its
        # partition (query.info); the initial model (query.initial, Ray actors start)
        "startup_to_serverapp_seconds": startup["serverapp_started"] - launched,
        "startup_nodes_seconds": startup["nodes_registered"] - startup["serverapp_started"],
        "startup_partition_query_seconds": (
            startup["partitions_known"] - startup["nodes_registered"]
        ),
        "startup_initial_model_seconds": (startup["rounds_started"] - startup["partitions_known"]),
        "peak_rss_mb": memory.peak_rss / 2**20,
        "peak_pss_mb": memory.peak_pss / 2**20,
        "simulation_process_rss_mb": memory.peak_simulation_rss / 2**20,
        "clients_per_round": max(1, round(0.1 * n)),
    }


def _measure_batched(overrides: dict[str, Any]) -> dict[str, float]:
    """One size on the batched engine, in a fresh process (its imports counted in the
    start-up, its memory alone): the figures of the module docstring."""
    n = int(overrides["num-clients"])
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=run_in_process, args=(dict(overrides),))
    launched = time.time()
    process.start()
    memory = MemoryWatch(lambda: {process.pid, *descendants(process.pid)} if process.pid else set())
    process.join()
    memory.stop()
    if process.exitcode != 0:
        raise RuntimeError(f"the batched run of {n} clients ended with status {process.exitcode}")
    directory = resolved_config(overrides).results_dir
    run = Path(directory) / str(overrides["run-name"])
    summary = read_summary(run)
    startup = summary["startup_unix"]
    return {
        "round_seconds": _steady_seconds(run),
        "startup_seconds": summary["rounds_started_unix"] - launched,
        "startup_to_serverapp_seconds": startup["serverapp_started"] - launched,
        "startup_partition_query_seconds": (
            startup["partitions_known"] - startup["nodes_registered"]
        ),
        "startup_initial_model_seconds": (startup["rounds_started"] - startup["partitions_known"]),
        "peak_rss_mb": memory.peak_rss / 2**20,
        "peak_pss_mb": memory.peak_pss / 2**20,
        "clients_per_round": max(1, round(0.1 * n)),
    }


def _steady_seconds(directory: Path) -> float:
    """The median wall time of the training exchanges of the steady rounds."""
    rounds = read_rounds(directory)
    steady = [r.train_seconds for r in rounds[1:-1]] or [rounds[-1].train_seconds]
    return statistics.median(steady)


def _add_limits(measured: dict[str, float], config: RunConfig, plain: float, gflops: float) -> None:
    """The plain loop's seconds, the ratio to it, a round's arithmetic and the share of
    the machine's rate a round reaches (in place)."""
    work = round_gflop(config)
    measured["plain_loop_seconds"] = plain
    measured["ratio"] = measured["round_seconds"] / plain
    measured["round_gflop"] = work
    measured["machine_share"] = work / measured["round_seconds"] / gflops


def matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    """This machine's float32 matrix-product rate on every core (GFLOP/s, the best of
    ``repeats``): the ceiling of the arithmetic a round can reach."""
    torch.set_num_threads(os.cpu_count() or 1)
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


def round_gflop(config: RunConfig) -> float:
    """The matrix products of a round's local training (GFLOP): every trained client's
    forward passes through the whole model, and the backward passes of the phase's
    trained layers (their weights' gradients, and their inputs' below the top one), per
    sample and epoch. Biases, activations and the optimizer are left out (a few %)."""
    model = build_model(config.model_name, config.num_classes, 0, config.input_shape)
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    forward = {name: 2 * m.in_features * m.out_features for name, m in layers}
    total = 0.0
    for parts, epochs in (
        ((protocol.HEAD,), config.head_epochs),
        ((protocol.BODY,), config.epochs),
    ):
        trained = [name for name, _ in layers if name.split(".", 1)[0] in parts]
        first = next(i for i, (name, _) in enumerate(layers) if name in trained)
        backward = sum(forward[name] for name in trained)  # the weights' gradients
        backward += sum(forward[name] for name, _ in layers[first + 1 :])  # the inputs'
        total += epochs * (sum(forward.values()) + backward)
    samples = int(config.samples_per_client) * config.clients_per_round
    return total * samples / 1e9


def main_job_seconds(engine: str, out: Path) -> float:
    """The wall time of the main job (``make run``: ``simulations.fedrep_images
    --methods fedrep,fedavg``) on ``engine``."""
    command = [
        sys.executable, "-m", "fedpers.simulations.fedrep_images", "--methods", "fedrep,fedavg",
        "--out", str(out / f"main-job-{engine}"), "--overwrite", "--engine", engine,
    ]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def _tables(result: dict[str, Any]) -> str:
    """One table per engine, and the main job's times."""
    blocks = []
    for engine, figures in result["engines"].items():
        rows = figures.get("clients", {})
        if rows:
            blocks.append(f"## {engine}\n\n{_table(rows, flower=engine == 'flower')}")
    jobs = {
        e: f["main_job_seconds"] for e, f in result["engines"].items() if "main_job_seconds" in f
    }
    if jobs:
        blocks.append(
            "## the main job (make run)\n\n"
            + "\n".join(f"- {e}: {s:.1f} s" for e, s in jobs.items())
        )
    for name in ("memory_per_client_kb", "tree_memory_per_client_kb"):
        if name in result:
            blocks.append(f"{name.replace('_', ' ')}: {result[name]:.1f}")
    return "\n\n".join(blocks) + "\n"


def _table(measured: dict[str, dict[str, float]], *, flower: bool) -> str:
    parts = (["startup_to_serverapp_seconds", "startup_nodes_seconds"] if flower else []) + [
        "startup_partition_query_seconds",
        "startup_initial_model_seconds",
    ]
    return markdown_table(
        [
            "clients",
            "trained/round",
            "round (s)",
            "plain loop (s)",
            "ratio",
            "start-up (s)",
            ("to ServerApp / nodes / query / model (s)" if flower else "query / model (s)"),
            "peak RSS (MB)",
            "round GFLOP",
            "machine share",
        ],
        [
            (
                n,
                m["clients_per_round"],
                m["round_seconds"],
                m["plain_loop_seconds"],
                m["ratio"],
                m["startup_seconds"],
                " / ".join(f"{m[k]:.1f}" for k in parts),
                m["peak_rss_mb"],
                m["round_gflop"],
                m["machine_share"],
            )
            for n, m in measured.items()
        ],
    )


def plain_loop_seconds(config: RunConfig, rounds: list[int]) -> float:
    """Median seconds of the same rounds' local training, one process, no Flower.

    The same clients (the strategy's seeded sample), data (generated by each client,
    cached in this process as in an actor), model, head and body epochs, and the same
    weighted average of the bodies. Heads persist per client as in ``context.state``.
    """
    torch.set_num_threads(config.client_threads)
    model = build_model(
        config.model_name, config.num_classes, int_seed(config.seed, "model"), config.input_shape
    )
    initial_heads = part_arrays(model, ("head",))
    body = part_arrays(model, ("body",))
    heads: dict[int, dict[str, np.ndarray]] = {}
    sampler = FedpersStrategy(config)
    settings = SGDSettings(config.lr, config.momentum, config.weight_decay, config.batch_size)
    # Warm up as a long-lived actor is: imports, the generator's scale, torch's first step.
    warm = client_data(config, 0)
    train(
        build_model(config.model_name, config.num_classes, 0, config.input_shape),
        torch.from_numpy(warm.x_train),
        torch.from_numpy(warm.y_train),
        parts=("body", "head"),
        epochs=1,
        settings=settings,
        generator=torch.Generator().manual_seed(0),
    )
    seconds = []
    for server_round in rounds:
        started = time.perf_counter()
        bodies, weights = [], []
        for partition in sampler.sample(server_round):
            data = client_data(config, partition)
            load_part_arrays(model, body)
            load_part_arrays(model, heads.get(partition, initial_heads))
            x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
            generator = torch.Generator().manual_seed(
                int_seed(config.seed, "train", partition, server_round)
            )
            for parts, epochs in ((("head",), config.head_epochs), (("body",), config.epochs)):
                train(
                    model, x, y, parts=parts, epochs=epochs, settings=settings, generator=generator
                )
            heads[partition] = part_arrays(model, ("head",))
            bodies.append(part_arrays(model, ("body",)))
            weights.append(float(len(y)))
        body = weighted_mean(bodies, weights)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def flower_tree(simulation: LocalSimulation) -> set[int]:
    """The processes of a local simulation: its SuperLink and SuperExec (by their Flower
    home), its `flwr run` and what that started."""
    pids = set(processes_with_home(simulation.home))
    if simulation.process is not None:
        pids |= {simulation.process.pid, *descendants(simulation.process.pid)}
    return pids


class MemoryWatch:
    """Samples the summed RSS and PSS of a set of processes every 0.5 s (``tree``: the
    pids to sum; ``flower``: also the ``flwr-simulation`` process's own peak)."""

    def __init__(self, tree: Callable[[], set[int]]) -> None:
        self.tree = tree
        self.peak_rss = 0.0
        self.peak_pss = 0.0
        self.peak_simulation_rss = 0.0  # the flwr-simulation process alone
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            rss = pss = 0.0
            for pid in self.tree():
                try:
                    rollup = (Path("/proc") / str(pid) / "smaps_rollup").read_text().splitlines()
                    command = (Path("/proc") / str(pid) / "cmdline").read_bytes()
                except OSError:
                    continue
                for line in rollup:
                    if line.startswith("Rss:"):
                        rss += float(line.split()[1]) * 1024
                        if b"flwr-simulation" in command:
                            own = float(line.split()[1]) * 1024
                            self.peak_simulation_rss = max(self.peak_simulation_rss, own)
                    elif line.startswith("Pss:"):
                        pss += float(line.split()[1]) * 1024
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join(timeout=5)


if __name__ == "__main__":
    main(sys.argv[1:])
