"""Check a run configuration before `flwr run`: every key named, every value validated.

    python -m simulations.check conf/fedgmm_table2.toml \
        --run-config "algorithm='fedem' num-rounds=20"
    fedpers check conf/fedgmm_table2.toml        (the same, from an installed wheel)

Flower refuses an unknown key with "Invalid run configuration" and does not say which;
this names it (with the closest known key), checks every value against the schema and
the data root of a data set read from disk, and prints the resolved configuration and
the ``--federation-config`` the run needs. Exit status 0 if the configuration is valid,
1 (with the error) otherwise. Nothing starts.
"""

from __future__ import annotations

import argparse
import sys

from fedpers.simulations.flags import missing_files, run_config_values
from fedpers.simulations.launch import resolved_config, to_toml
from fedpers.simulations.runs import validate_runs


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """Check the configuration of ``CONFIG.toml`` files and ``--run-config`` items;
    ``prog`` names the command in the usage line (``fedpers check``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog=prog)
    parser.add_argument(
        "config",
        nargs="*",
        metavar="CONFIG.toml",
        help="run-config files (conf/*.toml), read before --run-config; later ones win",
    )
    parser.add_argument(
        "--run-config",
        action="append",
        default=[],
        metavar="'KEY=VALUE ...' or FILE.toml",
        help="as `flwr run --run-config`; may be given more than once, later ones win",
    )
    args = parser.parse_args(argv)
    missing = missing_files(args.config)
    if missing:
        parser.error(missing)
    try:
        values = run_config_values([*args.config, *args.run_config])
        validate_runs([values])
    except SystemExit as error:
        print(error.code, file=sys.stderr)
        return 1
    config = resolved_config(values)
    sys.stdout.write(to_toml(config.to_mapping()))
    print(f'# run with --federation-config "num-supernodes={config.num_clients}"')
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
