"""End-to-end benchmarking of the proxy against a real serial backend.

Modules, bottom up: ``prompt_set`` (real prompts with known answer lengths, resolved from the
installed ShareGPT package), ``client`` (one streamed request, TTFT and end-to-end time),
``workload`` (burst and Poisson request schedules), ``stats`` (percentiles, mean/std over runs,
reductions), ``plots`` (matplotlib, Agg), ``runner`` (conditions x runs, the proxy in-process).
The ``profiler/*.py`` scripts and ``clairvoyant demo`` are thin layers over these.
"""
