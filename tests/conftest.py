"""Shared pytest fixtures, and the ``e2e`` mark.

Each area keeps its fixtures in its own marked section below; add a new section rather than editing
another one. Heavy imports go inside the fixture, so collecting tests stays cheap.

``e2e`` marks the tests that run a real program and judge it from outside: llama.cpp, headless
Chromium, network namespaces, nginx or wrk, or clairvoyant itself as a process of its own (``serve``
or another command). They need what a laptop may not have, or take seconds each. ``make test`` runs
them; ``pytest -m "not e2e"`` is the quick loop. Tests that use the embedded backend's fixtures, and
the benchmarks' ``bench`` tests, are marked here, so a new one cannot be forgotten; any other says
``@pytest.mark.e2e`` (or ``pytestmark`` for a whole file).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from redis_server import RedisServer

    from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer


# =================================================================================================
# Generic helpers
# =================================================================================================


@pytest.fixture
def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (bind it soon: another process may take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# =================================================================================================
# The e2e mark
# =================================================================================================

# Files whose every test is end to end, marked here because the file itself is kept by others:
# the live page's tests drive headless Chromium.
E2E_FILES = frozenset({"test_ui.py"})


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        uses_llamacpp = "require_embedded_backend" in getattr(item, "fixturenames", ())  # llama_server too
        if uses_llamacpp or item.path.name in E2E_FILES or item.get_closest_marker("bench"):
            item.add_marker(pytest.mark.e2e)


# =================================================================================================
# Embedded llama.cpp backend (clairvoyant.tools.embedded_backend): the real serial LLM server
# =================================================================================================


def backend_missing_reason() -> str | None:
    """Why the embedded backend cannot run here (xllamacpp or the SmolLM2 package missing), else None.

    With ``CLAIRVOYANT_REQUIRE_BACKEND=1`` (set it in CI) a missing backend fails the run instead of
    skipping the end-to-end tests silently.
    """
    from clairvoyant.tools.embedded_backend import BackendNotInstalled, find_smollm2_gguf, xllamacpp_installed

    reason: str | None = None
    if not xllamacpp_installed():
        reason = "xllamacpp is not installed (pip install 'clairvoyant[backend]')"
    else:
        try:
            find_smollm2_gguf()
        except BackendNotInstalled as exc:
            reason = str(exc)
    if reason is not None and os.environ.get("CLAIRVOYANT_REQUIRE_BACKEND") == "1":
        pytest.fail(f"CLAIRVOYANT_REQUIRE_BACKEND=1 but the embedded backend is missing: {reason}")
    return reason


@pytest.fixture(scope="session")
def require_embedded_backend() -> None:
    """Skip the test if xllamacpp or the SmolLM2 model is not installed (fails instead in CI, see above)."""
    reason = backend_missing_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def llama_server(require_embedded_backend: None) -> Iterator[EmbeddedLlamaServer]:
    """One real llama.cpp server (SmolLM2, n_parallel=1: serial FCFS, 1 thread) shared by the whole session.

    Skips only when xllamacpp or the model is not installed; a server that fails to start is an error.
    Tests must not stop it; start an own ``EmbeddedLlamaServer`` to test lifecycle behaviour.
    """
    from clairvoyant.tools.embedded_backend import EmbeddedLlamaServer

    # n_threads=1, not the default 2: tests run the proxy and the clients on the same cores, and on a
    # 2-core machine with other work running, 2 llama.cpp threads measured 4-6 tok/s against 35-45 with 1.
    server = EmbeddedLlamaServer(n_parallel=1, n_threads=1)
    server.start()
    try:
        yield server
    finally:
        server.stop()


# =================================================================================================
# A real redis-server (tests/redis_server.py): the shared store of several replicas
# =================================================================================================


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session. Tests share it: each uses a cluster name of its own. Tests
    that stop or restart a server start their own (``own_redis_server``)."""
    from redis_server import running_redis_server

    with running_redis_server() as server:
        yield server


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """A redis-server this test alone uses, free to stop and restart (``restart_empty``)."""
    from redis_server import running_redis_server

    with running_redis_server() as server:
        yield server
