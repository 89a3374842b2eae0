"""A screenshot of the live page (/ui/) over a held queue: three tenants, priorities and a few
finished requests. The picture of the page in the docs (docs/img/ui.png) is this one. Needs
Debian's chromium.

    python benchmarks/ui_screenshot.py [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import respx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from proxy_harness import MarkerPredictor, mock_transport, queue_snapshot, running_proxy, wait_until  # noqa: E402

from clairvoyant.config import Settings  # noqa: E402

DEFAULT_OUT = Path(tempfile.gettempdir()) / "clairvoyant-bench" / "ui.png"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the PNG to write (default {DEFAULT_OUT})")
    out = parser.parse_args().out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    gate = threading.Event()
    served: list[str] = []

    async def backend(request: httpx.Request) -> httpx.Response:
        text = json.loads(request.content)["messages"][-1]["content"]
        served.append(text)
        if "hold" in text:
            while not gate.is_set():
                await asyncio.sleep(0.01)
        tokens = 40 if "[short]" in text else 700
        return httpx.Response(
            200,
            json={
                "choices": [{"message": {"content": "x"}}],
                "usage": {"completion_tokens": tokens, "prompt_tokens": 20},
            },
        )

    router = respx.MockRouter(base_url="http://upstream.test")
    router.post("/v1/chat/completions").mock(side_effect=backend)
    router.get("/health").mock(return_value=httpx.Response(200, json={"status": "ok"}))  # the proxy's backend check
    settings = Settings(upstream_url="http://upstream.test", starvation_timeout_s=600)
    with running_proxy(settings, predictor=MarkerPredictor(), upstream_transport=mock_transport(router)) as base:

        def post(text: str, tenant: str, priority: int = 0) -> threading.Thread:
            body = {"model": "llama3.2:1b", "messages": [{"role": "user", "content": text}], "priority": priority}
            t = threading.Thread(
                target=httpx.post,
                args=(f"{base}/v1/chat/completions",),
                kwargs={"json": body, "headers": {"X-Clairvoyant-Tenant": tenant}, "timeout": 60},
            )
            t.start()
            return t

        for text, tenant in [("[short] a", "alice"), ("[long] b", "bob"), ("[short] c", "alice")]:
            post(text, tenant).join()
        threads = [post("[long] hold", "bob")]
        wait_until(lambda: "[long] hold" in served)
        for text, tenant, priority in [
            ("[long] x", "bob", 5),
            ("[short] y", "alice", 0),
            ("[p=0.5] z", "alice", 0),
            ("[short] w", "bob", 5),
            ("[p=0.7] v", "carol", 2),
        ]:
            threads.append(post(text, tenant, priority))
        wait_until(lambda: len(queue_snapshot(base)["waiting"]) == 5)
        time.sleep(2.5)
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [
                    "chromium",
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    f"--user-data-dir={profile}",
                    "--virtual-time-budget=3000",
                    f"--screenshot={out}",
                    "--window-size=1280,640",
                    f"{base}/ui/",
                ],
                check=True,
                capture_output=True,
            )
        gate.set()
        for t in threads:
            t.join(timeout=60)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
