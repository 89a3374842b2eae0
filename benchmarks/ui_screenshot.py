"""Make docs/img/ui.png: the live page, keyed, after the 30-request run of its test
(tests/ui_scenario.py), with one request held at the backend and four waiting. Needs Debian's
chromium.

    python benchmarks/ui_screenshot.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from browser import Browser  # noqa: E402
from ui_scenario import OPS_KEY, RUN, busy_proxy  # noqa: E402


def main() -> None:
    out = ROOT / "docs" / "img" / "ui.png"
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
