"""Sheaf-FRL's Figure 3 analogue: robustness to latent compression, through Flower.

    python -m simulations.sheaf_bottleneck --out DIR [--seeds 3] [--quick]

Two agents with different encoders (MLPs 64-64-d and 64-160-d) on one edge, s = 0.9,
the same latent dimension d for both, swept over 2, 4, 8, 16, 32, 64; Sheaf-FRL against
the non-cooperative baselines, Sheaf-FMTL, FedProto, FedMuscle and CoMFed
(``--baselines``; each aligned after training as the lambda = 0 baseline is, CoMFed's
plain row through its own learned maps), every value the mean over the seeds. Each agent holds
about 700 training samples; one local epoch per round, 60 rounds. lambda = 3, chosen
on the agents' validation splits at d = 8 over seeds 0-2 by ``simulations.tune``
(``--key sheaf-lambda --metric communication_accuracy.pilots --run-config
conf/sheaf_figure3.toml``): validation communication accuracy 0.539 / 0.619 / 0.621 /
0.661 / 0.677 / 0.574 for lambda 0.01 / 0.1 / 0.3 / 1 / 3 / 10 (std over seeds
0.04-0.10, so 1 and 3 are tied within noise; the highest mean decides), validation
private accuracy 0.949 at 1 and 0.935 at 3. (The paper's 0.1 was the default before.)

Writes DIR/summary.json of the same shape as ``sheaf_shift`` with d in place of s
("8"), DIR/table.md, DIR/accuracy.png and the runs under DIR/runs/.
"""

from __future__ import annotations

import sys
from typing import Any

from fedpers.simulations.flags import add_key_flags, output_parser, settings
from fedpers.simulations.sheaf_common import (
    TRAINING,
    add_baselines_flag,
    baselines_of,
    report,
    run_grid,
)

DIMENSIONS = (2, 4, 8, 16, 32, 64)
LAMBDA = 3.0  # chosen on validation: see the module docstring

# the other rows of the family the figure compares
BASELINES = ("sheaf-fmtl", "fedproto", "fedmuscle", "comfed")

SETTINGS: dict[str, Any] = {
    **TRAINING,
    "num-clients": 2,
    "num-rounds": 60,
    "epochs": 1,
    "sheaf-shift": 0.9,
    "sheaf-lambda": LAMBDA,
    "sheaf-hidden": "64,160",
    "sheaf-variant": "heterogeneous",
}
# The quick form's 15 rounds are too few for the full run's lambda = 3 (private accuracy
# 0.64 against 0.77 without cooperation, measured): it keeps the paper's 0.1.
QUICK = {"num-rounds": 15, "sheaf-lambda": 0.1}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the bottleneck sweep; returns the summary."""
    parser = output_parser(__doc__.split("\n\n")[0], seeds="3", quick_seeds="1")
    add_key_flags(
        parser,
        ["num-rounds", "sheaf-lambda", "sheaf-variant"],
        SETTINGS,
        aliases={"num-rounds": "rounds", "sheaf-lambda": "lam", "sheaf-variant": "variant"},
    )
    parser.add_argument(
        "--dims",
        default=",".join(str(d) for d in DIMENSIONS),
        help="latent dimensions d to sweep (run-config key 'sheaf-latent-dims' = d,d; "
        "default: %(default)s; with --quick: 8)",
    )
    add_baselines_flag(parser, BASELINES)
    args = parser.parse_args(argv)
    baselines = baselines_of(parser, args)
    try:
        dims = [int(d) for d in args.dims.split(",") if d.strip()]
    except ValueError:
        parser.error(f"--dims '{args.dims}' must be comma-separated integers (2,4,8)")
    if args.quick:
        dims = [8]
    values = settings(args, SETTINGS, QUICK)
    result = run_grid(
        args, values, dims, lambda d: {"sheaf-latent-dims": f"{d},{d}"}, "d", baselines
    )
    title = (
        f"Sheaf-FRL bottleneck, 2 agents, s = {values['sheaf-shift']}, "
        f"lambda {values['sheaf-lambda']}"
    )
    table = report(args.out, result, dims, "d", title)
    print(f"\n{table}\nresults: {args.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
