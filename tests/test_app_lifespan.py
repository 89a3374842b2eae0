"""proxy/app.py's lifespan: start-up unwinds whatever it had started, in reverse order, and the
failure is reported as what it was (not as a failure to bind the port)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from polling import process_alive, wait_until

from clairvoyant.config import Settings
from clairvoyant.prediction.learner_process import LearnerProcess
from clairvoyant.prediction.predictor import OnnxPredictor
from clairvoyant.proxy.app import create_app
from clairvoyant.proxy.pool import BackendPool
from clairvoyant.proxy.server import EXIT_STARTUP_FAILED, ProxyServer, StartupFailed
from clairvoyant.scheduling.dispatcher import Dispatcher


def test_a_failure_after_the_learner_started_stops_it_and_is_named(
    free_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    learners: list[LearnerProcess] = []
    dispatchers: list[Dispatcher] = []
    stops: list[str] = []
    start_learner, start_dispatcher = LearnerProcess.start, Dispatcher.start
    stop_learner, stop_dispatcher, close_pool = LearnerProcess.stop, Dispatcher.stop, BackendPool.aclose

    async def learner_started(self: LearnerProcess, *args: Any, **kwargs: Any) -> bool:
        learners.append(self)
        return await start_learner(self, *args, **kwargs)

    async def dispatcher_started(self: Dispatcher) -> None:
        dispatchers.append(self)
        await start_dispatcher(self)

    def monitors_refused(self: BackendPool, dispatcher: Dispatcher) -> None:
        raise RuntimeError("the backend monitors would not start")

    def recorded(name: str, stop: Any) -> Any:
        async def stopped(*args: Any, **kwargs: Any) -> None:
            stops.append(name)
            await stop(*args, **kwargs)

        return stopped

    monkeypatch.setattr(LearnerProcess, "start", learner_started)
    monkeypatch.setattr(Dispatcher, "start", dispatcher_started)
    monkeypatch.setattr(LearnerProcess, "stop", recorded("learner", stop_learner))
    monkeypatch.setattr(Dispatcher, "stop", recorded("dispatcher", stop_dispatcher))
    monkeypatch.setattr(BackendPool, "aclose", recorded("pool", close_pool))
    monkeypatch.setattr(BackendPool, "start", monitors_refused)  # after the learner and the dispatcher
    settings = Settings(port=free_port, encoder=False, upstream_url="http://127.0.0.1:9")
    server = ProxyServer(create_app(settings, predictor=OnnxPredictor()), settings)

    with pytest.raises(StartupFailed) as failed:
        asyncio.run(server.serve())

    assert failed.value.exit_code == EXIT_STARTUP_FAILED
    assert str(failed.value) == "the proxy failed to start: the backend monitors would not start"
    assert len(learners) == 1 and len(dispatchers) == 1
    assert stops == ["dispatcher", "learner", "pool"]  # what had started, in reverse order
    assert not learners[0].running and not dispatchers[0].healthy


def test_the_learners_worker_process_is_gone_after_a_failed_start(
    free_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids: list[int] = []
    start_learner = LearnerProcess.start

    async def learner_started(self: LearnerProcess, *args: Any, **kwargs: Any) -> bool:
        started = await start_learner(self, *args, **kwargs)
        assert self.pid is not None and process_alive(self.pid)
        pids.append(self.pid)
        return started

    def service_time_refused(self: Any) -> None:
        raise OSError("service-time state unreadable")

    monkeypatch.setattr(LearnerProcess, "start", learner_started)
    monkeypatch.setattr("clairvoyant.scheduling.service_time.ServiceTimeModel.load", service_time_refused)
    settings = Settings(port=free_port, encoder=False, upstream_url="http://127.0.0.1:9")
    server = ProxyServer(create_app(settings, predictor=OnnxPredictor()), settings)

    with pytest.raises(StartupFailed, match=r"^the proxy failed to start: service-time state unreadable$"):
        asyncio.run(server.serve())

    assert len(pids) == 1
    wait_until(lambda: not process_alive(pids[0]), timeout_s=10, what="the learner's worker process to end")
