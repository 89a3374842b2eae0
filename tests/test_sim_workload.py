"""Workloads of the simulator (clairvoyant.tools.sim.workload): arrivals, service models, replay files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clairvoyant.tools.sim import LognormalService, NormalService, ReplayService, make_workload, paper_service
from clairvoyant.tools.sim.workload import load_replay, rate_for_rho


def test_poisson_rate_and_rho() -> None:
    w = make_workload(0, 20000, paper_service(), rate_per_s=0.12)
    assert 1 / np.diff(w.arrival_s).mean() == pytest.approx(0.12, rel=0.03)
    assert rate_for_rho(0.744, 6.2) == pytest.approx(0.12)
    w2 = make_workload(0, 20000, paper_service(), rho=0.5)
    assert 1 / np.diff(w2.arrival_s).mean() == pytest.approx(0.5 / 6.2, rel=0.03)
    with pytest.raises(ValueError):
        make_workload(0, 10, paper_service(), rate_per_s=0.1, rho=0.5)


def test_burst_arrives_at_zero() -> None:
    w = make_workload(0, 50, paper_service(), arrivals="burst")
    assert np.all(w.arrival_s == 0.0) and len(w) == 50


def test_paper_normal_service_moments_and_floor() -> None:
    w = make_workload(0, 40000, paper_service(), rate_per_s=0.12)
    short, long_ = w.service_s[w.class_idx == 0], w.service_s[w.class_idx == 2]
    assert short.mean() == pytest.approx(3.5, abs=0.03) and short.std() == pytest.approx(0.8, abs=0.03)
    assert long_.mean() == pytest.approx(8.9, abs=0.05) and long_.std() == pytest.approx(2.0, abs=0.05)
    assert (w.class_idx == 0).mean() == pytest.approx(0.5, abs=0.01)
    # a wide normal hits the floor, and the floor is accounted for in E[S]
    wide = NormalService({"short": (0.5, 1.0)}, {"short": 1.0}, floor_s=0.2)
    ww = make_workload(0, 40000, wide, rate_per_s=0.1)
    assert ww.service_s.min() == 0.2
    assert wide.mean_service_s() == pytest.approx(ww.service_s.mean(), rel=0.02)
    assert wide.mean_service_s() > 0.5


def test_lognormal_matches_its_mean_and_std() -> None:
    svc = LognormalService({"short": (3.5, 0.8), "long": (8.9, 4.0)}, {"short": 0.3, "long": 0.7})
    w = make_workload(1, 40000, svc, rate_per_s=0.1)
    long_ = w.service_s[w.class_idx == 2]
    assert long_.mean() == pytest.approx(8.9, rel=0.03) and long_.std() == pytest.approx(4.0, rel=0.06)
    assert svc.mean_service_s() == pytest.approx(0.3 * 3.5 + 0.7 * 8.9)


def test_replay_files(tmp_path: Path) -> None:
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("class,service_s\nshort,1.0\nshort,2.0\nlong,10.0\n")
    json_path = tmp_path / "t.json"
    json_path.write_text(json.dumps({"short": [1.0, 2.0], "long": [10.0]}))
    for path in (csv_path, json_path):
        samples = load_replay(path)
        assert sorted(samples["short"].tolist()) == [1.0, 2.0] and samples["long"].tolist() == [10.0]
    svc = ReplayService(load_replay(csv_path))
    w = make_workload(0, 3000, svc, rate_per_s=0.1)
    assert set(w.service_s[w.class_idx == 0].tolist()) == {1.0, 2.0}
    assert set(w.service_s[w.class_idx == 2].tolist()) == {10.0}
    assert (w.class_idx == 0).mean() == pytest.approx(2 / 3, abs=0.03)  # measured proportions
    assert svc.mean_service_s() == pytest.approx(2 / 3 * 1.5 + 1 / 3 * 10.0)
    bad = tmp_path / "bad.csv"
    bad.write_text("class,service_s\nshort,-1\n")
    with pytest.raises(ValueError):
        load_replay(bad)


def test_two_tenant_workload_floods_then_interacts() -> None:
    from clairvoyant.tools.sim.workload import two_tenant_workload

    w = two_tenant_workload(3, 400, paper_service(), interactive_rho=0.3)
    assert w.tenant is not None and (w.tenant == 0).sum() == 200 and (w.tenant == 1).sum() == 200
    assert np.all(w.arrival_s[w.tenant == 0] == 0.0)  # the flood is one batch at t = 0
    assert np.all(np.diff(w.arrival_s) >= 0)
    alone = two_tenant_workload(3, 400, paper_service(), interactive_rho=0.3, only=1)
    assert len(alone) == 200 and np.array_equal(alone.arrival_s, w.arrival_s[w.tenant == 1])
    assert np.array_equal(alone.service_s, w.service_s[w.tenant == 1])  # the same draws
