#!/usr/bin/env python
"""Measure mu_short, the mean sojourn time of concurrent Short requests, and the recommended
starvation timeout tau = 3 x mu_short (paper 3.4).

    python profiler/measure_mu_short.py --backend http://localhost:11434 --dialect ollama --class short --n 100
    python profiler/measure_mu_short.py --class short --n 100     # the embedded llama.cpp server

Point --backend at the proxy instead of the backend to measure through it.
Thin wrapper over clairvoyant.tools.bench.commands.mu_short_main; --help lists every flag.
"""

from clairvoyant.tools.bench.commands import mu_short_main

if __name__ == "__main__":
    raise SystemExit(mu_short_main())
