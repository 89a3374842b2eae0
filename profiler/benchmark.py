#!/usr/bin/env python
"""End-to-end benchmark through the proxy against a real backend (see docs/benchmarks.md).

    python profiler/benchmark.py --mode burst --n-short 50 --n-long 50 --runs 3
    python profiler/benchmark.py --mode poisson --rho 0.5,0.74,0.85 --backend http://localhost:8080

Thin wrapper over clairvoyant.tools.bench.commands.benchmark_main; --help lists every flag.
"""

from clairvoyant.tools.bench.commands import benchmark_main

if __name__ == "__main__":
    raise SystemExit(benchmark_main())
