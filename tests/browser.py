"""A headless Chromium driven over the DevTools protocol, for the live page's tests and its screenshot.

The protocol runs over a pipe (``--remote-debugging-pipe``: commands on the browser's fd 3, answers
on its fd 4, each message JSON ending in a NUL byte), so no port and no client package are needed.
Chromium is Debian's ``chromium`` package (``make test`` installs it); without it, the tests fail.

    with Browser() as browser:
        page = browser.open(url)
        page.wait_for("document.querySelector('#login:not([hidden])')", what="the key form")
        page.type_into("#key", key)
        page.press_enter()
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
    "--disable-background-networking", "--disable-component-update", "--disable-extensions",
    "--remote-debugging-pipe", "--hide-scrollbars",
)  # fmt: skip
COMMAND_TIMEOUT_S = 30.0


class BrowserError(AssertionError):
    """The browser did not start, did not answer, or answered a command with an error."""


def chromium_path() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise BrowserError("Debian's chromium is not installed (make test installs it: apt-get install chromium)")
    return found


class Browser:
    """One headless Chromium process with a fresh profile; ``open`` gives a page (a tab)."""

    def __init__(self, width: int = 1280, height: int = 900) -> None:
        self.width, self.height = width, height
        self._profile = tempfile.TemporaryDirectory()
        self._process: subprocess.Popen[bytes] | None = None
        self._next_id = 0
        self._buffer = b""
        self.errors: list[str] = []  # the pages' uncaught exceptions, as the browser reported them

    def __enter__(self) -> Browser:
        commands_read, commands_write = os.pipe()
        answers_read, answers_write = os.pipe()
        # The browser wants the pipe on its fds 3 and 4: moved there by bash (dash takes no fd above 9).
        theirs = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (commands_read, answers_write)]
        os.close(commands_read)
        os.close(answers_write)
        command = [
            chromium_path(), *CHROMIUM_FLAGS, f"--user-data-dir={self._profile.name}",
            f"--window-size={self.width},{self.height}", "about:blank",
        ]  # fmt: skip
        with open(Path(self._profile.name) / "chromium.log", "wb") as log:
            self._process = subprocess.Popen(
                ["bash", "-c", f'exec "$@" 3<&{theirs[0]} 4>&{theirs[1]}', "bash", *command],
                pass_fds=theirs, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            )  # fmt: skip
        for fd in theirs:
            os.close(fd)
        self._out = os.fdopen(commands_write, "wb", buffering=0)
        self._in = answers_read
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._process is not None and self._process.poll() is None:
                self.command("Browser.close")
                self._process.wait(timeout=15)
        except (BrowserError, OSError, subprocess.TimeoutExpired):
            if self._process is not None:
                self._process.kill()
                self._process.wait(timeout=15)
        finally:
            self._out.close()
            os.close(self._in)
            self._profile.cleanup()

    def command(self, method: str, params: dict[str, Any] | None = None, tab: str | None = None) -> Any:
        """Send one command (to the browser, or to the tab attached as ``tab``) and return its
        result; events on the way are skipped, but for the pages' exceptions. Raises BrowserError."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if tab is not None:
            message["sessionId"] = tab  # the protocol's name for an attached target
        self._out.write(json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("method") == "Runtime.exceptionThrown":
                    details = answer["params"]["exceptionDetails"]
                    self.errors.append(details.get("exception", {}).get("description") or details.get("text", ""))
                if answer.get("id") == self._next_id:
                    if "error" in answer:
                        raise BrowserError(f"{method}: {answer['error']}")
                    return answer.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise BrowserError(f"{method}: no answer in {COMMAND_TIMEOUT_S} s")
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise BrowserError(f"{method}: the browser closed its pipe ({self.log()[-2000:]})")
            self._buffer += chunk

    def log(self) -> str:
        path = Path(self._profile.name) / "chromium.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def open(self, url: str) -> Page:
        target = self.command("Target.createTarget", {"url": "about:blank"})["targetId"]
        tab = self.command("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, tab)
        page.command("Page.enable")
        page.command("Runtime.enable")  # its exceptions are reported from now on (Browser.errors)
        page.command("Page.navigate", {"url": url})
        return page


class Page:
    def __init__(self, browser: Browser, tab: str) -> None:
        self.browser, self.tab = browser, tab

    def command(self, method: str, params: dict[str, Any] | None = None) -> Any:
        return self.browser.command(method, params, self.tab)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited). Raises BrowserError."""
        result = self.command(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 20.0, what: str = "") -> Any:
        """Poll ``expression`` until its value is truthy in Python, and return it. Values come back
        as JSON (a DOM node is ``{}``: compare it with null). Raises BrowserError at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = self.evaluate(expression)
            except BrowserError:  # the page is still loading (no document yet)
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out waiting for {what or expression}")
            time.sleep(0.05)

    def type_into(self, selector: str, text: str) -> None:
        """Focus the element and type ``text`` into it, as a user's keyboard would."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self.command("Input.insertText", {"text": text})

    def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            self.command(
                "Input.dispatchKeyEvent",
                {"type": kind, "key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13, "text": "\r"},
            )

    def screenshot(self, path: Path, width: int | None = None) -> None:
        """The whole page as a PNG (beyond the window's height)."""
        size = self.command("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": width or size["width"], "height": size["height"], "scale": 1}
        shot = self.command("Page.captureScreenshot", {"format": "png", "clip": clip, "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(shot["data"]))
