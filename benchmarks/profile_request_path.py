"""Where the proxy's CPU goes per request: `clairvoyant serve` under cProfile, driven by wrk.

    python benchmarks/profile_request_path.py [--stream] [--connections 1] [--duration 10]
        [--proxy-cmd '{python} -m clairvoyant.cli serve ...'] [--top 40] [--no-profile]

The backend is nginx answering every request with a fixed answer (a chat-completion JSON, or with
``--stream`` a two-event SSE stream and ``"stream": true`` in the request body). wrk sends the
scheduled POST /v1/chat/completions for ``--duration`` seconds on ``--connections`` connections.
Prints requests/s, the proxy's CPU per request (``/proc`` ticks of its process tree) and, unless
``--no-profile``, the top functions by own time and by cumulative time per request (cProfile adds
its own overhead: read the shares, not the absolute microseconds). Not a timed test.
"""

from __future__ import annotations

import argparse
import json
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import servers  # noqa: E402

from clairvoyant.tools.bench.request_path import (  # noqa: E402
    nginx_fixed_answer_conf,
    parse_wrk_output,
    tree_cpu_seconds,
    wrk_script,
)

ANSWER = (
    '{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"bench","choices":[{"index":0,'
    '"message":{"role":"assistant","content":"OK"},"finish_reason":"stop"}],'
    '"usage":{"prompt_tokens":12,"completion_tokens":1,"total_tokens":13}}'
)
SSE = (
    'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"bench","choices":[{"index":0,'
    '"delta":{"content":"OK"},"finish_reason":null}]}\n\n'
    'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"bench","choices":[{"index":0,'
    '"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":1,"total_tokens":13}}\n\n'
    "data: [DONE]\n\n"
)

# uvicorn re-raises SIGTERM once it has shut down, which would kill `python -m cProfile` before it
# writes its file: the profile is dumped from our own SIGTERM handler, which uvicorn restores first.
PROFILED = """
import cProfile, signal, sys
out, sys.argv = sys.argv[1], ["clairvoyant", *sys.argv[2:]]
profile = cProfile.Profile()
def dump(*_):
    profile.disable()
    profile.dump_stats(out)
    sys.exit(0)
signal.signal(signal.SIGTERM, dump)
from clairvoyant.cli import main
profile.enable()
main()
dump()
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream", action="store_true", help="a streamed request and an SSE answer")
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="wrk threads")
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--no-profile", action="store_true", help="only requests/s and CPU per request")
    parser.add_argument("--proxy-cmd", help="the proxy command (placeholders as bench_proxy_throughput.py)")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "clairvoyant-profile.pstats")
    args = parser.parse_args()
    servers.require_tools("nginx", "wrk")

    body = {"model": "bench", "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 1}
    if args.stream:
        body["stream"] = True
    backend_port, proxy_port = servers.free_port(), servers.free_port()
    upstream = f"http://127.0.0.1:{backend_port}"

    def render(prefix: Path) -> str:
        conf = nginx_fixed_answer_conf(prefix, backend_port, SSE if args.stream else ANSWER)
        if args.stream:
            conf = conf.replace("default_type application/json;", "default_type text/event-stream;")
        return conf

    argv = servers.proxy_argv(args.proxy_cmd, upstream, proxy_port, args.slots)
    if not args.no_profile:  # "{python} -m clairvoyant.cli ARGS" -> "{python} -c PROFILED OUT ARGS"
        module = argv.index("-m")
        argv = [*argv[:module], "-c", PROFILED, str(args.out), *argv[module + 2 :]]
    with tempfile.TemporaryDirectory() as tmp, servers.nginx(render, backend_port):
        script = Path(tmp) / "post.lua"
        script.write_text(wrk_script("POST", json.dumps(body)))
        url = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
        with servers.running(argv, proxy_port, env=servers.proxy_env()) as proc:
            wrk = ["wrk", f"-t{args.threads}", f"-c{args.connections}", "--timeout", "10s", "-s", str(script), url]
            subprocess.run([*wrk[:1], "-d1s", *wrk[1:]], capture_output=True, check=True)  # warm-up
            time.sleep(0.5)
            cpu0 = tree_cpu_seconds(proc.pid)
            done = subprocess.run([*wrk[:1], f"-d{args.duration}s", *wrk[1:]], capture_output=True, text=True)
            cpu1 = tree_cpu_seconds(proc.pid)
            result = parse_wrk_output(done.stdout)
        print(
            f"{'stream' if args.stream else 'json'} c={args.connections}: {result.requests_per_s:,.0f} requests/s, "
            f"p50 {result.p50_ms:.2f} ms, proxy CPU {(cpu1 - cpu0) / max(result.requests, 1) * 1000:.3f} ms/request"
            f" ({'under cProfile' if not args.no_profile else 'no profiler'}); errors: socket "
            f"{result.socket_errors}, status {result.status_errors}"
        )
    if not args.no_profile:
        stats = pstats.Stats(str(args.out))
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
