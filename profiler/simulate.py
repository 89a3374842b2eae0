#!/usr/bin/env python
"""Thin wrapper: ``python profiler/simulate.py tau-sweep ...`` == ``clairvoyant simulate tau-sweep ...``."""

from __future__ import annotations

import argparse
import sys

from clairvoyant.tools.sim import command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="simulate.py", description=command.__doc__.splitlines()[0] if command.__doc__ else None
    )
    command.add_arguments(parser)
    return command.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
