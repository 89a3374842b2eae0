"""End-to-end benchmarking of the proxy against a real serial backend.

Modules, bottom up: ``prompt_set`` (real prompts with known answer lengths, resolved from the
installed ShareGPT package), ``client`` (one streamed request, TTFT and end-to-end time),
``workload`` (a burst of requests with forced lengths), ``stats`` (percentiles, mean/std over runs,
reductions), ``plots`` (matplotlib, Agg), ``runner`` (conditions x runs, the proxy in-process),
``report`` (the CSV, JSON and markdown summaries) and ``commands`` (the backend options and
``profiler/measure_mu_short.py``'s command). ``clairvoyant demo``, ``clairvoyant simulate``'s
prompt-set workload, profiler/measure_mu_short.py and benchmarks/bench_scheduling.py use them.
"""
