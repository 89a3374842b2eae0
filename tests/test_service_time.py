"""The online service-time model and gamma's fixed-point rule."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from clairvoyant.scheduling.boost import BoostTable, bucket_for, solve_gamma
from clairvoyant.scheduling.service_time import ServiceTimeDefaults, ServiceTimeModel


def test_defaults_hold_until_there_is_data() -> None:
    model = ServiceTimeModel()
    assert model.predict_s(None, 0, 0) == pytest.approx(0.3)
    assert model.predict_s("m", 1000, 100) == pytest.approx(0.3 + 0.5 + 2.0)
    assert model.predict_s("m", 0, -5) == pytest.approx(0.3)  # negative counts are floored


def test_rls_recovers_a_backend_from_noisy_observations() -> None:
    rng = random.Random(0)
    model = ServiceTimeModel()
    for _ in range(400):  # a faster backend than the defaults: 0.1 s + 0.2 ms/prompt token + 8 ms/token
        p, d = rng.randint(10, 3000), rng.randint(1, 800)
        model.observe("fast", p, d, 0.1 + 0.0002 * p + 0.008 * d + rng.gauss(0, 0.02))
    c = model.coefficients("fast")
    assert c["c0_s"] == pytest.approx(0.1, abs=0.05)
    assert c["c_prompt_s"] == pytest.approx(0.0002, abs=0.00005)
    assert c["c_decode_s"] == pytest.approx(0.008, abs=0.0005)
    assert model.predict_s("fast", 500, 300) == pytest.approx(0.1 + 0.1 + 2.4, rel=0.05)
    # Another model is untouched: still the defaults.
    assert model.predict_s("other", 0, 100) == pytest.approx(0.3 + 2.0)


def test_bad_durations_are_ignored() -> None:
    model = ServiceTimeModel()
    for bad in (0.0, -1.0, math.nan, math.inf):
        model.observe("m", 10, 10, bad)
    assert model.coefficients("m")["observations"] == 0


def test_state_round_trips_atomically(tmp_path: Path) -> None:
    path = tmp_path / "state" / "service_time.json"
    model = ServiceTimeModel(path=path)
    for d in range(1, 50):
        model.observe("m", 100, d, 0.2 + 0.01 * d)
    model.save()
    assert not list(path.parent.glob("*.tmp"))  # the temporary file was renamed into place
    again = ServiceTimeModel(path=path)
    assert again.load()
    assert again.predict_s("m", 100, 300) == pytest.approx(model.predict_s("m", 100, 300))
    path.write_text("{not json")
    fresh = ServiceTimeModel(path=path, defaults=ServiceTimeDefaults(c0_s=1.0))
    assert not fresh.load()  # a corrupt file is ignored: defaults
    assert fresh.predict_s("m", 0, 0) == pytest.approx(1.0)
    assert json.loads(json.dumps(model.coefficients("m")))["observations"] == 49


def test_boost_formula_and_buckets() -> None:
    # b_gamma(S) = -log1p(-exp(-gamma S)) / gamma while a bucket has no measurements
    table = BoostTable(0.1, max_boost_s=1e9)
    assert table.boost(0, 1.0) == pytest.approx(-math.log1p(-math.exp(-0.1)) / 0.1, rel=1e-9)
    assert table.boost(0, 1.0) > table.boost(0, 10.0) > table.boost(0, 100.0) > 0
    assert bucket_for(0.1) == 0 and bucket_for(0.3) == 1
    assert bucket_for(3.5) != bucket_for(8.9)
    assert bucket_for(1e9) == 31


def test_fixed_point_gamma() -> None:
    # Paper 5.5: lambda = 0.12/s, half 3.5 s, half 8.9 s: root of g = 0.12 (mean(exp(g S)) - 1).
    services = [3.5, 8.9] * 100
    g = solve_gamma(0.12, services)
    assert g is not None
    assert g == pytest.approx(0.12 * (sum(math.exp(g * s) for s in services) / len(services) - 1), rel=1e-6)
    assert 0.06 < g < 0.09
    assert solve_gamma(0.2, services) is None  # rho = 1.24: no root


def test_auto_gamma_follows_the_traffic() -> None:
    table = BoostTable(0.5, auto_gamma=True, max_boost_s=1e9)
    t = 0.0
    for i in range(200):
        t += 1 / 0.12
        table.note_arrival(t)
        table.observe(bucket_for(3.5 if i % 2 else 8.9), 3.5 if i % 2 else 8.9)
    assert 0.06 < table.gamma_per_s < 0.09
    assert table.describe()["auto_gamma"] is True


def test_adaptive_slowdown_follows_the_spread_of_service_times() -> None:
    from clairvoyant.scheduling.slowdown import AdaptiveSlowdown

    rule = AdaptiveSlowdown(2.0, window=100, min_samples=20)
    assert rule.value() == pytest.approx(2.0 * 1.25)  # the prior CV^2 = 0.25 until 20 samples
    for _ in range(100):
        rule.observe(5.0)  # no spread at all
    assert rule.cv2() == pytest.approx(0.0, abs=1e-9) and rule.value() == pytest.approx(2.0)
    for s in (1.0, 9.0) * 50:  # mean 5, std 4: CV^2 = 0.64, and the window forgot the 5.0s
        rule.observe(s)
    assert rule.cv2() == pytest.approx(0.64) and rule.value() == pytest.approx(2.0 * 1.64)
    rule.observe(-1.0)
    rule.observe(math.nan)
    assert rule.cv2() == pytest.approx(0.64)


def test_identical_requests_do_not_wind_the_fit_up() -> None:
    # Forgetting with inputs that never vary used to grow the covariance without bound: the
    # estimate diverged after ~20,000 identical requests and became NaN after ~100,000.
    model = ServiceTimeModel()
    for _ in range(150_000):
        model.observe("m", 12, 1, 0.001)
    predicted = model.predict_s("m", 12, 1)
    assert math.isfinite(predicted) and predicted == pytest.approx(0.01, abs=1e-9)  # the 10 ms floor
    assert all(math.isfinite(v) for v in model.coefficients("m").values())
    model.observe("m", 500, 300, 6.5)  # and it still learns from a different request
    assert math.isfinite(model.predict_s("m", 500, 300))


def test_a_load_cost_starts_at_the_prior_and_follows_measured_loads() -> None:
    model = ServiceTimeModel(defaults=ServiceTimeDefaults(load_s=5.0))
    assert model.load_s("ollama", "a") == 5.0
    model.observe_load("ollama", "a", 3.0)  # the prior counts as one observation
    assert model.load_s("ollama", "a") == pytest.approx(4.0)
    for _ in range(30):
        model.observe_load("ollama", "a", 3.0)
    assert model.load_s("ollama", "a") == pytest.approx(3.0, abs=0.01)
    # Per (backend, model): another backend, and another model, are untouched.
    assert model.load_s("other", "a") == 5.0 and model.load_s("ollama", "b") == 5.0
    for bad in (-1.0, math.nan, math.inf):
        model.observe_load("ollama", "b", bad)
    assert "b" not in model.loads()["ollama"]
    # Loads that cost nothing (both models fit) bring the cost down to nothing within a few switches.
    for _ in range(12):
        model.observe_load("ollama", "free", 0.02)
    assert model.load_s("ollama", "free") < 0.25


def test_the_first_byte_after_a_switch_teaches_its_excess_over_the_baseline() -> None:
    model = ServiceTimeModel(defaults=ServiceTimeDefaults(load_s=5.0))
    # Before any baseline, the whole delay counts as load.
    assert model.observe_first_byte("swap", "a", 9.0, after_switch=True) == pytest.approx(9.0)
    for _ in range(50):
        assert model.observe_first_byte("swap", "a", 0.4, after_switch=False) is None
    assert model.observe_first_byte("swap", "a", 12.4, after_switch=True) == pytest.approx(12.0, abs=0.01)
    assert model.loads()["swap"]["a"]["observations"] == 2.0
    # A switch that cost nothing (a server that serves every name with one model): no load.
    assert model.observe_first_byte("swap", "a", 0.3, after_switch=True) == 0.0
    # A model with no baseline of its own yet is measured against the backend's other models'.
    assert model.observe_first_byte("swap", "b", 8.4, after_switch=True) == pytest.approx(8.0, abs=0.01)


def test_load_costs_are_kept_across_restarts(tmp_path: Path) -> None:
    path = tmp_path / "service_time.json"
    model = ServiceTimeModel(path=path)
    model.observe_load("ollama", "a", 2.0)
    model.observe_first_byte("ollama", None, 0.5, after_switch=False)
    model.save()
    again = ServiceTimeModel(path=path)
    assert again.load()
    assert again.load_s("ollama", "a") == model.load_s("ollama", "a")
    assert again.snapshot() == model.snapshot()
    # A file written before load costs were learned still loads (with none).
    state = json.loads(path.read_text())
    del state["loads"]
    path.write_text(json.dumps(state))
    older = ServiceTimeModel(path=path)
    assert older.load() and older.loads() == {}
