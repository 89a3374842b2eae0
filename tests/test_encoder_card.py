"""clairvoyant.tools.training.encoder_card: the encoder's files installed through the uint8 rewrite,
and a card that says what they are (the shipped card is what it writes for the shipped files)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from golden import GOLDEN, TOLERANCES

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from clairvoyant.prediction.encoder import DEFAULT_ENCODER_CARD, EncoderCard, EncoderModel  # noqa: E402
from clairvoyant.tools.training import encoder_card  # noqa: E402
from clairvoyant.tools.training.commands_train_encoder import merge_facts  # noqa: E402
from clairvoyant.tools.training.encoder_recipe import COMMAND, EncoderRecipe, card_facts  # noqa: E402

SHIPPED = json.loads(DEFAULT_ENCODER_CARD.read_text())


def test_the_shipped_card_is_what_train_encoder_writes_for_the_shipped_files() -> None:
    """Its sha256, its reading of a request, its weights and its recipe: all what `clairvoyant
    train-encoder`'s card step writes for the shipped files (given the prepare step's counts on
    the whole of ShareGPT and the measurements of `clairvoyant evaluate`)."""
    recipe = EncoderRecipe()
    summary = {"rows": 43151, "pass1_rows": 13420, "label_mean": 5.2637, "label_std": 1.0530,
               "components_rows": 3000, "explained_variance": 0.430}  # fmt: skip
    measured = {  # what clairvoyant evaluate measured, and how the shipped file's own run went
        "metrics": SHIPPED["metrics"],
        "knn": {k: SHIPPED["knn"][k] for k in ("fitted", "measured")},
        "training": {"shipped_run": SHIPPED["training"]["shipped_run"]},
    }
    card = encoder_card.build_card(
        blend_weight=recipe.blend_weight,
        blend_weight_with_history=recipe.blend_weight_with_history,
        max_word_pieces=recipe.max_word_pieces,
        tail_word_pieces=recipe.tail_word_pieces,
        knn_weight=recipe.knn_weight,
        command=COMMAND,
        facts=merge_facts(card_facts(recipe, summary, shipped=True), measured),
    )
    assert card == SHIPPED
    assert card["command"] == "clairvoyant train-encoder" and card["knn"]["command"].startswith(COMMAND)
    assert "74 MatMulInteger weight and zero-point initializers, all uint8" in card["export"]["matmul_weights"]
    assert "2 MatMulInteger weight and zero-point initializers, all uint8" in card["knn"]["matmul_weights"]
    markdown = (DEFAULT_ENCODER_CARD.parent / encoder_card.MARKDOWN_FILE).read_text()
    assert encoder_card.render(card) == markdown and "Made by `clairvoyant train-encoder`" in markdown
    for file, sha in ((card["onnx_file"], card["onnx_sha256"]), (card["knn"]["file"], card["knn"]["sha256"])):
        assert hashlib.sha256((DEFAULT_ENCODER_CARD.parent / file).read_bytes()).hexdigest() == sha
        assert sha in markdown


def _graph(tmp_path: Path, name: str) -> Path:
    """A one-node int8 MatMulInteger graph, as quantize_dynamic writes its weights."""
    weight = numpy_helper.from_array(np.array([[127], [-3]], dtype=np.int8), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w", "", "w_zp"], ["y"])],
        name,
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1])],
        [weight, helper.make_tensor("w_zp", TensorProto.INT8, [1], [0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return path


def test_the_command_installs_rewritten_graphs_and_their_card_and_runs_again_in_place(tmp_path: Path) -> None:
    exported, model_dir = tmp_path / "exported", tmp_path / "model"
    exported.mkdir()
    model_dir.mkdir()
    tokenizer = exported / "tokenizer.json"
    tokenizer.write_text("{}")
    facts = {"base": "a base", "training": {"data": "rows"}, "metrics": {"tau": 0.4}, "knn": {"rows": 2, "data": "d"}}
    (exported / "facts.json").write_text(json.dumps(facts))
    argv = ["--onnx", str(_graph(exported, "encoder")), "--tokenizer", str(tokenizer), "--blend-weight", "0.5",
            "--knn", str(_graph(exported, "knn")), "--knn-weight", "0.2", "--facts", str(exported / "facts.json"),
            "--model-dir", str(model_dir)]  # fmt: skip
    assert encoder_card.main(argv) == 0
    card = json.loads((model_dir / "encoder.card.json").read_text())
    for file in ("encoder.onnx", "encoder.knn.onnx"):
        weights = {t.name: t for t in onnx.load(str(model_dir / file)).graph.initializer}
        assert numpy_helper.to_array(weights["w"]).tolist() == [[255], [125]]
        assert numpy_helper.to_array(weights["w_zp"]).tolist() == [128]
    assert card["onnx_sha256"] == hashlib.sha256((model_dir / "encoder.onnx").read_bytes()).hexdigest()
    assert card["knn"]["sha256"] == hashlib.sha256((model_dir / "encoder.knn.onnx").read_bytes()).hexdigest()
    assert card["tokenizer_sha256"] == hashlib.sha256(b"{}").hexdigest()
    assert (card["base"], card["training"], card["metrics"]) == ("a base", {"data": "rows"}, {"tau": 0.4})
    assert card["blend_weight"] == card["blend_weight_with_history"] == 0.5
    assert (card["knn"]["blend_weight"], card["knn"]["rows"], card["knn"]["data"]) == (0.2, 2, "d")
    assert "all uint8" in card["export"]["matmul_weights"] and "all uint8" in card["knn"]["matmul_weights"]
    assert card["onnx_sha256"] in (model_dir / "ENCODER_CARD.md").read_text()
    # the installed files as the input (the card as the facts): nothing left to rewrite, the same card
    installed = [model_dir / name for name in ("encoder.onnx", "encoder.tokenizer.json", "encoder.knn.onnx")]
    assert encoder_card.install(*installed, model_dir=model_dir) == {"encoder.onnx": [], "encoder.knn.onnx": []}
    again = ["--onnx", str(installed[0]), "--tokenizer", str(installed[1]), "--blend-weight", "0.5",
             "--knn", str(installed[2]), "--knn-weight", "0.2", "--facts", str(model_dir / "encoder.card.json"),
             "--model-dir", str(model_dir)]  # fmt: skip
    assert encoder_card.main(again) == 0
    assert json.loads((model_dir / "encoder.card.json").read_text()) == card


def test_a_card_is_refused_for_a_graph_with_int8_matmul_weights(tmp_path: Path) -> None:
    shutil.copy(_graph(tmp_path, "int8"), tmp_path / "encoder.onnx")
    (tmp_path / "encoder.tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="not uint8 initializers"):
        encoder_card.build_card(blend_weight=0.6, model_dir=tmp_path)


def test_serving_loads_what_the_command_installs(tmp_path: Path) -> None:
    """The shipped files through the command into another folder: the card loads, and the encoder
    gives the golden opinions."""
    model_dir = DEFAULT_ENCODER_CARD.parent
    argv = ["--onnx", str(model_dir / "encoder.onnx"), "--tokenizer", str(model_dir / "encoder.tokenizer.json"),
            "--blend-weight", "0.6", "--blend-weight-with-history", "0.45", "--tail-word-pieces", "62",
            "--knn", str(model_dir / "encoder.knn.onnx"), "--knn-weight", "0.15",
            "--facts", str(DEFAULT_ENCODER_CARD), "--model-dir", str(tmp_path)]  # fmt: skip
    assert encoder_card.main(argv) == 0
    card = EncoderCard.load(tmp_path / "encoder.card.json")
    assert card.raw == SHIPPED and card.onnx.path == tmp_path / "encoder.onnx"
    encoder = EncoderModel(tmp_path / "encoder.card.json")
    for case in GOLDEN[:3]:
        value, _, knn = encoder.opinion(case["text"])
        assert value == pytest.approx(case["log_tokens"], abs=TOLERANCES.encoder)
        assert knn == pytest.approx(case["knn_log_tokens"], abs=TOLERANCES.knn)
