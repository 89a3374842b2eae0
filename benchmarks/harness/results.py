"""Where a benchmark writes its figures: the file given with ``--json``, else one in a temporary
directory. Every benchmark prints its figures; the file is for comparing runs, never for the tree."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["RESULTS_DIR", "add_json_option", "write_json"]

RESULTS_DIR = Path(tempfile.gettempdir()) / "clairvoyant-bench"


def add_json_option(parser: argparse.ArgumentParser, name: str) -> None:
    """``--json FILE``, by default ``RESULTS_DIR/<name>.json``."""
    default = RESULTS_DIR / f"{name}.json"
    parser.add_argument(
        "--json", type=Path, default=default, metavar="FILE", help=f"write the figures here (default {default})"
    )


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` (its directory created) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {path}")
