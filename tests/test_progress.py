"""tools/progress.py: a bar on a terminal (tqdm, or a line rewritten in place without it), plain
lines anywhere else."""

from __future__ import annotations

import io
import sys

import pytest

from clairvoyant.tools.progress import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(file: io.StringIO, steps: int = 3) -> str:
    with progress(steps, desc="measuring", unit="req", file=file) as bar:
        for _ in range(steps):
            bar.update(1)
    return file.getvalue()


def test_plain_lines_when_not_a_terminal() -> None:
    assert run(io.StringIO()) == "measuring: 1/3\nmeasuring: 2/3\nmeasuring: 3/3\n"


def test_tqdms_bar_on_a_terminal() -> None:
    shown = run(Terminal())
    assert "\r" in shown and "measuring: 100%|" in shown and "3/3" in shown


def test_a_line_in_place_on_a_terminal_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as after a plain install without the tools extra
    assert run(Terminal()) == "\rmeasuring: 1/3\rmeasuring: 2/3\rmeasuring: 3/3\n"
