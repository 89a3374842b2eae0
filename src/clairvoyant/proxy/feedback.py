"""The closed loop: what the backend produced for each completed request goes to the metrics and
the online learner, and the learner's correction back into the predictor (docs/online-learning.md).

The learner learns only from ``Usage`` records, which the relay reads from the BACKEND's answer:
nothing a client sends can become an observed length. Loading, fitting and saving happen in the
learner's process, never on the event loop. With ``online_learning = false`` the predictor stays
the static model; completed requests are still observed, only for /metrics' prediction quality.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from clairvoyant.config import Settings
from clairvoyant.errors import RequestError
from clairvoyant.metrics import Metrics
from clairvoyant.prediction.dialects import SCHEDULED_ENDPOINTS, parse_request
from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.learner import PriorIdentity
from clairvoyant.prediction.learner_process import LearnerProcess, LearnerUnavailable
from clairvoyant.prediction.predictor import OnnxPredictor
from clairvoyant.prediction.usage import Usage

if TYPE_CHECKING:
    from clairvoyant.prediction.encoder import Refiner
    from clairvoyant.prediction.predictor import Prediction, Predictor
    from clairvoyant.scheduling.dispatcher import Ticket

__all__ = ["OnlineLearning", "UsageRecorder"]

logger = logging.getLogger(__name__)


class RateSample:
    """A token bucket: at most ``per_s`` events a second on average, in bursts of up to ``burst_s``
    seconds' worth; beyond that rate, the events taken are a sample spread over time."""

    def __init__(self, per_s: float, burst_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not (per_s > 0 and burst_s > 0):
            raise ValueError(f"per_s and burst_s must be > 0, got {per_s}, {burst_s}")
        self.per_s = per_s
        self.burst = max(1.0, per_s * burst_s)
        self.clock = clock
        self._tokens = self.burst
        self._at_s = clock()

    def take(self) -> bool:
        now_s = self.clock()
        tokens = min(self.burst, self._tokens + (now_s - self._at_s) * self.per_s)
        self._at_s = now_s
        if tokens < 1.0:
            self._tokens = tokens
            return False
        self._tokens = tokens - 1.0
        return True


class UsageRecorder:
    """A scheduled request's ``on_usage``, O(1) on the loop: counts its usage and lets the learner
    (if any) observe the backend's length, at most ``max_observations_per_s`` a second (the learner
    keeps the last 1,024 per model and refits at most once a second: a flood would cost the request
    path and the encoder's thread for nothing). With replicas, what it took goes to ``on_observed``,
    and the others' come back through ``observe_shared``, from the same bucket."""

    def __init__(
        self, metrics: Metrics, learner: LearnerProcess | None = None, *, max_observations_per_s: float
    ) -> None:
        self.metrics = metrics
        self.learner = learner
        self.sample = RateSample(max_observations_per_s)
        self.refiner: Refiner | None = None  # the encoder's thread, when the learner reads its components
        # A prompt's feature row, for a prediction that carries none (it waited: see proxy/app.py);
        # None: such a request is counted only.
        self.feature_row: Callable[[Prompt], bytes] | None = None
        # Told each observation this replica's learner took (replicas share them: scheduling/cluster/observations.py).
        self.on_observed: Callable[[Prediction, int], None] | None = None

    def __call__(self, ticket: Ticket, usage: Usage, body: bytes = b"") -> None:
        """``body``: the request body the answer was sent with."""
        self.metrics.prediction.count_usage(usage.source, usage.output_tokens)
        prediction = ticket.prediction  # made by now, even when it was deferred past dispatch
        learner = self.learner
        tokens = usage.output_tokens
        if learner is None or prediction is None or not usage.observed or tokens is None:
            return
        if not self.sample.take():
            self.metrics.learner.sampled_out.inc()
            return
        feature_row = self.feature_row
        if feature_row is None:
            self._observe(learner, prediction, tokens)
            return
        prompt: Prompt | None = None
        if not prediction.feature_row:  # refined by the encoder while it waited: its row is made again
            prompt = _prompt_of(ticket.endpoint, body)
            if prompt is not None:
                prediction = replace(prediction, feature_row=feature_row(prompt))
        refiner = self.refiner
        if (
            refiner is not None
            and learner.identity.n_features > learner.identity.n_counts
            and len(prediction.feature_row) == 4 * learner.identity.n_counts
        ):
            # Its row has no encoder columns (none is kept past a request's wait): the encoder's
            # thread adds them first (off the loop, within its learning share), then the learner
            # observes it. Not taken: a lexical row, for quality only. The body is parsed again only
            # when the encoder takes it.
            lexical = prediction

            def instruction() -> str | None:
                read = prompt or _prompt_of(ticket.endpoint, body)
                return None if read is None else read.instruction

            def observe_encoded(_log_tokens: float, components: bytes) -> None:
                self._observe(learner, replace(lexical, feature_row=lexical.feature_row + components), tokens)

            if refiner.encode_later(instruction, observe_encoded):
                return
        self._observe(learner, prediction, tokens)

    def _observe(self, learner: LearnerProcess, prediction: Prediction, tokens: int) -> None:
        if learner.observe(prediction, tokens) and self.on_observed is not None:
            self.on_observed(prediction, tokens)

    def observe_shared(self, prediction: Prediction, tokens: int) -> None:
        """Another replica's learner observation, within this replica's bucket."""
        learner = self.learner
        if learner is None:
            return
        if not self.sample.take():
            self.metrics.learner.sampled_out.inc()
            return
        learner.observe(prediction, tokens)


def _prompt_of(path: str, body: bytes) -> Prompt | None:
    """The prompt of a scheduled request's body (None: no longer parseable)."""
    endpoint = SCHEDULED_ENDPOINTS.get(path)
    if endpoint is None:
        return None
    try:
        return parse_request(endpoint, body).prompt
    except RequestError:  # the body it was queued with parsed once; one rewritten since may not
        return None


class OnlineLearning:
    """The learner's process in the proxy: started with its state file, attached to the predictor
    as its corrector, saved every ``learner_save_interval_s`` and at stop. ``learner`` is None when
    the predictor has no prior identity (a test double: usage is then counted in the metrics only)."""

    def __init__(self, settings: Settings, predictor: Predictor, metrics: Metrics, encoder: Any = None) -> None:
        self.settings = settings
        self.predictor = predictor
        self.encoder = encoder  # refines waiting requests: its components join the learner's rows
        self.metrics = metrics
        self.state_path = settings.learner_state_path if settings.online_learning else None
        self.learner: LearnerProcess | None = None
        self.recorder = UsageRecorder(metrics, max_observations_per_s=settings.learner_max_observations_per_s)
        self._saver: asyncio.Task[None] | None = None
        self._previous_corrector: Any = None  # restored at stop: a predictor may outlive one app
        self._saved_total = 0  # learner.observed_total at the last save (skip saves with nothing new)
        self._quality_total = -1  # learner.observed_total when the quality gauges were last refreshed

    async def start(self) -> None:
        predictor = self.predictor
        if not isinstance(predictor, OnnxPredictor):
            logger.info("online learning: the predictor has no prior identity; usage is recorded in metrics only")
            return
        learner = LearnerProcess(
            PriorIdentity.of(predictor, self.encoder), state_path=self.state_path, fit=self.settings.online_learning
        )
        if not await learner.start():  # logged: the proxy serves with the static model
            return
        self.learner = learner
        self._saved_total = learner.observed_total
        self.recorder.learner = learner
        self.recorder.feature_row = predictor.feature_row
        if not self.settings.online_learning:
            logger.info("online learning off: the static model predicts; its quality is still measured")
            return
        self._previous_corrector = predictor.corrector
        predictor.corrector = learner
        if self.state_path is not None:
            self._saver = asyncio.create_task(self._save_periodically(), name="learner-saver")
        logger.info(
            "online learning on: learner process %s, state file %s, saved every %ss",
            learner.pid,
            self.state_path or "none (in memory only)",
            self.settings.learner_save_interval_s,
        )

    async def stop(self) -> None:
        """Save once more and stop the learner's process (after the dispatcher has drained)."""
        if self._saver is not None:
            self._saver.cancel()
            await asyncio.gather(self._saver, return_exceptions=True)
            self._saver = None
        learner = self.learner
        if learner is None:
            return
        if self.settings.online_learning:
            predictor: Any = self.predictor
            predictor.corrector = self._previous_corrector
            await self.save()
        await learner.stop()

    async def save(self) -> bool:
        """True if saved (a state file, and anything new). A failed save is logged, never raised."""
        learner = self.learner
        if learner is None or self.state_path is None:  # no state file without online_learning
            return False
        total = learner.observed_total
        if total == self._saved_total:
            return False
        try:
            await learner.save()
        except (OSError, LearnerUnavailable, TimeoutError) as exc:  # disk full, permissions, no process...
            logger.warning("online learner: cannot save state to %s: %s", self.state_path, exc)
            return False
        self._saved_total = total
        return True

    async def _save_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.settings.learner_save_interval_s)
            await self.save()

    async def refresh_quality(self) -> None:
        """Bring the quality gauges up to date (before /metrics renders), recomputed only if
        requests were observed since the last refresh."""
        learner = self.learner
        if learner is None:
            return
        total = learner.observed_total
        if total != self._quality_total:
            try:
                await learner.update_quality(timeout_s=2.0)
                self._quality_total = total
            except (LearnerUnavailable, TimeoutError):  # shown as last computed
                pass
        self.metrics.prediction.set_quality(learner.quality())
        self.metrics.learner.publish(learner.running, learner.refits, learner.dropped)
