"""The closed loop's rate limit: the online learner takes at most learner_max_observations_per_s
completed requests a second; the usage metrics count every one."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from clairvoyant.config import Settings
from clairvoyant.metrics import Metrics
from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.predictor import OnnxPredictor
from clairvoyant.prediction.usage import Usage
from clairvoyant.proxy.feedback import OnlineLearning, RateSample, UsageRecorder


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_rate_sample_takes_a_burst_then_the_rate() -> None:
    clock = Clock()
    sample = RateSample(2.0, burst_s=3.0, clock=clock)
    assert [sample.take() for _ in range(8)] == [True] * 6 + [False] * 2  # 3 s worth at 2/s
    clock.now_s += 0.25  # half a token
    assert not sample.take()
    clock.now_s += 0.25  # a whole one
    assert sample.take()
    assert not sample.take()
    clock.now_s += 1000.0  # idle: the bucket refills to its burst, no further
    assert sum(sample.take() for _ in range(10)) == 6


def test_rate_sample_over_a_long_flood_keeps_the_rate() -> None:
    clock = Clock()
    sample = RateSample(10.0, burst_s=10.0, clock=clock)
    taken = 0
    for _ in range(60_000):  # 60 s of 1,000 events a second
        clock.now_s += 0.001
        taken += sample.take()
    assert 100 + 600 - 2 <= taken <= 100 + 600 + 1  # the burst, then 10 a second


@pytest.mark.parametrize("per_s, burst_s", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_rate_sample_refuses_a_rate_that_takes_nothing(per_s: float, burst_s: float) -> None:
    with pytest.raises(ValueError):
        RateSample(per_s, burst_s)


class LearnerSpy:
    """The learner's process as the recorder sees it: what it was handed."""

    def __init__(self) -> None:
        self.observed: list[int] = []

    def observe(self, prediction: Any, tokens: int) -> bool:
        self.observed.append(tokens)
        return True


def test_recorder_counts_every_completion_and_lets_the_learner_observe_at_most_the_rate() -> None:
    metrics = Metrics()
    learner = LearnerSpy()
    recorder = UsageRecorder(metrics, learner, max_observations_per_s=1.0)  # type: ignore[arg-type]
    clock = Clock()
    recorder.sample = RateSample(1.0, burst_s=5.0, clock=clock)
    ticket = SimpleNamespace(prediction=OnnxPredictor().predict(Prompt("Say OK.")), endpoint="/v1/chat/completions")
    for tokens in range(1, 21):  # 20 completions in the same instant
        recorder(ticket, Usage(tokens, 12, None, None, 0.01, "m", "openai_usage", 0))  # type: ignore[arg-type]
    assert learner.observed == [1, 2, 3, 4, 5]  # the burst
    clock.now_s += 2.0
    recorder(ticket, Usage(99, 12, None, None, 0.01, "m", "openai_usage", 0))  # type: ignore[arg-type]
    assert learner.observed[-1] == 99
    text = metrics.render().decode()
    assert 'clairvoyant_usage_observations_total{source="openai_usage"} 21.0' in text
    assert "clairvoyant_learner_sampled_out_observations_total 15.0" in text


def test_other_replicas_observations_share_the_learners_rate_and_are_not_published_again() -> None:
    """With replicas (scheduling/cluster/observations.py): what this learner took is told to
    ``on_observed`` (to publish); the others' go through ``observe_shared``, under the same bucket,
    so at most the rate reaches the learner in all, and they are not told again (no echo)."""
    metrics = Metrics()
    learner = LearnerSpy()
    recorder = UsageRecorder(metrics, learner, max_observations_per_s=1.0)  # type: ignore[arg-type]
    clock = Clock()
    recorder.sample = RateSample(1.0, burst_s=4.0, clock=clock)
    published: list[int] = []
    recorder.on_observed = lambda _prediction, tokens: published.append(tokens)
    prediction = OnnxPredictor().predict(Prompt("Say OK."))
    ticket = SimpleNamespace(prediction=prediction, endpoint="/v1/chat/completions")
    recorder(ticket, Usage(1, 12, None, None, 0.01, "m", "openai_usage", 0))  # type: ignore[arg-type]
    for tokens in (101, 102):
        recorder.observe_shared(prediction, tokens)
    recorder(ticket, Usage(2, 12, None, None, 0.01, "m", "openai_usage", 0))  # type: ignore[arg-type]
    recorder.observe_shared(prediction, 103)  # the bucket (4) is empty: sampled out
    recorder(ticket, Usage(3, 12, None, None, 0.01, "m", "openai_usage", 0))  # type: ignore[arg-type]
    assert learner.observed == [1, 101, 102, 2]
    assert published == [1, 2]
    assert metrics.registry.get_sample_value("clairvoyant_learner_sampled_out_observations_total") == 2.0


def test_the_default_rate_is_the_settings_one() -> None:
    settings = Settings(learner_max_observations_per_s=3.0)
    learning = OnlineLearning(settings, OnnxPredictor(), Metrics())
    assert learning.recorder.sample.per_s == 3.0
    assert learning.recorder.sample.burst == 30.0
