"""benchmarks/harness/request_path.py: order, paired differences, /proc CPU, nginx configs, wrk script and parsing.

The checks that run the real nginx and wrk are marked ``bench``: ``make bench-test`` installs the
tools and runs them, ``make test`` leaves them out. They assert answers and counts, never timings.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from harness.request_path import (  # noqa: E402
    WRK_MARKER,
    expand_command,
    main_thread_cpu_seconds,
    nginx_fixed_answer_conf,
    nginx_proxy_conf,
    paired_differences,
    parse_proc_stat_cpu_ticks,
    parse_wrk_output,
    predecessor_counts,
    round_orders,
    summarize_ms,
    tree_cpu_seconds,
    wrk_script,
)

NAMES = ("direct", "nginx", "bare", "proxy")


# -- order ---------------------------------------------------------------------------------------


def test_round_orders_are_seeded_permutations_that_vary() -> None:
    orders = round_orders(NAMES, 200, seed=3)
    assert len(orders) == 200
    assert all(sorted(o) == sorted(NAMES) for o in orders)
    assert orders == round_orders(NAMES, 200, seed=3)
    assert orders != round_orders(NAMES, 200, seed=4)
    assert len({tuple(o) for o in orders}) > 12  # many of the 24 permutations, not one rotation


def test_random_order_removes_the_rotations_predecessor_bias() -> None:
    names = ("direct", "bare", "proxy")
    rotation = [list(names[i % 3 :] + names[: i % 3]) for i in range(3000)]  # the old script's order
    rotated = predecessor_counts(rotation)["direct"]
    assert rotated["proxy"] > 1.9 * rotated["bare"]  # direct mostly runs right after the proxy

    shuffled = predecessor_counts(round_orders(names, 3000, seed=0))["direct"]
    assert abs(shuffled["proxy"] - shuffled["bare"]) < 0.05 * shuffled["proxy"]  # each proxy as often before it
    assert shuffled["direct"] > 0  # rounds run back to back: direct can follow itself across a round boundary


def test_predecessor_counts_chain_rounds_and_mark_the_first() -> None:
    counts = predecessor_counts([["a", "b"], ["b", "a"]])
    assert counts["a"] == {"-": 1, "b": 1}
    assert counts["b"] == {"a": 1, "b": 1}


# -- paired statistics ---------------------------------------------------------------------------


def test_paired_differences_are_per_round_and_drop_nan_pairs() -> None:
    samples = {"direct": [1.0, 2.0, 3.0, math.nan], "proxy": [1.5, 2.25, math.nan, 9.0], "nginx": [1.0, 2.0, 3.0, 4.0]}
    diffs = paired_differences(samples, "direct")
    assert set(diffs) == {"proxy", "nginx"}
    assert diffs["proxy"] == [0.5, 0.25]
    assert diffs["nginx"] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rounds"):
        paired_differences({"direct": [1.0], "proxy": [1.0, 2.0]}, "direct")


def test_pairing_by_round_cancels_a_shift_shared_by_the_round() -> None:
    # each round is slower or faster as a whole (machine noise); the proxy adds 1 s to its round
    direct = [10.0, 50.0, 20.0, 40.0, 30.0]
    proxy = [d + 1.0 for d in direct]
    paired = summarize_ms(paired_differences({"direct": direct, "proxy": proxy}, "direct")["proxy"])
    assert paired["p50_ms"] == paired["p90_ms"] == pytest.approx(1000.0)
    mispaired = summarize_ms(paired_differences({"direct": direct, "proxy": sorted(proxy)}, "direct")["proxy"])
    assert mispaired["p90_ms"] - mispaired["p50_ms"] > 10_000  # without the pairing the noise swamps the 1 s


def test_summarize_ms_converts_and_counts() -> None:
    s = summarize_ms([0.001, 0.002, 0.003, 0.004, 0.005])
    assert s == pytest.approx({"p50_ms": 3.0, "p90_ms": 4.6, "p99_ms": 4.96, "n": 5.0})


# -- CPU from /proc ------------------------------------------------------------------------------


def _stat(pid: int, name: str, ppid: int, utime: int, stime: int) -> str:
    fields = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime)] + ["0"] * 30
    return f"{pid} ({name}) " + " ".join(fields) + "\n"


def test_parse_proc_stat_survives_a_name_with_spaces_and_parens() -> None:
    assert parse_proc_stat_cpu_ticks(_stat(42, "nginx: worker) (x", 7, 120, 30)) == (7, 150)


def test_parse_proc_stat_reads_this_process() -> None:
    ppid, _ = parse_proc_stat_cpu_ticks(Path(f"/proc/{os.getpid()}/stat").read_text())
    assert ppid == os.getppid()


def test_tree_cpu_seconds_sums_a_process_and_its_descendants_only(tmp_path: Path) -> None:
    tree = {10: (1, 100, 0), 11: (10, 50, 50), 12: (11, 7, 3), 20: (1, 999, 999), 21: (20, 5, 5)}
    for pid, (ppid, ut, st) in tree.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(_stat(pid, "srv", ppid, ut, st))
    (tmp_path / "self").mkdir()  # non-numeric entries are ignored
    (tmp_path / "30").mkdir()  # a process that exited while we looked (no stat file)
    tick = os.sysconf("SC_CLK_TCK")
    assert tree_cpu_seconds(10, proc=tmp_path) == pytest.approx(210 / tick)
    assert tree_cpu_seconds(11, proc=tmp_path) == pytest.approx(110 / tick)
    assert tree_cpu_seconds(99, proc=tmp_path) == 0.0


def test_main_thread_cpu_seconds_reads_only_the_thread_with_the_process_id(tmp_path: Path) -> None:
    for tid, (ut, st) in {10: (40, 2), 13: (500, 500)}.items():  # the main thread, and a worker thread
        (tmp_path / "10" / "task" / str(tid)).mkdir(parents=True)
        (tmp_path / "10" / "task" / str(tid) / "stat").write_text(_stat(tid, "srv", 1, ut, st))
    tick = os.sysconf("SC_CLK_TCK")
    assert main_thread_cpu_seconds(10, proc=tmp_path) == pytest.approx(42 / tick)
    assert main_thread_cpu_seconds(99, proc=tmp_path) == 0.0


# -- nginx and wrk -------------------------------------------------------------------------------


def test_proxy_conf_streams_and_keeps_upstream_connections(tmp_path: Path) -> None:
    conf = nginx_proxy_conf(tmp_path, 8081, "http://127.0.0.1:9000/", keepalive=64)
    for line in (
        "proxy_buffering off;",
        "keepalive 64;",
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
        "server 127.0.0.1:9000;",
        "proxy_next_upstream error timeout non_idempotent;",
        "listen 127.0.0.1:8081;",
        "daemon off;",
    ):
        assert line in conf


def test_fixed_answer_conf_refuses_nginx_quoting_characters(tmp_path: Path) -> None:
    assert "return 200 '{\"a\":1}';" in nginx_fixed_answer_conf(tmp_path, 8082, '{"a":1}')
    with pytest.raises(ValueError):
        nginx_fixed_answer_conf(tmp_path, 8082, "it's")


SAMPLE_WRK_STDOUT = f"""Running 5s test @ http://127.0.0.1:1234/v1/chat/completions
  2 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.20ms  300.00us   9.00ms   90.00%
  12000 requests in 5.00s, 3.00MB read
  Non-2xx or 3xx responses: 3
Requests/sec:   2400.00
{WRK_MARKER}{{"requests": 12000, "duration_us": 5000000, "bytes": 3000000, "connect": 0, "read": 1, "write": 0, "status": 3, "timeout": 2, "p50_us": 1100, "p90_us": 1500, "p99_us": 4200, "max_us": 9000, "mean_us": 1200.0}}
"""


def test_parse_wrk_output_reads_the_marker_line() -> None:
    r = parse_wrk_output(SAMPLE_WRK_STDOUT)
    assert r.requests == 12000 and r.requests_per_s == pytest.approx(2400.0)
    assert (r.p50_ms, r.p90_ms, r.p99_ms, r.max_ms) == pytest.approx((1.1, 1.5, 4.2, 9.0))
    assert (r.socket_errors, r.status_errors) == (3, 3)
    assert not r.ok
    with pytest.raises(ValueError, match="wrk_script"):
        parse_wrk_output(SAMPLE_WRK_STDOUT.replace(WRK_MARKER, ""))


def test_wrk_script_posts_the_body_as_a_lua_string() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": 'say "hi"'}]})
    script = wrk_script("POST", body)
    assert 'wrk.method = "POST"' in script
    assert f"wrk.body = {json.dumps(body)}" in script  # a JSON string literal is a valid Lua string here
    assert "wrk.body" not in wrk_script("GET")


def test_expand_command_fills_placeholders_per_argument() -> None:
    argv = expand_command("{python} -m x serve --upstream {upstream} --name 'a {port}'", python="/p y",
                          upstream="http://h:1", port="8080")  # fmt: skip
    assert argv == ["/p y", "-m", "x", "serve", "--upstream", "http://h:1", "--name", "a 8080"]
    with pytest.raises(KeyError, match="slots"):
        expand_command("--slots {slots}", port="1")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _nginx_bin() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


def _start_nginx(prefix: Path, conf_text: str, port: int) -> subprocess.Popen[bytes]:
    prefix.mkdir()
    os.chmod(prefix, 0o755)
    (prefix / "nginx.conf").write_text(conf_text)
    nginx = _nginx_bin()
    assert nginx is not None
    proc = subprocess.Popen(
        [nginx, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(prefix / "nginx.conf")]
    )
    for _ in range(100):
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            return proc
        except httpx.HTTPError:
            assert proc.poll() is None, (prefix / "error.log").read_text()
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("nginx did not answer")


@pytest.fixture
def nginx_pair(tmp_path: Path) -> Iterator[tuple[int, int, str]]:
    """A fixed-answer nginx and an nginx reverse proxy in front of it: (backend port, proxy port, answer)."""
    if _nginx_bin() is None:
        pytest.skip("nginx not installed (make bench-tools)")
    answer = json.dumps({"object": "chat.completion", "choices": [{"message": {"content": "OK"}}]})
    backend_port, proxy_port = _free_port(), _free_port()
    procs = [_start_nginx(tmp_path / "backend", nginx_fixed_answer_conf(tmp_path / "backend", backend_port, answer),
                          backend_port)]  # fmt: skip
    try:
        procs.append(_start_nginx(tmp_path / "proxy", nginx_proxy_conf(
            tmp_path / "proxy", proxy_port, f"http://127.0.0.1:{backend_port}"), proxy_port))  # fmt: skip
        yield backend_port, proxy_port, answer
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


@pytest.mark.bench
def test_rendered_nginx_configs_serve_the_fixed_answer_through_the_proxy(nginx_pair: tuple[int, int, str]) -> None:
    backend_port, proxy_port, answer = nginx_pair
    for port in (backend_port, proxy_port):
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"messages": []})
        assert r.status_code == 200 and r.text == answer
        assert r.headers["content-type"] == "application/json"


@pytest.mark.bench
def test_wrk_script_runs_in_real_wrk_and_its_report_parses(nginx_pair: tuple[int, int, str], tmp_path: Path) -> None:
    if shutil.which("wrk") is None:
        pytest.skip("wrk not installed (make bench-tools)")
    _, proxy_port, _ = nginx_pair
    script = tmp_path / "post.lua"
    script.write_text(wrk_script("POST", json.dumps({"messages": [{"role": "user", "content": "Say OK."}]})))
    done = subprocess.run(["wrk", "-t1", "-c4", "-d1s", "-s", str(script), f"http://127.0.0.1:{proxy_port}/v1/chat/completions"],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = parse_wrk_output(done.stdout)
    assert result.ok and result.requests > 0
    assert result.p50_ms <= result.p99_ms <= result.max_ms


def test_the_instruction_count_is_read_from_a_callgrind_dump(tmp_path: Path) -> None:
    from bench_instructions import callgrind_total

    dump = tmp_path / "proxy.callgrind.1"
    dump.write_text("# callgrind format\nversion: 1\nevents: Ir\nfn=(1) main\n16 20\nsummary: 123456789\n")
    assert callgrind_total(dump) == 123_456_789
    dump.write_text("# callgrind format\nevents: Ir\ntotals: 42\n")
    assert callgrind_total(dump) == 42
    dump.write_text("# callgrind format\nevents: Ir\n")
    with pytest.raises(ValueError, match="no instruction total"):
        callgrind_total(dump)


def test_callgrind_runs_the_server_itself_with_the_variables_an_env_prefix_sets() -> None:
    from bench_instructions import without_env_prefix

    argv, env = without_env_prefix(["env", "PYTHONPATH=/b/src", "A=x=y", "python", "-m", "m"], {"A": "0", "B": "1"})
    assert argv == ["python", "-m", "m"] and env == {"A": "x=y", "B": "1", "PYTHONPATH": "/b/src"}
    assert without_env_prefix(["python", "s.py"], {}) == (["python", "s.py"], {})
