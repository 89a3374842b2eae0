"""What the benchmarks share; each script in benchmarks/ imports from here, never from another script.

* ``proxy_process``: the proxy as deployed (``python -m clairvoyant serve``, CLAIRVOYANT_* settings)
  in a child process, and its resident memory.
* ``fake_backend``: an OpenAI-style backend in a thread, with exact timing and a record of every
  request; ``recording_backend`` keeps each request's bytes as they arrived.
* ``verdicts``: reading raw answers, percentiles, the table of targets and PASS/FAIL.
* ``servers`` and ``request_path``: nginx, the bare pass-through (``passthrough``) and the proxy
  under test as child processes; nginx configurations, wrk's script and report, paired statistics.
* ``raw_client``, ``http_vectors``, ``http11probe``: HTTP/1.1 conformance vectors over raw sockets.
* ``predictor_load``: a llama.cpp server generating continuously, the predictor benchmark's load.
* ``results``: where ``--json`` writes (a temporary directory unless given).

The scripts run as ``python benchmarks/<script>.py``, so this folder is importable as ``harness``.
"""
