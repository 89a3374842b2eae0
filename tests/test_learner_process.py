"""The online learner in a worker process (``clairvoyant.prediction.learner_process``): the same fit
as in-process, the state file through the worker, a worker that dies, cannot save, or cannot start,
and one whose proxy dies."""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from polling import process_alive, until, wait_until

from clairvoyant.metrics import Metrics
from clairvoyant.prediction.learner import LearnerConfig, OnlineLearner, PriorIdentity
from clairvoyant.prediction.learner_process import LearnerProcess, LearnerUnavailable
from clairvoyant.prediction.predictor import Prediction

N_FEATURES = 6
IDENTITY = PriorIdentity("test_set", tuple(f"f{i}" for i in range(N_FEATURES)), "a" * 64)


def _prediction(row: np.ndarray, prior_log: float, model: str = "m") -> Prediction:
    return Prediction(prior_log, math.exp(prior_log), None, prior_log, row.astype(np.float32).tobytes(), model, None)


def _world(n: int, seed: int = 0, embedding: int = 0) -> list[tuple[Prediction, int]]:
    """Observations whose prior is biased (x e^1.5) and blind to feature 0; with ``embedding``
    dimensions after the columns (the encoder's, for the residual kNN), on which the truth
    also depends."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 4, size=(n, N_FEATURES)).astype(np.float32)
    vectors = rng.normal(0, 1, size=(n, embedding)).astype(np.float32)
    truth = 4.0 + 0.8 * np.log1p(rows[:, 0]) + rng.normal(0, 0.2, n)
    if embedding:
        truth += 0.5 * np.sign(vectors[:, 0])
    prior = 5.5 + rng.normal(0, 0.2, n)
    return [
        (_prediction(np.concatenate([r, v]), float(p)), int(round(math.exp(t))))
        for r, v, p, t in zip(rows, vectors, prior, truth)
    ]


def _corrections(learner: OnlineLearner | LearnerProcess, probes: list[Prediction]) -> list[float]:
    return [learner.correction("m", np.frombuffer(p.feature_row, np.float32), p.prior_log_tokens) for p in probes]


@pytest.mark.parametrize("embedding", [0, 8])
def test_the_proxy_corrects_exactly_as_the_learner_does_in_process(embedding: int) -> None:
    # 0: the linear correction the child fits; 8: plus the residual kNN on rows with an embedding,
    # whose memory the proxy's side keeps.
    observations = _world(200, embedding=embedding)
    config = LearnerConfig(refit_every=200)  # one refit, once all 200 have arrived
    local = OnlineLearner(IDENTITY, config)
    for prediction, tokens in observations:
        local.observe(prediction, tokens)
    local.refit()
    probes = [p for p, _ in _world(50, seed=1, embedding=embedding)]
    expected = _corrections(local, probes)
    assert max(abs(v) for v in expected) > 0.5  # the premise: a large correction was learned
    if embedding:  # the premise: the kNN's part is not nothing
        linear_only = _corrections(local, [replace(p, feature_row=p.feature_row[: 4 * N_FEATURES]) for p in probes])
        assert max(abs(a - b) for a, b in zip(expected, linear_only)) > 0.05

    async def run() -> list[float]:
        remote = LearnerProcess(IDENTITY, config)
        assert await remote.start()
        try:
            assert _corrections(remote, probes[:1]) == [0.0]  # nothing learned yet
            for prediction, tokens in observations:
                assert remote.observe(prediction, tokens)
            await until(lambda: remote.refits >= 1, timeout_s=30, what="a fit from the child")
            return _corrections(remote, probes)
        finally:
            await remote.stop()

    assert asyncio.run(run()) == expected  # the same floats: the same code on the same data


def test_unusable_observations_are_refused_before_they_are_sent() -> None:
    remote = LearnerProcess(IDENTITY)  # never started: a refusal needs no child
    prediction, _ = _world(1)[0]
    assert not remote.observe(prediction, -1)
    assert not remote.observe(prediction, True)  # type: ignore[arg-type]  # a bool is not a count
    assert not remote.observe(Prediction(5.0, 148.0, None, 5.0, b"\x00" * 12, "m", None), 10)  # another prior's row
    assert remote.observed_total == 0 and remote.dropped == 0
    assert remote.observe(prediction, 10)  # usable, but there is no child to take it: counted as dropped
    assert remote.observed_total == 1 and remote.dropped == 1


def test_the_state_file_round_trips_through_the_child_and_a_corrupt_one_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "learner.npz"
    observations = _world(40, embedding=8)
    probes = [p for p, _ in _world(20, seed=1, embedding=8)]

    async def learn_and_save() -> list[float]:
        remote = LearnerProcess(IDENTITY, state_path=state)
        assert await remote.start() and remote.observed_total == 0
        for prediction, tokens in observations:
            remote.observe(prediction, tokens)
        await remote.save()
        await until(lambda: remote.refits >= 1, timeout_s=30, what="a fit")
        learned = _corrections(remote, probes)
        await remote.stop()
        return learned

    async def restored() -> tuple[int, int, list[float]]:
        remote = LearnerProcess(IDENTITY, state_path=state)
        assert await remote.start()
        try:
            await until(lambda: remote.refits >= 1 or remote.observed_total == 0, timeout_s=30, what="the restored fit")
            await remote.update_quality()
            quality = remote.quality().get("m")
            observed = 0 if quality is None else quality.observations
            return remote.observed_total, observed, _corrections(remote, probes)
        finally:
            await remote.stop()

    learned = asyncio.run(learn_and_save())
    assert any(abs(v) > 0.1 for v in learned)
    # The restored fit and kNN memory correct as before (a restart refits the same observations;
    # the kNN's memory comes back from the file through the child, float32 cosines alike).
    total, observed, again = asyncio.run(restored())
    assert (total, observed) == (40, 40)
    assert np.allclose(again, learned, rtol=1e-6, atol=1e-9)

    state.write_bytes(b"PK\x03\x04 not a learner state")
    caplog.set_level(logging.WARNING, logger="clairvoyant.prediction.learner")
    total, observed, corrections = asyncio.run(restored())
    assert (total, observed) == (0, 0) and corrections == [0.0] * len(probes)  # the prior: nothing restored
    refused = [r for r in caplog.records if r.name == "clairvoyant.prediction.learner" and "refused" in r.getMessage()]
    assert len(refused) == 1 and str(state) in refused[0].getMessage()


def test_a_failed_save_raises_the_workers_reason_and_the_worker_keeps_learning(tmp_path: Path) -> None:
    async def run() -> None:
        remote = LearnerProcess(IDENTITY, state_path=tmp_path)  # a directory: it cannot be written over
        assert await remote.start()
        try:
            prediction, tokens = _world(1)[0]
            remote.observe(prediction, tokens)
            with pytest.raises(OSError, match="Is a directory"):
                await remote.save()
            remote.observe(prediction, tokens)
            await remote.update_quality()
            assert remote.quality()["m"].observations == 2
        finally:
            await remote.stop()

    asyncio.run(run())


def test_a_killed_worker_is_started_again_from_the_saved_state_and_the_last_fit_is_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "learner.npz"
    observations = _world(40)
    probe = observations[0][0]
    row = np.frombuffer(probe.feature_row, np.float32)
    caplog.set_level(logging.INFO, logger="clairvoyant.prediction.learner_process")

    async def run() -> None:
        remote = LearnerProcess(IDENTITY, LearnerConfig(refit_every=8), state, respawn_after_s=1.0)
        assert await remote.start()
        try:
            for prediction, tokens in observations:
                remote.observe(prediction, tokens)
            await remote.save()
            await until(lambda: remote.refits >= 1, timeout_s=30, what="a fit")
            learned = remote.correction("m", row, probe.prior_log_tokens)
            assert learned != 0.0
            first = remote.pid
            assert first is not None
            os.kill(first, signal.SIGKILL)
            assert remote.observe(*observations[1])  # its batch finds the worker dead
            await until(lambda: not remote.running, timeout_s=30, what="the death noticed")
            assert remote.dropped == 1
            assert remote.correction("m", row, probe.prior_log_tokens) == learned  # the last fit is kept
            assert remote.observe(*observations[2]) and remote.dropped == 2  # nobody to take it
            with pytest.raises(LearnerUnavailable):
                await remote.save()
            metrics = Metrics()
            metrics.learner.publish(remote.running, remote.refits, remote.dropped)
            shown = metrics.render().decode()
            assert "clairvoyant_learner_up 0.0" in shown
            assert "clairvoyant_learner_dropped_observations_total 2.0" in shown
            await until(lambda: remote.running, timeout_s=30, what="a new worker")
            assert remote.pid != first and not process_alive(first)
            assert remote.observed_total == 40  # the saved state, restored
            await remote.update_quality()
            assert remote.quality()["m"].observations == 40
        finally:
            await remote.stop()

    asyncio.run(run())
    messages = [r.getMessage() for r in caplog.records]
    assert any("died" in m and "started again in 1 s" in m for m in messages)
    assert any("running again" in m for m in messages)


def test_the_worker_ignores_ctrl_c_and_sigterm_and_stop_leaves_no_process_behind() -> None:
    async def run() -> int:
        remote = LearnerProcess(IDENTITY)
        assert await remote.start()
        pid = remote.pid
        assert pid is not None and process_alive(pid)
        os.kill(pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
        os.kill(pid, signal.SIGTERM)  # and systemd's stop, every process of the unit
        await remote.update_quality()  # still answering
        assert remote.running
        await remote.stop()
        assert not remote.running
        return pid

    pid = asyncio.run(run())
    assert not process_alive(pid)
    assert multiprocessing.active_children() == []


def test_the_worker_never_outlives_the_proxy(tmp_path: Path) -> None:
    # A proxy killed outright (SIGKILL, the OOM killer) shuts nothing down: the worker notices alone.
    script = tmp_path / "proxy.py"
    script.write_text(
        "import asyncio\n"
        "from clairvoyant.prediction.learner import PriorIdentity\n"
        "from clairvoyant.prediction.learner_process import LearnerProcess\n"
        "async def main():\n"
        "    remote = LearnerProcess(PriorIdentity('test_set', ('f0',), 'a' * 64))\n"
        "    assert await remote.start()\n"
        "    print(remote.pid, flush=True)\n"
        "    await asyncio.sleep(3600)\n"  # the proxy serves until the test kills it
        "if __name__ == '__main__':\n"
        "    asyncio.run(main())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    with subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env) as proxy:
        try:
            assert proxy.stdout is not None
            worker = int(proxy.stdout.readline())
            assert process_alive(worker)
        finally:
            proxy.kill()
    wait_until(lambda: not process_alive(worker), timeout_s=30, what="the worker of a killed proxy to end")


def test_a_worker_that_does_not_start_in_time_is_reported_and_not_started_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="clairvoyant.prediction.learner_process")

    async def run() -> None:
        remote = LearnerProcess(IDENTITY, respawn_after_s=0.05)
        assert not await remote.start(timeout_s=0.001)  # a new interpreter takes far longer
        assert remote._respawn.task is None and not remote.running
        prediction, tokens = _world(1)[0]
        assert remote.observe(prediction, tokens) and remote.dropped == 1  # the proxy serves on, unlearning
        await remote.stop()

    asyncio.run(run())
    errors = [r.getMessage() for r in caplog.records]
    assert len(errors) == 1 and "did not start" in errors[0]
    # the worker it began is let go, not waited for: it ends by itself
    wait_until(lambda: multiprocessing.active_children() == [], timeout_s=30, what="the late worker to end")


def test_fewer_observations_than_refit_every_are_fitted_once_quiet() -> None:
    async def run() -> None:
        remote = LearnerProcess(IDENTITY, LearnerConfig(refit_every=1000), quiet_refit_s=0.2)
        assert await remote.start()
        try:
            for prediction, tokens in _world(40):
                remote.observe(prediction, tokens)
            await remote.update_quality()  # all 40 are in the worker, and none made a refit due
            assert remote.refits == 0
            await until(lambda: remote.refits == 1, timeout_s=30, what="the quiet refit")
        finally:
            await remote.stop()

    asyncio.run(run())


def test_with_learning_off_the_proxys_side_keeps_no_knn_memory() -> None:
    async def run() -> int:
        remote = LearnerProcess(IDENTITY, fit=False)
        assert await remote.start()
        try:
            for prediction, tokens in _world(20, embedding=8):
                remote.observe(prediction, tokens)
            await remote.update_quality()
            assert remote.quality()["m"].observations == 20  # the quality is still measured
            return len(remote.corrector.knn)
        finally:
            await remote.stop()

    assert asyncio.run(run()) == 0
