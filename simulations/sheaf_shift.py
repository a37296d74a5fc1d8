"""Sheaf-FRL's Figure 2 analogue: private and communication accuracy against the
distribution shift s, for Sheaf-FRL and the non-cooperative baselines, through Flower.

    python -m simulations.sheaf_shift --out DIR [--seeds 3] [--quick]

15 heterogeneous agents (the paper's latent dimensions and dropouts, dimensions scaled
by 1/8 for the 8x8 digits: 8 to 32) on the class-overlap graph of density 0.4, 10% of
the digits held out as pilots, s in 0.5 ... 0.9, every value the mean over the seeds.
Sheaf-FMTL and CoMFed (``--baselines``) train on the same graph, data and local epochs
and are aligned after training as the lambda = 0 baseline is (CoMFed's plain row
through its own learned maps, as the paper measures it).
Each round every agent trains 3 local epochs (about 6 SGD steps on its ~86 samples;
calibrated so that the lambda = 0 baseline reaches the ~90% private accuracy of the
reference loop), 60 rounds. lambda = 0.1, chosen on the agents' validation splits
(never their test splits) at s = 0.9 over seeds 0-2 by

    python -m simulations.tune --key sheaf-lambda --values 0.01,0.1,0.3,1 \
        --metric communication_accuracy.pilots --run-config conf/sheaf_figure2.toml \
        --seeds 3 --out DIR

which gave validation communication accuracy 0.540 / 0.5465 / 0.5464 / 0.543 for
lambda 0.01 / 0.1 / 0.3 / 1 (std over seeds 0.010-0.017 except at 1): the best two
are tied within noise, and the highest mean decides. (The default was 0.3 before,
chosen on test figures.)

Writes DIR/summary.json ``{"methods": [METHOD, ...], "private_accuracy": {METHOD: {S: v}},
"communication_accuracy": {METHOD: {S: v}}, "bytes_per_round": {METHOD: v}}`` (S as
"0.9"; each accuracy with ``_std``, ``_ci95``, ``_per_seed``), DIR/table.md,
DIR/accuracy.png and the runs under DIR/runs/.
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

SHIFTS = (0.5, 0.6, 0.7, 0.8, 0.9)
LAMBDA = 0.1  # chosen on validation: see the module docstring

# the other rows of the family the figure compares
BASELINES = ("sheaf-fmtl", "comfed")

SETTINGS: dict[str, Any] = {
    **TRAINING,
    "num-clients": 15,
    "num-rounds": 60,
    "epochs": 3,
    "sheaf-lambda": LAMBDA,
}
QUICK = {"num-rounds": 20}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the shift sweep; returns the summary."""
    parser = output_parser(__doc__.split("\n\n")[0], seeds="3", quick_seeds="1")
    add_key_flags(
        parser,
        ["num-clients", "num-rounds", "sheaf-lambda"],
        SETTINGS,
        aliases={"num-clients": "agents", "num-rounds": "rounds", "sheaf-lambda": "lam"},
    )
    parser.add_argument(
        "--shifts",
        default=",".join(str(s) for s in SHIFTS),
        help="values of run-config key 'sheaf-shift' to sweep (default: %(default)s; "
        "with --quick: 0.9)",
    )
    add_baselines_flag(parser, BASELINES)
    args = parser.parse_args(argv)
    baselines = baselines_of(parser, args)
    try:
        shifts = [float(s) for s in args.shifts.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--shifts '{args.shifts}' must be comma-separated numbers (0.5,0.9)")
    if args.quick:
        shifts = [0.9]
    values = settings(args, SETTINGS, QUICK)
    result = run_grid(args, values, shifts, lambda s: {"sheaf-shift": s}, "s", baselines)
    title = f"Sheaf-FRL, {values['num-clients']} agents, digits, lambda {values['sheaf-lambda']}"
    table = report(args.out, result, shifts, "s", title)
    print(f"\n{table}\nresults: {args.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
