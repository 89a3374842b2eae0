"""The model's trees walked in C (prediction/_forest.c, onnx_forest.py) against ONNX Runtime."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from clairvoyant.prediction import onnx_forest
from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.predictor import DEFAULT_MODEL_PATH, OnnxPredictor, _bound_runner

onnx = pytest.importorskip("onnx")
_forest = onnx_forest._forest  # built by `pip install` (setup.py, optional=True), else None
needs_walk = pytest.mark.skipif(_forest is None, reason="no C compiler at install: ONNX Runtime runs the model")

PROMPTS = [
    Prompt("hi"),
    Prompt("Write a detailed 2000-word essay on the history of the Roman Empire."),
    Prompt("List three colours."),
    Prompt("Explain, step by step and with examples, how TCP congestion control works. " * 6),
    Prompt("Translate 'good morning' into French, then summarise it in one word."),
    Prompt(""),
]


def _attributes(path: Path) -> dict[str, object]:
    (node,) = onnx.load(str(path)).graph.node
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_the_walk_is_built_where_a_compiler_is() -> None:
    # a silently skipped build would leave serving on ONNX Runtime, and every test below skipped
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: ONNX Runtime runs the model")
    assert _forest is not None
    predictor = OnnxPredictor()
    assert (predictor.runner, predictor.runner_note) == ("compiled", "compiled")


def test_the_reader_sees_the_attributes_the_onnx_package_sees() -> None:
    tables = onnx_forest.forest_tables(DEFAULT_MODEL_PATH)
    assert not isinstance(tables, str), tables
    a = _attributes(DEFAULT_MODEL_PATH)
    assert tables.n_trees == len(set(a["nodes_treeids"]))
    assert len(tables.nodes) // 16 == len(a["nodes_treeids"])
    assert tables.base == pytest.approx(a["base_values"][0], abs=0)
    records = list(struct.iter_unpack("=ifii", tables.nodes))
    leaves = sorted(v for f, v, _, _ in records if f == -1)
    assert leaves == sorted(float(np.float32(w)) for w in a["target_weights"])
    branches = sorted((f, v) for f, v, _, _ in records if f != -1)
    expected = sorted(
        (f, float(np.float32(v)))
        for f, v, m in zip(a["nodes_featureids"], a["nodes_values"], a["nodes_modes"], strict=True)
        if m == b"BRANCH_LT"
    )
    assert branches == expected
    for k, (feature, _, true_next, false_next) in enumerate(records):  # depth first: children after parents
        if feature != -1:
            assert k < true_next < false_next < len(records)


def _boundary_rows(predictor: OnnxPredictor, n: int, seed: int) -> np.ndarray:
    """Real prompts' rows with features moved onto the trees' thresholds or just below them."""
    tables = onnx_forest.forest_tables(predictor.model_path)
    assert not isinstance(tables, str)
    thresholds = onnx_forest._thresholds(tables)
    rng = np.random.default_rng(seed)
    base = np.array([predictor.feature_set.extract(p) for p in PROMPTS], dtype=np.float32)
    rows = base[rng.integers(0, len(base), n)].copy()
    for feature, values in thresholds.items():
        moved = rng.random(n) < 0.4
        picked = values[rng.integers(0, len(values), int(moved.sum()))]
        below = rng.random(len(picked)) < 0.5
        rows[moved, feature] = np.where(below, np.nextafter(picked, np.float32(-np.inf)), picked)
    return np.vstack([base, rows])


@needs_walk
def test_the_walk_gives_onnx_runtimes_float32_on_every_row() -> None:
    predictor = OnnxPredictor()
    assert predictor.runner == "compiled", predictor.runner_note
    onnx_run = _bound_runner(predictor._session, predictor._binding)
    compiled = predictor._run_bound
    row, out = predictor._row_view, predictor._out_flat
    differ = 0
    for values in _boundary_rows(predictor, 20_000, seed=11):
        row[:] = values
        onnx_run()
        expected = out[0]
        compiled()
        differ += out[0] != expected
    assert differ == 0


@needs_walk
def test_predictions_are_those_of_onnx_runtime() -> None:
    compiled = OnnxPredictor()
    reference = OnnxPredictor()
    reference._run_bound = _bound_runner(reference._session, reference._binding)
    for prompt in PROMPTS:
        for cap in (None, 5, 4000):
            assert compiled.predict(prompt, cap_tokens=cap) == reference.predict(prompt, cap_tokens=cap)


def _edited(tmp_path: Path, edit) -> Path:
    model = onnx.load(str(DEFAULT_MODEL_PATH))
    (node,) = model.graph.node
    edit(node)
    path = tmp_path / "edited.onnx"
    onnx.save(model, str(path))
    return path


def _set(node, name: str, value) -> None:
    for i, attribute in enumerate(node.attribute):
        if attribute.name == name:
            del node.attribute[i]
            break
    node.attribute.append(onnx.helper.make_attribute(name, value))


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda n: _set(n, "post_transform", "LOGISTIC"), "post_transform"),
        (lambda n: _set(n, "aggregate_function", "AVERAGE"), "aggregate_function"),
        (
            lambda n: _set(
                n,
                "nodes_modes",
                [
                    "BRANCH_LEQ" if m == b"BRANCH_LT" else m.decode()
                    for m in onnx.helper.get_attribute_value(next(a for a in n.attribute if a.name == "nodes_modes"))
                ],
            ),
            "branch modes",
        ),  # fmt: skip
        (
            lambda n: _set(
                n,
                "nodes_missing_value_tracks_true",
                [1] * len(next(a for a in n.attribute if a.name == "nodes_treeids").ints),
            ),
            "missing values",
        ),  # fmt: skip
    ],
)
@needs_walk
def test_what_the_walk_does_not_reproduce_stays_with_onnx_runtime(tmp_path: Path, edit, reason: str) -> None:
    path = _edited(tmp_path, edit)
    found = onnx_forest.forest_tables(path)
    assert isinstance(found, str) and reason in found
    predictor = OnnxPredictor()
    compiled, why = onnx_forest.compiled_forest(path, predictor._row_view, predictor._out_flat, predictor._run_bound)
    assert compiled is None and reason in why


def test_an_unreadable_file_is_a_reason_not_an_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.onnx"
    path.write_bytes(DEFAULT_MODEL_PATH.read_bytes()[:5000])
    assert isinstance(onnx_forest.forest_tables(path), str)
    path.write_bytes(b"\xff" * 64)
    assert isinstance(onnx_forest.forest_tables(path), str)


@needs_walk
def test_a_walk_that_disagrees_with_onnx_runtime_is_not_used() -> None:
    predictor = OnnxPredictor()
    out = predictor._out_flat

    def off_by_one_ulp() -> None:  # a reference whose answers the walk cannot match
        predictor._run_bound()
        out[0] = np.nextafter(out[0], np.float32(np.inf))

    before = predictor._row_view.copy()
    compiled, why = onnx_forest.compiled_forest(DEFAULT_MODEL_PATH, predictor._row_view, out, off_by_one_ulp)
    assert compiled is None and "differs from ONNX Runtime" in why
    assert np.array_equal(predictor._row_view, before)  # the check rows were written, then undone


@needs_walk
def test_the_forest_refuses_tables_that_could_walk_out_of_its_arrays() -> None:
    row = np.zeros(4, dtype=np.float32)
    out = np.zeros(1, dtype=np.float32)
    leaf = struct.pack("=ifii", -1, 1.5, 0, 0)
    good = struct.pack("=ifii", 0, 0.5, 1, 2) + leaf + leaf
    forest = _forest.Forest(good, struct.pack("=i", 0), 0.25, row, out)
    forest.run()
    assert out[0] == np.float32(1.75)
    bad_tables = [
        struct.pack("=ifii", 4, 0.5, 1, 2) + leaf + leaf,  # feature 4 of a 4-feature row
        struct.pack("=ifii", 0, 0.5, 0, 2) + leaf + leaf,  # a cycle: true next is itself
        struct.pack("=ifii", 0, 0.5, 1, 3) + leaf + leaf,  # past the last node
        good[:-1],  # not whole records
    ]
    for nodes in bad_tables:
        with pytest.raises(ValueError):
            _forest.Forest(nodes, struct.pack("=i", 0), 0.0, row, out)
    with pytest.raises(ValueError):
        _forest.Forest(good, struct.pack("=i", 3), 0.0, row, out)  # a root past the last node
    with pytest.raises(ValueError):
        _forest.Forest(good, struct.pack("=i", 0), 0.0, row.astype(np.float64), out)  # not float32
    with pytest.raises((ValueError, BufferError, TypeError)):
        _forest.Forest(good, struct.pack("=i", 0), 0.0, row, bytes(4))  # out not writable


def test_without_the_extension_onnx_runtime_runs_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onnx_forest, "_forest", None)
    fallback = OnnxPredictor()
    assert fallback.runner == "onnxruntime" and "not compiled" in fallback.runner_note
    monkeypatch.undo()
    walked = OnnxPredictor()
    for prompt in PROMPTS:
        assert fallback.predict(prompt) == walked.predict(prompt)


def test_the_start_up_line_says_what_runs_the_model_and_why_not_the_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    from clairvoyant.proxy.app import _model_runner

    assert _model_runner(object()) == "-"  # an injected predictor without a runner
    if _forest is not None:
        assert _model_runner(OnnxPredictor()) == "compiled"
    monkeypatch.setattr(onnx_forest, "_forest", None)
    assert _model_runner(OnnxPredictor()) == "onnxruntime (not compiled (no C compiler at install))"
