"""How far and how cheaply FedRep simulations scale: 100 to 10,000 virtual clients.

    python -m simulations.scale --out DIR [--quick] [--sizes 100,1000,5000,10000]

FedRep with the small MNIST-1D MLP (40-128-64 | 64-10); every client generates its own
100 training samples of 2 classes from its own seed (``partitioner = "generated"``), so
no process builds anyone else's data. 10% of the clients train per round, 1 CPU per
client (2 Ray actors on 2 cores), evaluation only after the last round.

For each size it measures, through a real `flwr run`:
- ``round_seconds``: the median wall time of the training exchanges of the steady
  rounds (all but the first and the last);
- ``plain_loop_seconds``: the same local training (same sampled clients, same data,
  model, epochs and averaging) in one process without Flower, the bare computation;
- ``ratio``: the two divided;
- ``startup_seconds``: from launching `flwr run` to the start of round 1 (CLI, run
  start, Ray, node registration, the initial model), and split into its parts:
  ``startup_to_serverapp_seconds`` (CLI and run start), ``startup_nodes_seconds`` (the
  ServerApp waiting for the simulated nodes), ``startup_partition_query_seconds``
  (asking every node which partition it holds: Flower gives simulated nodes random
  ids; its dispatcher costs nodes x messages, see ``simulations.linkstate_cost``) and
  ``startup_initial_model_seconds`` (the first model, built on partition 0's node);
- ``peak_rss_mb`` and ``peak_pss_mb``: the peak memory of the whole process tree
  (SuperLink, SuperExec, simulation, Ray and its workers), summed over processes,
  sampled every 0.5 s (RSS counts shared libraries once per process, PSS shares them),
  and ``simulation_process_rss_mb``, the peak of the ``flwr-simulation`` process alone
  (the ServerApp, the LinkState, every virtual node's context);
- ``memory_per_client_kb`` (with two sizes or more): the slope of that process's peak
  RSS between the smallest and the largest size, what one more virtual client holds;
  ``tree_memory_per_client_kb`` the same for the whole tree.

Writes DIR/summary.json ``{"clients": {N: {...}}}`` and DIR/table.md.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedpers.aggregation import weighted_mean
from fedpers.config import RunConfig
from fedpers.data.client import client_data
from fedpers.models import build_model, load_part_arrays, part_arrays
from fedpers.reports import read_rounds, read_summary
from fedpers.seeding import int_seed
from fedpers.simulations.flags import output_parser
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
    """Measure every size; returns the summary."""
    parser = output_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.quick:
        sizes, args.rounds = [200], 4
    out_dir = args.out.expanduser().resolve()
    runs = [
        {
            **settings(n, args.rounds),
            "results-dir": str(out_dir / "runs"),
            "run-name": f"clients-{n}",
        }
        for n in sizes
    ]
    validate_runs(runs)
    out = prepare_output(args.out, overwrite=args.overwrite)
    measured: dict[str, dict[str, float]] = {}
    for overrides in runs:
        n = int(overrides["num-clients"])
        measured[str(n)] = _measure(overrides)
        print(f"{n} clients: {measured[str(n)]}", flush=True)
    result: dict[str, Any] = {"clients": measured, "rounds": args.rounds, "quick": args.quick}
    if len(measured) > 1:
        # What one more virtual client costs: the slope of the simulation process's peak
        # RSS (it holds every node's context and messages) and of the whole tree's,
        # between the smallest and the largest size measured.
        small, large = measured[str(min(sizes))], measured[str(max(sizes))]
        span = max(sizes) - min(sizes)
        for key, name in (
            ("simulation_process_rss_mb", "memory_per_client_kb"),
            ("peak_rss_mb", "tree_memory_per_client_kb"),
        ):
            result[name] = (large[key] - small[key]) * 1024 / span
    write_summary(out, result)
    table = _table(measured)
    per_client = "".join(
        f"\n{name.replace('_', ' ')}: {result[name]:.1f}\n"
        for name in ("memory_per_client_kb", "tree_memory_per_client_kb")
        if name in result
    )
    (out / "table.md").write_text(f"# FedRep at scale (MNIST-1D, 2 cores)\n\n{table}{per_client}")
    print(f"\n{table}{per_client}\nresults: {out}")
    return result


def _measure(overrides: dict[str, Any]) -> dict[str, float]:
    """One size through a real `flwr run`: the figures of the module docstring."""
    n = int(overrides["num-clients"])
    with LocalSimulation() as simulation:
        memory = MemoryWatch(simulation)
        launched = time.time()
        directory = simulation.run(overrides)
        memory.stop()
    rounds = read_rounds(directory)
    steady = [r.train_seconds for r in rounds[1:-1]] or [rounds[-1].train_seconds]
    config = resolved_config(overrides)
    plain = plain_loop_seconds(config, [r.round for r in rounds[1:-1]] or [rounds[-1].round])
    round_seconds = statistics.median(steady)
    summary = read_summary(directory)
    startup = summary["startup_unix"]
    return {
        "round_seconds": round_seconds,
        "plain_loop_seconds": plain,
        "ratio": round_seconds / plain,
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


def _table(measured: dict[str, dict[str, float]]) -> str:
    return markdown_table(
        [
            "clients",
            "trained/round",
            "Flower round (s)",
            "plain loop (s)",
            "ratio",
            "start-up (s)",
            "to ServerApp / nodes / query / model (s)",
            "peak PSS (MB)",
            "peak RSS (MB)",
            "flwr-simulation RSS (MB)",
        ],
        [
            (
                n,
                m["clients_per_round"],
                m["round_seconds"],
                m["plain_loop_seconds"],
                m["ratio"],
                m["startup_seconds"],
                " / ".join(
                    f"{m[k]:.1f}"
                    for k in (
                        "startup_to_serverapp_seconds",
                        "startup_nodes_seconds",
                        "startup_partition_query_seconds",
                        "startup_initial_model_seconds",
                    )
                ),
                m["peak_pss_mb"],
                m["peak_rss_mb"],
                m["simulation_process_rss_mb"],
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


class MemoryWatch:
    """Samples the summed RSS and PSS of a simulation's processes every 0.5 s."""

    def __init__(self, simulation: LocalSimulation) -> None:
        self.simulation = simulation
        self.peak_rss = 0.0
        self.peak_pss = 0.0
        self.peak_simulation_rss = 0.0  # the flwr-simulation process alone
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            rss = pss = 0.0
            for pid in self._tree():
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

    def _tree(self) -> set[int]:
        pids = set(processes_with_home(self.simulation.home))
        if self.simulation.process is not None:
            pids |= {self.simulation.process.pid, *descendants(self.simulation.process.pid)}
        return pids

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join(timeout=5)


if __name__ == "__main__":
    main(sys.argv[1:])
