"""A screenshot of the live page, keyed, after the 30-request run of its test
(tests/ui_scenario.py), with one request held at the backend and four waiting. The picture in the
docs is this one (`--out docs/img/ui.png`). Needs Debian's chromium.

    python benchmarks/ui_screenshot.py [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from browser import Browser  # noqa: E402
from ui_scenario import OPS_KEY, RUN, busy_proxy  # noqa: E402

DEFAULT_OUT = Path(tempfile.gettempdir()) / "clairvoyant-bench" / "ui.png"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the PNG to write (default {DEFAULT_OUT})")
    out = parser.parse_args().out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with busy_proxy() as scene, Browser(height=1000) as browser:
        page = browser.open(f"{scene.base}/ui/")
        page.wait_for("!document.getElementById('login').hidden", what="the key form")
        page.type_into("#key", OPS_KEY)
        page.press_enter()
        page.wait_for("document.querySelectorAll('#waiting tbody tr[data-request-id]').length === 4", what="the queue")
        page.wait_for(f"document.querySelectorAll('#chart-answers circle.dot').length >= {RUN}", what="the charts")
        page.screenshot(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
