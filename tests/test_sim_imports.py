"""The simulator stays off the serving stack: no dispatcher, app, fastapi, uvicorn or httpx."""

from __future__ import annotations

import subprocess
import sys
import textwrap

FORBIDDEN = ("clairvoyant.scheduling.dispatcher", "clairvoyant.proxy.app", "fastapi", "uvicorn", "httpx", "starlette")


def test_simulator_never_imports_the_proxy(tmp_path: object) -> None:
    code = textwrap.dedent(
        f"""
        import argparse, sys, tempfile
        import clairvoyant.tools.sim
        from clairvoyant.tools.sim import command, engine, experiments, plots, predictors, report, workload
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        out = tempfile.mkdtemp()
        command.run(parser.parse_args(["tau-sweep", "--n", "100", "--seeds", "1", "--out", out, "--no-progress", "--no-plots"]))
        loaded = [m for m in {FORBIDDEN!r} if m in sys.modules]
        assert "clairvoyant.scheduling.job_queue" in sys.modules and "clairvoyant.scheduling.policy" in sys.modules
        print("LOADED", loaded)
        sys.exit(1 if loaded else 0)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "LOADED []" in proc.stdout
