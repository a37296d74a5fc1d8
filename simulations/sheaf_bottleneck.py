"""Sheaf-FRL's Figure 3 analogue: robustness to latent compression, through Flower.

    python -m simulations.sheaf_bottleneck --out DIR [--seeds 3] [--quick]

Two agents with different encoders (MLPs 64-64-d and 64-160-d) on one edge, s = 0.9,
the same latent dimension d for both, swept over 2, 4, 8, 16, 32, 64; Sheaf-FRL against
the non-cooperative baselines, every value the mean over the seeds. Each agent holds
about 700 training samples; one local epoch per round, 60 rounds.

Writes DIR/summary.json of the same shape as ``sheaf_shift`` with d in place of s
("8"), DIR/table.md, DIR/accuracy.png and the runs under DIR/runs/.
"""

from __future__ import annotations

import sys
from typing import Any

from simulations.common import output_parser
from simulations.sheaf_common import TRAINING, report, run_grid

DIMENSIONS = (2, 4, 8, 16, 32, 64)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the bottleneck sweep; returns the summary."""
    parser = output_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--lam", type=float, default=0.1, help="lambda of the gluing penalty")
    parser.add_argument(
        "--variant", choices=["heterogeneous", "homogeneous", "private"], default="heterogeneous"
    )
    parser.add_argument("--dims", default=",".join(str(d) for d in DIMENSIONS))
    args = parser.parse_args(argv)
    dims = [int(d) for d in args.dims.split(",") if d.strip()]
    if args.quick:
        args.seeds, args.rounds, dims = 1, 15, [8]
    settings = {
        **TRAINING,
        "num-clients": 2,
        "num-rounds": args.rounds,
        "epochs": 1,
        "sheaf-shift": 0.9,
        "sheaf-lambda": args.lam,
        "sheaf-hidden": "64,160",
        "sheaf-variant": args.variant,
    }
    result = run_grid(args, settings, dims, lambda d: {"sheaf-latent-dims": f"{d},{d}"}, "d")
    table = report(args.out, result, dims, "d", "Sheaf-FRL bottleneck, 2 agents, s = 0.9")
    print(f"\n{table}\nresults: {args.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
