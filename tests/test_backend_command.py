"""`clairvoyant backend`'s threads: by default the cores it may use, less one for the proxy."""

from __future__ import annotations

import argparse
import os

import pytest

from clairvoyant.tools import backend


@pytest.mark.parametrize(("allowed", "threads"), [({0}, 1), ({0, 1}, 1), ({0, 1, 2, 3}, 3), (set(range(16)), 15)])
def test_the_default_threads_leave_one_allowed_core_free(
    monkeypatch: pytest.MonkeyPatch, allowed: set[int], threads: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: allowed, raising=False)
    assert backend.default_threads() == threads
    parser = argparse.ArgumentParser()
    backend.add_arguments(parser)
    assert parser.parse_args([]).threads == threads
    assert parser.parse_args(["--threads", "2"]).threads == 2


def test_without_an_affinity_call_the_cpu_count_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert backend.default_threads() == 7
