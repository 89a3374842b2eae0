"""`clairvoyant simulate` round trips: flags in, JSON/CSV/markdown (and PNG) files out."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np
import pytest

from clairvoyant.tools.sim import command


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return command.run(parser.parse_args(argv))


def test_run_writes_json_and_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    argv = ["run", "--n", "300", "--seeds", "2", "--rho", "0.7", "--predictor", "noisy", "--accuracy", "0.8",
            "--conditions", "fcfs", "sjf:10.5", "sjf", "--out", str(out), "--no-plots", "--no-progress"]  # fmt: skip
    assert run(argv) == 0
    data = json.loads((out / "sim_run.json").read_text())
    assert [c["name"] for c in data["conditions"]] == ["fcfs", "sjf tau=10.5", "sjf tau=inf"]
    assert data["setup"]["rho_nominal"] == pytest.approx(0.7)
    assert len(data["conditions"][0]["per_seed"]) == 2
    assert 0.7 < data["conditions"][0]["summary"]["accuracy"]["mean"] < 0.9
    with (out / "sim_run.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    p50 = {r["condition"]: float(r["mean"]) for r in rows if r["metric"] == "short.sojourn.p50"}
    expected = {c["name"]: c["summary"]["short.sojourn.p50"]["mean"] for c in data["conditions"]}
    assert p50 == pytest.approx(expected, rel=1e-5)
    with (out / "sim_run_seeds.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == 6
    printed = capsys.readouterr().out
    assert "achieved Short-vs-Long pairwise ranking accuracy" in printed and "| FCFS |" in printed


def test_tau_sweep_and_spectrum_with_plots(tmp_path: Path) -> None:
    assert (
        run(
            [
                "tau-sweep",
                "--n",
                "200",
                "--seeds",
                "2",
                "--multiples",
                "1",
                "3",
                "--out",
                str(tmp_path),
                "--no-progress",
            ]
        )
        == 0
    )
    sweep = json.loads((tmp_path / "sim_tau_sweep.json").read_text())
    assert sweep["conditions"][-1]["tau_s"] == "inf"
    assert (tmp_path / "sim_tau_sweep.png").stat().st_size > 10_000
    assert "Short P50" in (tmp_path / "sim_tau_sweep.md").read_text()
    assert (
        run(["spectrum", "--n", "200", "--seeds", "2", "--rhos", "0.3", "0.8", "--out", str(tmp_path), "--no-progress"])
        == 0
    )
    spec = json.loads((tmp_path / "sim_spectrum.json").read_text())
    assert [p["rho"] for p in spec["points"]] == [0.3, 0.8]
    assert (tmp_path / "sim_spectrum.png").stat().st_size > 10_000


def test_prompts_workload_from_the_cli(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"prompt": "hi", "output_tokens": 10, "class": "short"}\n{"prompt": "essay", "output_tokens": 800, "class": "long"}\n'
    )
    argv = ["run", "--service", "prompts", "--prompts", str(prompts), "--c0", "0.2", "--c-tok", "0.01",
            "--n", "100", "--seeds", "1", "--rate", "0.1", "--out", str(tmp_path), "--no-plots", "--no-progress"]  # fmt: skip
    assert run(argv) == 0
    data = json.loads((tmp_path / "sim_run.json").read_text())
    assert data["setup"]["mean_service_s"] == pytest.approx(0.2 + 0.01 * 405)
    text = (tmp_path / "sim_run.json").read_text() + (tmp_path / "sim_run.csv").read_text()
    assert "essay" not in text  # no prompt text in any output


def test_onnx_predictor_requires_prompts(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        run(["run", "--predictor", "onnx", "--out", str(tmp_path), "--no-progress"])


def test_run_parses_the_guard_and_gamma_of_each_condition(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["run", "--n", "200", "--seeds", "1", "--predictor", "label", "--accuracy", "0.8",
            "--conditions", "fcfs", "sjf:1+3.2", "boost:25@0.02", "hrrn", "sjf:1+2.56cv", "--out", str(out), "--no-plots", "--no-progress"]  # fmt: skip
    assert run(argv) == 0
    conds = json.loads((out / "sim_run.json").read_text())["conditions"]
    assert [(c["policy"], c["tau_s"], c["starvation_slowdown"]) for c in conds] == [
        ("fcfs", "inf", 0.0),
        ("sjf", 1.0, 3.2),
        ("boost", 25.0, 0.0),
        ("hrrn", "inf", 0.0),
        ("sjf", 1.0, 2.56),
    ]
    assert conds[2]["boost_gamma_per_s"] == 0.02
    assert [c["adaptive_slowdown"] for c in conds] == [False, False, False, False, True]


def test_compare_reports_every_policy_and_both_tenants(tmp_path: Path) -> None:
    argv = [
        "compare",
        "--n",
        "200",
        "--seeds",
        "1",
        "--workloads",
        "paper",
        "tenants",
        "--out",
        str(tmp_path),
        "--no-progress",
    ]
    assert run(argv) == 0
    data = json.loads((tmp_path / "sim_compare.json").read_text())
    names = [r["name"] for r in data["blocks"][0]["results"]]
    assert names[0] == "fcfs" and any(n.startswith("default") for n in names)
    assert {r["policy"] for r in data["blocks"][0]["results"]} == {"fcfs", "sjf", "boost", "hrrn"}
    tenants = data["blocks"][-1]
    assert tenants["workload"] == "tenants" and "alone" in tenants
    fair = next(r for r in tenants["results"] if r["name"] == "fcfs +fair")["summary"]
    unfair = next(r for r in tenants["results"] if r["name"] == "fcfs (no fair share)")["summary"]
    # Fair share by predicted seconds: the interactive tenant no longer waits behind the batch.
    assert fair["tenant1.wait.p95"]["mean"] < unfair["tenant1.wait.p95"]["mean"] / 5
    text = (tmp_path / "sim_compare.md").read_text()
    assert "interactive P95 wait" in text and "Short P50 vs FCFS" in text


def test_compare_reports_swaps_and_deadlines_for_the_four_conditions(tmp_path: Path) -> None:
    argv = ["compare", "--n", "200", "--seeds", "1", "--workloads", "models", "deadlines", "--switch-s", "4",
            "--out", str(tmp_path), "--no-progress"]  # fmt: skip
    assert run(argv) == 0
    data = json.loads((tmp_path / "sim_compare.json").read_text())
    assert [(b["workload"], b["predictor"]) for b in data["blocks"]] == [
        ("models", "label"), ("models", "oracle"), ("deadlines", "label"), ("deadlines", "oracle"),
    ]  # fmt: skip
    names = [r["name"] for r in data["blocks"][0]["results"]]
    assert names[:3] == ["fcfs", "sjf tau=10.5 (paper)", "default, no model affinity"]
    assert names[3].startswith("default") and data["blocks"][0]["results"][3]["model_switch_bound_s"] > 0
    assert data["blocks"][0]["setup"]["switch_s"] == 4.0
    assert all("switches" in r["summary"] for b in data["blocks"] for r in b["results"])
    assert all("deadline.met" in r["summary"] for r in data["blocks"][2]["results"])
    text = (tmp_path / "sim_compare.md").read_text()
    assert "| condition | swaps | Short P50 | Short P95 | all P99 | mean | deadlines met |" in text


def test_run_takes_models_a_switch_cost_deadlines_and_a_switch_bound(tmp_path: Path) -> None:
    argv = ["run", "--n", "200", "--seeds", "1", "--rho", "0.6", "--models", "2", "--switch-s", "5",
            "--max-wait", "10,60", "--conditions", "fcfs", "sjf:1+2.56cv/30", "--out", str(tmp_path),
            "--no-plots", "--no-progress"]  # fmt: skip
    assert run(argv) == 0
    data = json.loads((tmp_path / "sim_run.json").read_text())
    assert [c["model_switch_bound_s"] for c in data["conditions"]] == [0.0, 30.0]
    assert data["setup"]["models"] == 2 and data["setup"]["max_wait_s"] == [10.0, 60.0]
    fcfs, grouped = (c["summary"] for c in data["conditions"])
    assert grouped["switches"]["mean"] < fcfs["switches"]["mean"]
    assert 0 < fcfs["deadline.met"]["mean"] <= 1


def test_swaps_compares_three_conditions_on_every_case_and_the_best_order(tmp_path: Path) -> None:
    argv = ["swaps", "--n", "60", "--burst-n", "8", "--small-n", "4", "--seeds", "1", "--small-cases", "2",
            "--models", "2", "--switch-s", "2", "--out", str(tmp_path), "--no-progress"]  # fmt: skip
    assert run(argv) == 0
    data = json.loads((tmp_path / "sim_swaps.json").read_text())
    cases = [(c["workload"], c["predictor"]) for c in data["cases"]]
    assert cases == [("burst", "oracle"), ("poisson", "oracle"), ("burst", "label"), ("poisson", "label"),
                     ("small burst", "oracle"), ("small poisson", "oracle")]  # fmt: skip
    for case in data["cases"]:
        rules = [(c["name"], c["model_switch_rule"]) for c in case["conditions"]]
        assert rules == [("fcfs", "weighed"), ("default, rule before weighing", "bound"), ("default", "weighed")]
        for c in case["conditions"][1:]:
            assert c["put_off_past_bound_max_s"] <= 1e-9  # the bound holds under both rules
        if case["workload"].startswith("small"):  # no order beats the best one
            assert all(c["summary"]["vs_best"]["mean"] >= 1.0 - 1e-9 for c in case["conditions"])
    assert data["setup"]["switch_s"] == 2.0
    with pytest.raises(SystemExit):
        run(["swaps", "--small-n", "10", "--out", str(tmp_path), "--no-progress"])  # every order of 10: too many


def test_onnx_predictor_orders_by_expected_tokens_with_a_spread(tmp_path: Path) -> None:
    from clairvoyant.tools.sim.predictors import LogSpread

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"prompt": "What is 2+2?", "output_tokens": 5, "class": "short"}\n'
        '{"prompt": "Write a detailed 2000-word essay on the history of rivers, with sections.", '
        '"output_tokens": 900, "class": "long"}\n'
    )
    width = 2 + 49  # [m, m^2, the shipped model's 49 count features]
    weights = [-10.0] + [0.0] * (width - 1)  # v = 100 - 10 m: m + v/2 = 50 - 4 m, the order reversed
    spread = LogSpread(*(np.array(a, dtype=float) for a in ([0.0] * width, [1.0] * width, weights)), 100.0)
    spread_file = tmp_path / "spread.json"
    spread_file.write_text(json.dumps(spread.as_dict()))
    accuracy = {}
    for name, extra in (("median", []), ("expected", ["--spread", str(spread_file)])):
        argv = ["run", "--service", "prompts", "--prompts", str(prompts), "--predictor", "onnx", "--n", "60",
                "--seeds", "1", "--rate", "0.05", "--conditions", "sjf", "--out", str(tmp_path / name),
                "--no-plots", "--no-progress", *extra]  # fmt: skip
        assert run(argv) == 0
        data = json.loads((tmp_path / name / "sim_run.json").read_text())
        accuracy[name] = data["conditions"][0]["summary"]["accuracy"]["mean"]
    assert accuracy == {"median": 1.0, "expected": 0.0}
    spread_file.write_text('{"mean": [0.0]}')
    with pytest.raises(SystemExit, match="--spread"):
        run([*argv[:-2], "--spread", str(spread_file)])
