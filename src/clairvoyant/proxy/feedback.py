"""The closed loop: what the backend produced for each completed request goes to the metrics and
the online learner (``clairvoyant.prediction.learner``), and the learner's correction back into the predictor.

- ``UsageRecorder`` is the relay's ``on_usage`` hook. It runs on the event loop once per completed
  scheduled request and does O(1) work: a counter, a histogram, and the learner's ``observe`` (the
  observation sent to the learner's process; refits run there, never here), for at most
  ``learner_max_observations_per_s`` requests a second (a sample of a faster flow). With replicas,
  what its learner took is told to ``on_observed`` (published: scheduling/cluster/observations.py),
  and the other replicas' come back through ``observe_shared``, which draws on the same bucket: the
  rate bounds what reaches this learner in all, its own and the others'.
- ``OnlineLearning`` is the learner's life in the proxy, built by the lifespan: start the learner's
  process (``clairvoyant.prediction.learner_process``), which loads the state file; attach it to the
  predictor as its corrector; have it save the state every ``learner_save_interval_s`` and at
  shutdown. Loading, fitting and saving all happen in that process, never on the event loop.

The learner learns only from ``Usage`` records, which the relay reads from the BACKEND's answer
(its reported token counts, else its counted stream events): nothing a client sends (the request
body, its proxy field, its headers) can become an observed length.

With ``online_learning = false`` the predictor stays the static shipped model: no corrector, no
refits, no state file read or written. Completed requests are still observed, only so that
/metrics shows the static model's rolling prediction quality (the learner's quality windows);
nothing learned from them is ever used.

A predictor that is not an ``OnnxPredictor`` (test doubles) has no prior identity to learn
against: the proxy then records usage in the metrics only.
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
from clairvoyant.prediction.usage import Usage

if TYPE_CHECKING:
    from clairvoyant.prediction.encoder import Refiner
    from clairvoyant.prediction.predictor import Prediction, Predictor
    from clairvoyant.scheduling.dispatcher import Ticket

__all__ = ["OnlineLearning", "UsageRecorder"]

logger = logging.getLogger(__name__)


class RateSample:
    """Takes at most ``per_s`` events a second on average, and bursts of up to ``burst_s`` seconds'
    worth (a token bucket): beyond that rate, the events taken are a sample spread over time."""

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
    """Counts each completed request's usage and, when there is a learner, lets it observe the
    backend's length: at most ``max_observations_per_s`` a second on average, in bursts of up to
    ten seconds' worth (a sample beyond: the learner keeps the last 1,024 per model and refits at
    most once a second, so a flood of completions would cost the request path and the encoder's
    thread for nothing). ``learner=None``: metrics only."""

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
        """``usage`` of ``ticket``'s answer; ``body``: the request body it was sent with."""
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
            # Its row has no encoder columns (none is kept past a request's wait, and one that did
            # not wait was never encoded): the encoder's thread adds them first (a few ms later, off
            # the loop, within its learning share), then the learner observes it. Not taken: a
            # lexical row, counted for quality only. The body is parsed (again) only when the
            # encoder takes it.
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
        """Another replica's learner observation: this learner observes it too, within the same
        bucket as this replica's own, so that at most ``max_observations_per_s`` a second reach it
        in all."""
        learner = self.learner
        if learner is None:
            return
        if not self.sample.take():
            self.metrics.learner.sampled_out.inc()
            return
        learner.observe(prediction, tokens)


def _prompt_of(path: str, body: bytes) -> Prompt | None:
    """The prompt of a scheduled request's body (None: not one, or no longer parseable)."""
    endpoint = SCHEDULED_ENDPOINTS.get(path)
    if endpoint is None:
        return None
    try:
        return parse_request(endpoint, body).prompt
    except RequestError:  # the body it was queued with parsed once; one rewritten since may not
        return None


def _identity(predictor: Predictor, encoder: Any = None) -> PriorIdentity | None:
    """The prior a learner is tied to, or None for a predictor without one (a test double)."""
    if not all(hasattr(predictor, name) for name in ("feature_set", "onnx_sha256", "corrector")):
        return None
    return PriorIdentity.of(predictor, encoder)


class OnlineLearning:
    """The learner's lifecycle in the proxy (see the module docstring). ``learner`` is None when the
    predictor has no prior identity."""

    def __init__(self, settings: Settings, predictor: Predictor, metrics: Metrics, encoder: Any = None) -> None:
        self.settings = settings
        self.predictor = predictor
        self.encoder = encoder  # refines waiting requests: its components join the learner's rows
        self.metrics = metrics
        self.learning = settings.online_learning
        self.state_path = settings.learner_state_path if settings.online_learning else None
        self.learner: LearnerProcess | None = None
        self.recorder = UsageRecorder(metrics, max_observations_per_s=settings.learner_max_observations_per_s)
        self._saver: asyncio.Task[None] | None = None
        self._previous_corrector: Any = None  # restored at stop: a predictor may outlive one app
        self._saved_total = 0  # learner.observed_total at the last save (skip saves with nothing new)
        self._quality_total = -1  # learner.observed_total when the quality gauges were last refreshed

    async def start(self) -> None:
        identity = _identity(self.predictor, self.encoder)
        if identity is None:
            logger.info("online learning: the predictor has no prior identity; usage is recorded in metrics only")
            return
        learner = LearnerProcess(identity, state_path=self.state_path, fit=self.learning)
        if not await learner.start():  # logged: the proxy serves with the static model
            return
        self.learner = learner
        self._saved_total = learner.observed_total
        self.recorder.learner = learner
        self.recorder.feature_row = getattr(self.predictor, "feature_row", None)
        if not self.learning:
            logger.info("online learning off: the static model predicts; its quality is still measured")
            return
        predictor: Any = self.predictor
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
        """Stop saving, save once more, and stop the learner's process. Call after the dispatcher
        has drained."""
        if self._saver is not None:
            self._saver.cancel()
            await asyncio.gather(self._saver, return_exceptions=True)
            self._saver = None
        learner = self.learner
        if learner is None:
            return
        if self.learning:
            predictor: Any = self.predictor
            predictor.corrector = self._previous_corrector
            await self.save()
        await learner.stop()

    async def save(self) -> bool:
        """Have the learner's process save the state now if there is a state file and anything
        new. True if saved. A failed save is logged, never raised: the proxy keeps serving."""
        learner = self.learner
        if learner is None or self.state_path is None or not self.learning:
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
        """Bring the quality gauges up to date (before /metrics renders). The learner's process
        recomputes the rolling quality only if requests were observed since the last refresh."""
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
