"""Property tests (hypothesis): no sequence of observations can make the estimates that order
requests and set their ETAs run backwards, and a few outliers move them only so far.

The estimates: the per-model service-time fit (``ServiceTimeModel.predict_s``), each backend's
slowness (``Backend.observe_service``) and each (backend, model)'s load cost (``observe_load``,
``observe_first_byte``). A request's predicted seconds on a backend is the fit's times the
backend's slowness, plus its load when it pays one.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from clairvoyant.scheduling.routing import SLOWNESS_MAX, SLOWNESS_STEP, SLOWNESS_WEIGHT, Backend
from clairvoyant.scheduling.service_time import (
    C_DECODE_MIN_S,
    FREE_LOAD_S,
    LOAD_OUTLIER_FACTOR,
    OUTLIER_FACTOR,
    SPREAD_WINDOW,
    ServiceTimeModel,
)

MODEL = "smollm2"
durations = st.one_of(
    st.floats(1e-9, 1e9),  # from a nanosecond to thirty years
    st.sampled_from([0.0, -1.0, math.nan, math.inf, 40.0, 1e6, 0.16]),  # bad ones are ignored; outliers
)
tokens = st.one_of(st.integers(0, 200_000), st.sampled_from([0, 1, 8, 18, 450]))
observation = st.tuples(tokens, tokens, durations)  # prompt tokens, output tokens, seconds
# Adversarial sequences: anything, or one point repeated (identical requests), or both
observations = st.one_of(
    st.lists(observation, max_size=60),
    st.tuples(observation, st.integers(1, 300)).map(lambda o: [o[0]] * o[1]),
    st.tuples(st.lists(observation, max_size=20), observation, st.integers(1, 200)).map(lambda o: o[0] + [o[1]] * o[2]),
)


def learned(sequence: list[tuple[int, int, float]]) -> ServiceTimeModel:
    model = ServiceTimeModel()
    for prompt_tokens, output_tokens, duration_s in sequence:
        model.observe(MODEL, prompt_tokens, output_tokens, duration_s)
    return model


@settings(max_examples=300, deadline=None)
@given(observations, st.integers(0, 100_000), st.integers(0, 100_000), st.integers(1, 100_000))
@example([(20, 20, 40.0), (20, 40, 0.16), (20, 40, 0.16), (20, 40, 0.16)], 20, 18, 432)  # the reported case
def test_more_predicted_tokens_never_predict_fewer_seconds(
    sequence: list[tuple[int, int, float]], prompt_tokens: int, fewer: int, more_by: int
) -> None:
    model = learned(sequence)
    coefficients = model.coefficients(MODEL)
    assert all(math.isfinite(v) for v in coefficients.values())
    assert coefficients["c0_s"] >= 0 and coefficients["c_prompt_s"] >= 0
    assert coefficients["c_decode_s"] >= C_DECODE_MIN_S * (1 - 1e-12)
    short_s = model.predict_s(MODEL, prompt_tokens, fewer)
    long_s = model.predict_s(MODEL, prompt_tokens, fewer + more_by)
    assert long_s >= short_s
    if short_s > 0.01:  # above the 10 ms floor, more tokens are strictly more seconds
        assert long_s > short_s
    # The same for prompt tokens (a longer prompt is never quicker)
    assert model.predict_s(MODEL, prompt_tokens + more_by, fewer) >= short_s


@settings(max_examples=200, deadline=None)
@given(st.lists(observation, max_size=40), st.integers(0, 5000), st.integers(1, 5000), durations)
def test_one_observation_moves_a_prediction_no_further_than_a_bounded_one_would(
    sequence: list[tuple[int, int, float]], prompt_tokens: int, output_tokens: int, duration_s: float
) -> None:
    """Robustness: an observation beyond the outlier bound teaches exactly what one at the bound
    would (winsorised), so a 40x outlier counts as a 3x one."""
    outlier, bounded = learned(sequence), learned(sequence)
    bound = outlier.coefficients(MODEL)["outlier_factor"]
    predicted_s = outlier.predict_s(MODEL, prompt_tokens, output_tokens)
    if not (duration_s > 0 and math.isfinite(duration_s)):
        return
    outlier.observe(MODEL, prompt_tokens, output_tokens, duration_s)
    bounded.observe(MODEL, prompt_tokens, output_tokens, min(max(duration_s, predicted_s / bound), predicted_s * bound))
    for name in ("c0_s", "c_prompt_s", "c_decode_s"):
        assert outlier.coefficients(MODEL)[name] == pytest.approx(
            bounded.coefficients(MODEL)[name], rel=1e-9, abs=1e-12
        )


@pytest.mark.parametrize(
    "quick_predicted_tokens",
    [
        8,  # the quick answers predicted at what they produced
        40,  # predicted longer than the slow first one: the case that turned main's fit upside down
    ],
)
def test_a_first_answer_40_s_late_does_not_turn_the_fit_upside_down(quick_predicted_tokens: int) -> None:
    """The reported case: a one-slot backend at 0.02 s a token; the first answer (32 tokens,
    predicted 20) comes 40 s late (a busy CPU, a model load), then three quick 8-token answers.
    main's fit predicted a 450-token essay at 0.01 s and an 18-token answer at 6.8 s
    (c_decode_s = -0.04), or, with the quick answers predicted at 8 tokens, 13.5 s for 18 tokens."""
    model = ServiceTimeModel()
    model.observe(MODEL, 20, 20, 40.0)
    for _ in range(3):
        model.observe(MODEL, 20, quick_predicted_tokens, 8 * 0.02)
    short_s, essay_s = model.predict_s(MODEL, 20, 18), model.predict_s(MODEL, 20, 450)
    assert essay_s > short_s
    assert essay_s - short_s >= (450 - 18) * C_DECODE_MIN_S
    # and the outlier counted as at most 3x: an 18-token answer stays under 2 s (main: 6.8 s and 13.5 s)
    assert short_s < 2.0
    assert model.coefficients(MODEL)["outlier_factor"] == OUTLIER_FACTOR


def test_a_backend_that_really_changed_speed_is_followed() -> None:
    """A warm fit, then the backend is 40x slower for good: the bound widens once about half of
    the last ``SPREAD_WINDOW`` observations agree, and the fit follows at its usual pace."""
    rng = random.Random(1)
    model = ServiceTimeModel()
    for _ in range(200):
        n = rng.randint(5, 300)
        model.observe(MODEL, 20, n, (0.3 + 0.02 * n) * rng.lognormvariate(0, 0.2))
    before_s = model.predict_s(MODEL, 20, 100)
    widest = 0.0
    for i in range(60):
        n = rng.randint(5, 300)
        model.observe(MODEL, 20, n, 40 * (0.3 + 0.02 * n))
        if i < SPREAD_WINDOW:
            widest = max(widest, model.coefficients(MODEL)["outlier_factor"])
    assert widest > 40
    assert model.predict_s(MODEL, 20, 100) > 10 * before_s


def test_a_state_file_with_negative_coefficients_is_projected_on_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A file written before the bounds (main's fit after the reported case) loads physical."""
    import json

    path = tmp_path / "service_time.json"
    p = [[0.45, 0.0, 0.0], [0.0, 1.25, 0.0], [0.0, 0.0, 2000.0]]
    path.write_text(json.dumps({"version": 1, "models": {MODEL: {"theta": [7.49, 0.9, -40.2], "p": p, "n": 4}}}))
    model = ServiceTimeModel(path=path)
    assert model.load()
    assert model.coefficients(MODEL)["c_decode_s"] == pytest.approx(C_DECODE_MIN_S)
    assert model.predict_s(MODEL, 20, 450) > model.predict_s(MODEL, 20, 18)


# -- the backend's slowness --------------------------------------------------------------------

ratios = st.tuples(durations, durations)  # (predicted seconds, measured seconds)


@settings(max_examples=300, deadline=None)
@given(st.lists(ratios, max_size=200), ratios, st.floats(0.01, 1e6), st.floats(0.0, 1e6))
def test_a_backends_slowness_stays_positive_and_moves_little_per_sample(
    sequence: list[tuple[float, float]], last: tuple[float, float], shorter_s: float, longer_by_s: float
) -> None:
    backend = Backend("b", 1)
    for predicted_s, measured_s in sequence:
        backend.observe_service(predicted_s, measured_s)
    before = backend.slowness
    backend.observe_service(*last)
    after = backend.slowness
    assert 1 / SLOWNESS_MAX <= after <= SLOWNESS_MAX and math.isfinite(after)
    step = SLOWNESS_STEP**SLOWNESS_WEIGHT
    assert before / step * (1 - 1e-12) <= after <= before * step * (1 + 1e-12)  # one outlier moves it 7% at most
    # It scales every prediction on the backend alike: the order of predicted seconds is kept.
    assert shorter_s * after <= (shorter_s + longer_by_s) * after


# -- load costs --------------------------------------------------------------------------------

load_event = st.tuples(st.sampled_from(["load", "first_byte", "after_switch"]), st.sampled_from(["a", None]), durations)


@settings(max_examples=300, deadline=None)
@given(st.lists(load_event, max_size=80), durations)
def test_a_load_cost_stays_physical_and_one_outlier_moves_it_a_bounded_factor(
    events: list[tuple[str, str | None, float]], last_s: float
) -> None:
    model = ServiceTimeModel()
    for kind, name, seconds in events:
        if kind == "load":
            model.observe_load("ollama", name, seconds)
        else:
            model.observe_first_byte("ollama", name, seconds, after_switch=kind == "after_switch")
        load_s = model.load_s("ollama", name)
        assert load_s >= 0 and math.isfinite(load_s)
    before = model.load_s("ollama", "a")
    model.observe_load("ollama", "a", last_s)
    after = model.load_s("ollama", "a")
    assert after >= 0 and math.isfinite(after)
    # The first sample weighs 1/2 at most: up by at most half of LOAD_OUTLIER_FACTOR x, down by half
    assert after <= before + 0.5 * (LOAD_OUTLIER_FACTOR * max(before, FREE_LOAD_S) - before) + 1e-9
    assert after >= 0.5 * before - 1e-9


@settings(max_examples=200, deadline=None)
@given(observations, st.lists(ratios, max_size=50), st.lists(durations, max_size=10), st.integers(0, 5000))
def test_predicted_seconds_on_a_backend_keep_the_order_of_predicted_tokens(
    sequence: list[tuple[int, int, float]],
    slowness_samples: list[tuple[float, float]],
    loads: list[float],
    prompt_tokens: int,
) -> None:
    """What the ETAs add up per request: the fit times the backend's slowness, plus its load."""
    model = learned(sequence)
    backend = Backend("b", 1)
    for predicted_s, measured_s in slowness_samples:
        backend.observe_service(predicted_s, measured_s)
    for load_s in loads:
        model.observe_load("b", MODEL, load_s)
    load_s = model.load_s("b", MODEL)
    seconds = [backend.slowness * model.predict_s(MODEL, prompt_tokens, n) + load_s for n in (0, 18, 450, 4000)]
    assert seconds == sorted(seconds)


def test_a_slow_first_byte_does_not_hide_the_loads_after_it() -> None:
    """One answer whose first byte came 40 s late (a busy CPU) must not become the baseline that
    every later switch's first byte is measured against (a moving average took ~30 answers to
    forget it, and loads were learned as 0 meanwhile)."""
    model = ServiceTimeModel()
    model.observe_first_byte("swap", "a", 40.0, after_switch=False)
    for _ in range(2):
        model.observe_first_byte("swap", "a", 0.3, after_switch=False)
    assert model.observe_first_byte("swap", "a", 3.3, after_switch=True) == pytest.approx(3.0)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(-3.0, 3.0), min_size=9, max_size=9),
    st.lists(st.floats(-50.0, 50.0), min_size=3, max_size=3),
    st.sampled_from([(0.0, 0.0, 0.0), (0.0, 0.0, 0.1)]),
)
def test_the_projection_is_the_constrained_least_squares_point(
    entries: list[float], theta: list[float], lower: tuple[float, float, float]
) -> None:
    """``_project`` against scipy's bounded least squares: the point of {theta >= lower} nearest
    ``theta`` in the metric P^-1, for any positive definite P."""
    np = pytest.importorskip("numpy")
    optimize = pytest.importorskip("scipy.optimize")
    from clairvoyant.scheduling.service_time import _project

    a = np.array(entries).reshape(3, 3)
    p = a @ a.T + 0.1 * np.eye(3)  # positive definite
    projected = np.array(_project(list(theta), p.tolist(), lower))
    assert np.all(projected >= np.array(lower) - 1e-9)
    whiten = np.linalg.inv(np.linalg.cholesky(p))  # |whiten (x - theta)|^2 = (x - theta)' P^-1 (x - theta)
    best = optimize.lsq_linear(whiten, whiten @ np.array(theta), bounds=(np.array(lower), np.inf), tol=1e-12)

    def cost(x: object) -> float:
        return float(np.sum((whiten @ (np.asarray(x) - np.array(theta))) ** 2))

    assert cost(projected) <= cost(best.x) * (1 + 1e-6) + 1e-9
