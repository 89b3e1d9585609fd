"""How many warm spares a dsim.train command line asks for (tft.spares), for the launchers that add them to -n.

    $ python -m dsim.ft.spare_count --config configs/default.yaml --set tft.spares=1
    1

A config that does not load prints 0: the run itself then reports the error in its one line.
"""
from __future__ import annotations

import sys


def spares(argv) -> int:
    from ..config import ConfigError, load_config
    from ..train import parse_args
    try:
        args = parse_args(config_options(argv))
        return load_config(args.config, args.overrides).tft.spares
    except (ConfigError, SystemExit):
        return 0


def config_options(argv) -> list:
    """The --config and --set options of argv (the launch scripts pass every option through)."""
    keep, i = [], 0
    while i < len(argv):
        if argv[i] in ("--config", "--set") and i + 1 < len(argv):
            keep += argv[i:i + 2]
            i += 2
        else:
            i += 1
    return keep


if __name__ == "__main__":
    print(max(spares(sys.argv[1:]), 0))
