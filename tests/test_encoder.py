"""The encoder's second opinion (clairvoyant.prediction.encoder): the shipped files, the card checks,
the blend into a prediction, and the background refiner, all on the real ONNX encoder."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from golden import GOLDEN, TOLERANCES, order
from polling import until

from clairvoyant.errors import ModelError
from clairvoyant.prediction.dialects import SCHEDULED_ENDPOINTS, prompt_from_body
from clairvoyant.prediction.encoder import (
    DEFAULT_ENCODER_CARD,
    IN_TIME_FLOOR,
    LEARNING_MAX_PENDING,
    EncoderModel,
    Refiner,
    encoder_for,
    refined_by,
)
from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.predictor import SESSION_PROVIDERS, BlendWeights, OnnxPredictor

_SHIPPED_KNN: dict[str, Any] = json.loads(DEFAULT_ENCODER_CARD.read_text())["knn"]
ESSAY = "Write a detailed 2000-word essay on the causes and consequences of the fall of the Roman Empire."
SHORT = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def encoder() -> EncoderModel:
    return EncoderModel()


@pytest.fixture(scope="module")
def predictor() -> OnnxPredictor:
    return OnnxPredictor()


def _copy_card(tmp_path: Path, **changes: Any) -> Path:
    card = json.loads(DEFAULT_ENCODER_CARD.read_text())
    files = [card[key] for key in ("onnx_file", "tokenizer_file")] + ([card["knn"]["file"]] if "knn" in card else [])
    for name in files:
        if not (tmp_path / name).exists():  # the kNN graph is 17 MB: a link would do, a copy is safer
            shutil.copy(DEFAULT_ENCODER_CARD.parent / name, tmp_path / name)
    card.update(changes)
    card = {k: v for k, v in card.items() if v is not None}  # None: leave the field out
    path = tmp_path / "encoder.card.json"
    path.write_text(json.dumps(card))
    return path


def test_the_shipped_encoder_orders_an_essay_after_a_one_word_answer(encoder: EncoderModel) -> None:
    essay, short = encoder.log_tokens(ESSAY), encoder.log_tokens(SHORT)
    assert essay > short + 1.0  # e-fold apart at least, in tokens
    assert 0.0 < math.exp(short) < math.exp(essay) < 5000
    many = encoder.opinions_many([ESSAY, SHORT, ESSAY])[0]
    assert many.tolist() == [essay, short, essay]  # one at a time: the served values exactly


def test_the_shipped_files_give_the_golden_opinions_within_tolerance_and_in_order(
    encoder: EncoderModel, predictor: OnnxPredictor
) -> None:
    """The lexical prior, the encoder's, the kNN's and the learner's columns, and the refined prior
    the queue is keyed on: each within its stated tolerance (tests/golden.py: another CPU's kernels
    round differently), and the golden prompts in the golden order by each ranking that holds."""
    assert len(GOLDEN) >= 16
    tol = TOLERANCES
    got: dict[str, list[float]] = {"lexical_log_tokens": [], "knn_log_tokens": [], "refined_log_tokens": []}
    for case in GOLDEN:
        lexical = predictor.predict(Prompt(case["text"]))
        value, columns, knn = encoder.opinion(case["text"])
        assert knn is not None
        refined = refined_by(encoder, predictor, lexical, case["text"]).prior_log_tokens
        label = case["text"][:60]
        assert lexical.prior_log_tokens == pytest.approx(case["lexical_log_tokens"], abs=tol.lexical), label
        assert value == pytest.approx(case["log_tokens"], abs=tol.encoder), label
        assert knn == pytest.approx(case["knn_log_tokens"], abs=tol.knn), label
        assert refined == pytest.approx(case["refined_log_tokens"], abs=tol.refined), label
        np.testing.assert_allclose(np.frombuffer(columns, dtype=np.float32), case["columns"], rtol=0, atol=tol.column)
        for name, v in zip(got, (lexical.prior_log_tokens, knn, refined)):
            got[name].append(v)
    assert "refined_log_tokens" in tol.ordered  # the queue's order, everywhere
    for name in tol.ordered:
        assert order(got[name]) == order([case[name] for case in GOLDEN]), name


def test_the_serving_sessions_pin_every_option_that_can_change_a_result(
    encoder: EncoderModel, predictor: OnnxPredictor
) -> None:
    """One thread, sequential, every graph optimisation (with the basic ones only, the encoder
    moves by up to 0.035 ln tokens and the kNN by 0.054: benchmarks/bench_cpu_drift.py),
    deterministic compute, denormals kept, and the CPU provider alone, for the lexical predictor,
    the encoder and its kNN."""
    import onnxruntime as ort

    for session in (predictor._bound.session, encoder._session, encoder._knn):
        options = session.get_session_options()
        assert (options.intra_op_num_threads, options.inter_op_num_threads) == (1, 1)
        assert options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
        assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        assert options.use_deterministic_compute
        assert options.get_session_config_entry("session.set_denormal_as_zero") == "0"
        assert session.get_providers() == ["CPUExecutionProvider"] == list(SESSION_PROVIDERS)


@pytest.mark.parametrize(("file", "nodes"), [("encoder.onnx", 37), ("encoder.knn.onnx", 1)])
def test_the_shipped_graphs_hold_no_int8_weight_feeding_matmul_integer(file: str, nodes: int) -> None:
    """onnxruntime's u8 x s8 kernel saturates on AVX2 CPUs without VNNI; its u8 x u8 kernel is exact
    everywhere: every MatMulInteger weight and weight zero point is a uint8 initializer."""
    onnx = pytest.importorskip("onnx")
    model = onnx.load(str(DEFAULT_ENCODER_CARD.parent / file))
    types = {t.name: t.data_type for t in model.graph.initializer}
    declared = {v.name for v in (*model.graph.input, *model.graph.output, *model.graph.value_info)}
    matmuls = [n for n in model.graph.node if n.op_type == "MatMulInteger"]
    assert len(matmuls) == nodes
    for node in matmuls:
        weight, zero_point = node.input[1], node.input[3]
        assert weight not in declared and zero_point not in declared, node.name
        assert types[weight] == types[zero_point] == onnx.TensorProto.UINT8, node.name
    assert onnx.TensorProto.INT8 not in {types.get(i) for n in matmuls for i in n.input}


def test_the_encoder_reads_only_its_word_pieces(encoder: EncoderModel) -> None:
    tail = " Then list every emperor with a one-page biography each." * 200
    clipped = encoder.clip(ESSAY + tail)
    assert len(clipped) <= 2 * encoder.card.max_word_pieces * 8 + 1 and encoder.clip(clipped) == clipped
    assert encoder.log_tokens(ESSAY + tail) == encoder.log_tokens(clipped)
    assert len(encoder.word_pieces(ESSAY + tail)) == encoder.card.max_word_pieces
    assert math.isfinite(encoder.log_tokens("\x00\ud83d lone surrogate"))  # JSON allows it; the tokenizer does not
    assert math.isfinite(encoder.log_tokens(""))


def test_a_long_instruction_is_read_by_its_head_and_its_tail(tmp_path: Path, encoder: EncoderModel) -> None:
    """The shipped card reads a long instruction's first and last word pieces: the request that
    ends a long pasted text counts; the middle does not. A card without tail_word_pieces (before)
    reads the first pieces only."""
    card = encoder.card
    assert card.tail_word_pieces > 0
    head_pieces = card.max_word_pieces - 2 - card.tail_word_pieces
    pasted = "The quarterly report lists revenue, costs and the staff of each office in detail. " * 60
    ask_short = " Answer yes or no: is the report about finance?"
    ask_long = " Rewrite the whole report as a detailed essay of at least 2000 words."
    short, long = encoder.word_pieces(pasted + ask_short), encoder.word_pieces(pasted + ask_long)
    cls, sep = short[0], short[-1]
    whole = encoder.tokenizer.encode(pasted + ask_long).ids
    assert long == whole[: 1 + head_pieces] + whole[-1 - card.tail_word_pieces :] and long[-1] == sep
    assert encoder.log_tokens(pasted + ask_long) > encoder.log_tokens(pasted + ask_short)  # the tail is read
    other_middle = pasted[:1000] + "Lorem ipsum dolor sit amet. " * 40 + pasted[-1000:] + ask_long
    assert encoder.word_pieces(other_middle) == long and cls == long[0]  # the middle is not
    huge = pasted * 20 + ask_long  # beyond the clip: the same head and tail pieces
    assert encoder.word_pieces(huge) == long
    first_only = EncoderModel(_copy_card(tmp_path, tail_word_pieces=None))
    assert first_only.card.tail_word_pieces == 0
    assert first_only.word_pieces(pasted + ask_long) == whole[: card.max_word_pieces - 1] + [sep]
    assert first_only.log_tokens(pasted + ask_long) == first_only.log_tokens(pasted + ask_short)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"onnx_sha256": "0" * 64}, "does not match the sha256"),
        ({"blend_weight": 1.5}, "is not in \\[0, 1\\]"),
        ({"blend_weight_with_history": -0.1}, "blend_weight_with_history -0.1 is not in \\[0, 1\\]"),
        ({"max_word_pieces": 2}, "below 8"),
        ({"tail_word_pieces": 121}, "tail_word_pieces 121 is not in"),
        ({"onnx_file": "missing.onnx"}, "not found"),
        ({"knn": {**_SHIPPED_KNN, "sha256": "0" * 64}}, "encoder.knn.onnx does not match the sha256"),
        ({"knn": {**_SHIPPED_KNN, "file": "missing.knn.onnx"}}, "missing.knn.onnx not found"),
        ({"knn": {**_SHIPPED_KNN, "blend_weight": 1.2}}, "knn_weight 1.2 is not in \\[0, 1\\]"),
        ({"knn": {"file": "encoder.knn.onnx"}}, "unreadable"),
    ],
)
def test_a_bad_card_is_refused(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelError, match=message):
        EncoderModel(_copy_card(tmp_path, **changes))


def test_a_missing_card_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not found"):
        EncoderModel(tmp_path / "encoder.card.json")


class _ConstantCorrector:
    def __init__(self, log_tokens: float) -> None:
        self.log_tokens = log_tokens
        self.priors: list[float] = []

    def correction(self, model: str | None, row: np.ndarray, prior_log_tokens: float) -> float:
        self.priors.append(prior_log_tokens)
        return self.log_tokens


def test_refined_blends_in_log_tokens_then_corrects_then_caps(predictor: OnnxPredictor) -> None:
    lexical = predictor.predict(Prompt(SHORT), model="m")
    prior = lexical.prior_log_tokens
    same = predictor.refined(lexical, 7.0, BlendWeights(0.0, 0.0))
    assert same.predicted_tokens == pytest.approx(lexical.predicted_tokens)
    assert same.prior_log_tokens == prior
    whole = predictor.refined(lexical, 7.0, BlendWeights(1.0, 1.0))
    assert whole.predicted_tokens == pytest.approx(math.exp(7.0))
    half = predictor.refined(lexical, 7.0, BlendWeights(0.5, 0.5))
    assert half.prior_log_tokens == pytest.approx(prior + 0.5 * (7.0 - prior))
    assert half.score > lexical.score  # a longer answer: a later key
    assert half.feature_row == lexical.feature_row and half.model == "m"  # the learner still sees its row
    capped = predictor.refined(predictor.predict(Prompt(SHORT), cap_tokens=20), 7.0, BlendWeights(1.0, 1.0))
    assert capped.predicted_tokens == 20.0 and capped.cap_tokens == 20
    corrector = _ConstantCorrector(math.log(2.0))
    learned = OnnxPredictor(predictor.model_path, corrector=corrector)
    corrected = learned.refined(lexical, 7.0, BlendWeights(0.5, 0.5))
    assert corrector.priors[-1] == pytest.approx(half.prior_log_tokens)  # the correction sees the refined prior
    assert corrected.predicted_tokens == pytest.approx(2.0 * half.predicted_tokens)


def test_a_rowless_prediction_is_refined_from_the_row_it_is_given(predictor: OnnxPredictor) -> None:
    """A queued request waits without its feature row (proxy/app.py): refined with the row the
    encoder's queue kept, it gets the same key, prior and correction as with its own row. The
    bare row is the one predict gives (the learner re-derives it after completion)."""
    later = _chat(("user", ESSAY), ("assistant", "Rome fell slowly."), ("user", SHORT))
    corrector = _ConstantCorrector(math.log(2.0))
    learned = OnnxPredictor(predictor.model_path, corrector=corrector)
    weights = BlendWeights(first=0.8, later=0.2)  # the weight reads history_chars from the row
    for prompt in (Prompt(SHORT), later):
        full = learned.predict(prompt, model="m")
        assert learned.feature_row(prompt) == full.feature_row
        rowless = replace(full, feature_row=b"")
        components = np.arange(4, dtype=np.float32).tobytes()
        expected = learned.refined(full, 7.0, weights, components)
        got = learned.refined(rowless, 7.0, weights, components, row=full.feature_row)
        assert got == expected and got.feature_row == full.feature_row + components
        without = learned.refined(rowless, 7.0, weights, components)  # no row: no history, no lexical columns
        assert without.feature_row == components
        if prompt is later:
            assert without.prior_log_tokens != expected.prior_log_tokens  # the first turn's weight instead


CHAT = SCHEDULED_ENDPOINTS["/v1/chat/completions"]


def _chat(*messages: tuple[str, str]) -> Prompt:
    return prompt_from_body(CHAT, {"messages": [{"role": r, "content": c} for r, c in messages]})


def test_refined_weighs_the_encoder_by_whether_the_request_has_history(predictor: OnnxPredictor) -> None:
    weights = BlendWeights(first=0.8, later=0.2)
    single = _chat(("user", SHORT))
    with_system = _chat(("system", "You are a helpful assistant."), ("user", SHORT))
    later = _chat(("user", ESSAY), ("assistant", "Rome fell slowly."), ("user", SHORT))
    completion = prompt_from_body(SCHEDULED_ENDPOINTS["/v1/completions"], {"prompt": SHORT})
    for prompt, w in ((single, 0.8), (with_system, 0.8), (completion, 0.8), (later, 0.2)):
        lexical = predictor.predict(prompt)
        assert predictor.history_chars(lexical.feature_row) == (
            len("Rome fell slowly.") + len(ESSAY) if w == 0.2 else 0.0
        )
        refined = predictor.refined(lexical, 7.0, weights)
        prior = lexical.prior_log_tokens
        assert refined.prior_log_tokens == pytest.approx(prior + w * (7.0 - prior)), prompt
        # a float is one weight for every request
        assert predictor.refined(lexical, 7.0, BlendWeights(0.5, 0.5)).prior_log_tokens == pytest.approx(
            prior + 0.5 * (7.0 - prior)
        )
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        BlendWeights(0.5, 1.2)


def test_the_encoders_card_gives_the_weights_by_turn_and_refined_by_uses_them(
    tmp_path: Path, predictor: OnnxPredictor
) -> None:
    # cards from before the kNN (its own test: test_refined_by_uses_the_cards_knn_...)
    old = EncoderModel(_copy_card(tmp_path, blend_weight=0.7, blend_weight_with_history=None, knn=None))
    assert old.blend_weights == BlendWeights(0.7, 0.7)  # a card from before: one weight for every turn
    turn_aware = EncoderModel(_copy_card(tmp_path, blend_weight=0.7, blend_weight_with_history=0.1, knn=None))
    assert turn_aware.blend_weights == BlendWeights(0.7, 0.1)
    later = _chat(("user", ESSAY), ("assistant", "Rome fell slowly."), ("user", SHORT))
    lexical = predictor.predict(later)
    encoder_ln = turn_aware.log_tokens(later.instruction)
    refined = refined_by(turn_aware, predictor, lexical, later.instruction)
    prior = lexical.prior_log_tokens
    assert refined.prior_log_tokens == pytest.approx(prior + 0.1 * (encoder_ln - prior))

    class _NoHistoryColumn:  # a regressor whose feature set cannot tell turns apart
        output = predictor.output
        history_column = None

    with pytest.raises(ModelError, match="history_chars"):
        encoder_for(_NoHistoryColumn(), _copy_card(tmp_path, blend_weight=0.7, blend_weight_with_history=0.1))
    assert encoder_for(_NoHistoryColumn(), _copy_card(tmp_path, blend_weight=0.7, blend_weight_with_history=0.7))


def test_evaluate_applies_the_served_rule(predictor: OnnxPredictor, encoder: EncoderModel) -> None:
    """`clairvoyant evaluate` blends each prompt with the weight the proxy would use for it."""
    from clairvoyant.tools.training.evaluate import blend_weights_of
    from clairvoyant.tools.training.scoring import ModelScorer

    weights = BlendWeights(first=0.9, later=0.3)
    prompts = [
        _chat(("user", SHORT)),
        _chat(("system", "Be brief."), ("user", ESSAY)),
        _chat(("user", SHORT), ("assistant", "Paris."), ("user", ESSAY)),
        Prompt(ESSAY, context_chars=len(ESSAY) + 400, turns=1),  # e.g. Ollama's context ids
    ]
    got = blend_weights_of(weights, ModelScorer(predictor.model_path), prompts)
    served = [weights.for_history(predictor.history_chars(predictor.predict(p).feature_row)) for p in prompts]
    assert got.tolist() == served == [0.9, 0.9, 0.3, 0.3]


def test_the_refiner_encodes_only_what_still_waits_and_drops_past_its_bound(encoder: EncoderModel) -> None:
    async def scenario() -> None:
        delivered: list[tuple[str, float, float | None]] = []
        outcomes: list[str] = []
        got_one = asyncio.Event()

        def deliver(key: str, value: float, components: bytes, knn: float | None) -> None:
            delivered.append((key, value, knn))
            # the learner's columns: the components, then the pooled embedding (its residual kNN)
            assert encoder.embedding_width == 384
            assert len(components) == 4 * (encoder.components + encoder.embedding_width)
            got_one.set()

        gate = threading.Event()

        def blocked() -> bool:
            gate.wait(10.0)  # holds the worker on its first item while the queue fills
            return True

        refiner = Refiner(encoder, deliver, max_pending=1, count=outcomes.append)
        refiner.start(asyncio.get_running_loop())
        assert refiner.want("first", ESSAY, blocked)
        await until(lambda: refiner.pending == 0, what='the worker to take "first" off the queue')
        assert refiner.want("gone", SHORT, lambda: False)  # dispatched before its turn
        assert not refiner.want("over", SHORT, lambda: True)  # the bound: keeps its lexical prediction
        gate.set()
        await asyncio.wait_for(got_one.wait(), 10.0)
        await until(lambda: refiner.pending == 0, what='the worker to take "gone" too')
        assert refiner.want("second", SHORT, lambda: True)
        await until(lambda: len(delivered) == 2, what="the second delivery")
        refiner.stop()
        assert [k for k, _, _ in delivered] == ["first", "second"]
        assert delivered[0][1] == encoder.log_tokens(ESSAY)
        assert delivered[0][2] == encoder.opinion(ESSAY)[2] is not None  # a waiting request gets the kNN too
        assert sorted(outcomes) == ["dropped", "skipped"]

    asyncio.run(scenario())


def test_the_refiner_serves_waiting_requests_before_the_learner_and_keeps_the_learner_to_its_share(
    encoder: EncoderModel,
) -> None:
    """A learning encode never goes before a waiting request, and after one learning encode of t
    seconds the next waits t x (1 / share - 1): with share 0.001, about 1,000 x t (seconds here),
    while waiting requests are still served at once."""

    async def scenario() -> None:
        order: list[str] = []
        outcomes: list[str] = []

        def deliver(key: str, value: float, components: bytes, knn: float | None) -> None:
            order.append(key)

        def learned(name: str) -> Any:
            def then(value: float, components: bytes) -> None:
                assert len(components) == 4 * (encoder.components + encoder.embedding_width)
                order.append(name)

            return then

        gate = threading.Event()

        def blocked() -> bool:
            gate.wait(10.0)  # holds the worker while both queues fill
            return True

        refiner = Refiner(encoder, deliver, max_pending=4, learning_share=0.001, count=outcomes.append)
        refiner.start(asyncio.get_running_loop())
        assert refiner.want("held", SHORT, blocked)
        await until(lambda: refiner.pending == 0, what='the worker to take "held"')
        assert refiner.encode_later(ESSAY, learned("learn-1"))
        assert refiner.encode_later(SHORT, learned("learn-2"))
        assert refiner.want("waiting", ESSAY, lambda: True)  # handed over after both learning items
        gate.set()
        await until(lambda: len(order) >= 3, timeout_s=10, what="three deliveries")
        assert order == ["held", "waiting", "learn-1"]
        # learn-1 took milliseconds, so learn-2 rests for seconds; a waiting request does not
        assert refiner.want("waiting-2", SHORT, lambda: True)
        await until(lambda: len(order) >= 4, timeout_s=10, what="a fourth delivery")
        assert order == ["held", "waiting", "learn-1", "waiting-2"]
        assert refiner.pending == 1  # learn-2, resting
        refiner.stop()
        assert outcomes == ["learning"]

    asyncio.run(scenario())


def test_the_learners_encodes_are_bounded_apart_from_waiting_requests(encoder: EncoderModel) -> None:
    async def scenario() -> None:
        outcomes: list[str] = []
        refiner = Refiner(encoder, lambda *_: None, max_pending=1, learning_share=0.001, count=outcomes.append)
        assert not refiner.encode_later(SHORT, lambda v, c: None)  # not started: nothing is taken
        gate = threading.Event()
        refiner.start(asyncio.get_running_loop())
        assert refiner.want("held", SHORT, lambda: gate.wait(10.0))
        await until(lambda: refiner.pending == 0, what='the worker to take "held"')
        taken = [refiner.encode_later(SHORT, lambda v, c: None) for _ in range(LEARNING_MAX_PENDING + 2)]
        assert taken == [True] * LEARNING_MAX_PENDING + [False, False]
        assert refiner.want("waiting", SHORT, lambda: True)  # the learner's backlog takes no waiting room
        assert outcomes == ["learning_dropped", "learning_dropped"]
        gate.set()
        refiner.stop()

    asyncio.run(scenario())


def _knn_reference(encoder: EncoderModel, embeddings: np.ndarray) -> np.ndarray:
    """The kNN in numpy from the graph's own initializers: unit query, cosine with the memory (its
    quantised rows dequantised), top 16, weights max(cos, 0) + 1e-9, weighted mean of the labels."""
    import onnx
    from onnx import numpy_helper

    assert encoder.card.knn is not None
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(encoder.card.knn.path)).graph.initializer}
    zero_point = inits["memory_zero_point"]
    assert zero_point.dtype == np.uint8 and (zero_point == 128).all()  # symmetric int8, stored as uint8 + 128
    quantized = inits["memory_quantized"].astype(np.float32) - zero_point.astype(np.float32)[None, :]
    memory = quantized * inits["memory_scale"][None, :]  # a scale per memory row
    labels = inits["labels"]
    assert memory.shape == (384, 43151) and labels.shape == (43151,)
    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    cos = unit @ memory
    top = np.argsort(-cos, axis=1)[:, :16]
    w = np.maximum(np.take_along_axis(cos, top, axis=1), 0.0) + 1e-9
    return (w * labels[top]).sum(axis=1) / w.sum(axis=1)


def test_the_knn_graph_is_the_top_16_cosine_weighted_mean_of_its_memory(encoder: EncoderModel) -> None:
    texts = [
        ESSAY,
        SHORT,
        "Translate 'good morning' into German.",
        "Write a Python function that parses a CSV file and returns the rows as dictionaries, with tests.",
        "Summarise the plot of Hamlet in three sentences.",
        "List twenty creative names for a coffee shop.",
    ]
    embeddings = []
    for text in texts:
        ids = np.asarray([encoder.word_pieces(text)], dtype=np.int64)
        out = encoder._session.run(["embedding"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        embeddings.append(np.asarray(out[0], dtype=np.float32).reshape(-1))
    reference = _knn_reference(encoder, np.array(embeddings))
    served = np.array([encoder.opinion(t)[2] for t in texts])
    # the graph also rounds the query to 8 bits (dynamic quantisation): 1e-4 apart here. (A text repeated
    # many times in the memory, such as "continue", has tied rows at the 16th place, and which of them
    # enter then moves its mean by up to about 0.14. None of these does.)
    assert np.abs(served - reference).max() < 0.01
    assert reference.max() - reference.min() > 1.0  # the queries' neighbours differ: not a constant
    assert served[0] > served[1] + 1.0  # the essay's neighbours wrote longer answers than the one-word question's


def test_refined_blends_the_knn_after_the_encoder_with_its_own_weight(predictor: OnnxPredictor) -> None:
    weights = BlendWeights(first=0.6, later=0.45, knn=0.15)
    lexical = predictor.predict(Prompt(SHORT), model="m")
    prior = lexical.prior_log_tokens
    refined = prior + 0.6 * (7.0 - prior)
    with_knn = predictor.refined(lexical, 7.0, weights, b"", 3.0)
    assert with_knn.prior_log_tokens == pytest.approx(refined + 0.15 * (3.0 - refined))
    assert with_knn.score < predictor.refined(lexical, 7.0, weights).score  # shorter neighbours: sooner
    # no kNN value (an encoder without one), or a weight of 0: the encoder's blend alone
    assert predictor.refined(lexical, 7.0, weights).prior_log_tokens == pytest.approx(refined)
    assert predictor.refined(lexical, 7.0, BlendWeights(0.6, 0.45), b"", 3.0).prior_log_tokens == pytest.approx(refined)
    # evaluate's arrays go through the same function
    blended = BlendWeights.blend(
        np.array([prior, prior]), np.array([7.0, 7.0]), np.array([0.6, 0.6]), np.array([3.0, 7.0]), 0.15
    )
    assert blended[0] == pytest.approx(with_knn.prior_log_tokens)
    assert blended[1] == pytest.approx(refined + 0.15 * (7.0 - refined))
    capped = predictor.refined(predictor.predict(Prompt(SHORT), cap_tokens=20), 7.0, weights, b"", 9.0)
    assert capped.predicted_tokens == 20.0  # the cap still applies last
    with pytest.raises(ValueError, match="knn 1.5"):
        BlendWeights(0.6, 0.45, 1.5)


def test_refined_by_uses_the_cards_knn_and_a_card_without_one_works_as_before(
    tmp_path: Path, predictor: OnnxPredictor, encoder: EncoderModel
) -> None:
    assert encoder.card.knn is not None and encoder.blend_weights == BlendWeights(0.6, 0.45, 0.15)  # the shipped card
    prompt = _chat(("user", ESSAY))
    lexical = predictor.predict(prompt)
    value, _, knn = encoder.opinion(ESSAY)
    assert knn is not None and value == encoder.log_tokens(ESSAY)
    refined = refined_by(encoder, predictor, lexical, ESSAY)
    expected = BlendWeights.blend(lexical.prior_log_tokens, value, 0.6, knn, 0.15)
    assert refined.prior_log_tokens == pytest.approx(expected)
    assert refined.prior_log_tokens != pytest.approx(BlendWeights.blend(lexical.prior_log_tokens, value, 0.6))
    plain = EncoderModel(_copy_card(tmp_path, knn=None))
    assert plain.card.knn is None and plain.blend_weights == BlendWeights(0.6, 0.45)
    assert plain.opinion(ESSAY)[2] is None and plain.opinion(ESSAY)[0] == value
    assert refined_by(plain, predictor, lexical, ESSAY).prior_log_tokens == pytest.approx(
        BlendWeights.blend(lexical.prior_log_tokens, value, 0.6)
    )
    many, knns = encoder.opinions_many([ESSAY, SHORT])
    assert many.tolist() == [value, encoder.log_tokens(SHORT)] and knns is not None and knns[0] == knn
    assert plain.opinions_many([ESSAY])[1] is None


def test_the_learners_identity_changes_with_the_knn_and_refuses_a_state_learned_without_it(
    tmp_path: Path, predictor: OnnxPredictor, encoder: EncoderModel, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from clairvoyant.prediction.learner import OnlineLearner, PriorIdentity

    with_knn = PriorIdentity.of(predictor, encoder)
    assert with_knn.knn_sha256 == _SHIPPED_KNN["sha256"] and with_knn.blend_weights == (0.6, 0.45, 0.15)
    plain = PriorIdentity.of(predictor, EncoderModel(_copy_card(tmp_path, knn=None)))
    assert plain.knn_sha256 == "" and plain.blend_weights == (0.6, 0.45)
    reweighted = PriorIdentity.of(
        predictor, EncoderModel(_copy_card(tmp_path, knn={**_SHIPPED_KNN, "blend_weight": 0.3}))
    )
    assert len({with_knn, plain, reweighted}) == 3
    path = tmp_path / "learner.npz"
    OnlineLearner(plain).save(path)
    with caplog.at_level(logging.WARNING, logger="clairvoyant.prediction.learner"):
        assert OnlineLearner.load(path, with_knn).observed_total == 0
    assert "refused" in caplog.text and "blend_weights" in caplog.text


def test_the_refiner_passes_waiting_requests_over_while_its_opinions_come_too_late_and_probes_until_they_do_not(
    encoder: EncoderModel,
) -> None:
    """A queue that turns over faster than the encoder answers: every request is dispatched before
    its turn, or before its opinion is back. Once the moving share that came in time is under the
    floor, one waiting request a probe interval is handed over; once a probe's opinion is used
    again, every one is. Requests their clients withdrew do not count."""

    async def scenario() -> None:
        outcomes: list[str] = []
        delivered: list[str] = []

        def deliver(key: str, value: float, components: bytes, knn: float | None) -> bool:
            delivered.append(key)
            return key.startswith("fresh")  # "late-*": dispatched while it was being encoded

        refiner = Refiner(encoder, deliver, max_pending=256, count=outcomes.append, probe_interval_s=0.5)
        refiner.start(asyncio.get_running_loop())
        n_gone = 60  # (1 - 1/16)^60 = 0.021 < IN_TIME_FLOOR; 40 would leave 0.076
        # Withdrawn by their clients before their turn: that says nothing of the encoder's pace.
        assert all(refiner.want(f"left-{i}", SHORT, lambda: False, lambda: False) for i in range(n_gone))
        await until(
            lambda: len(outcomes) == n_gone and refiner.pending == 0, timeout_s=10, what="the left ones skipped"
        )
        assert refiner.in_time == 1.0
        # Dispatched before their turn: the queue turns over faster than the encoder answers.
        assert all(refiner.want(f"gone-{i}", SHORT, lambda: False, lambda: True) for i in range(n_gone))
        await until(lambda: len(outcomes) == 2 * n_gone and refiner.pending == 0, 10, "the gone ones skipped")
        assert outcomes == ["skipped"] * 2 * n_gone and refiner.in_time < IN_TIME_FLOOR
        # A probe, then the rest passed over until the interval is out.
        assert [refiner.want(f"late-{i}", SHORT, lambda: True) for i in range(10)] == [True] + [False] * 9
        assert outcomes.count("bypassed") == 9
        await until(lambda: delivered == ["late-0"], timeout_s=10, what="the probe's opinion")
        assert refiner.in_time < IN_TIME_FLOOR  # its opinion came too late as well
        await asyncio.sleep(0.5)  # the probe interval passes: time is what this step tests
        assert [refiner.want(f"late-{i}", SHORT, lambda: True) for i in (10, 11)] == [True, False]
        await until(lambda: delivered == ["late-0", "late-10"], timeout_s=10, what="the next probe's opinion")
        await asyncio.sleep(0.5)  # the probe interval passes again
        assert refiner.want("fresh-0", SHORT, lambda: True)
        await until(lambda: delivered[-1:] == ["fresh-0"], timeout_s=10, what="the fresh probe's opinion")
        assert refiner.in_time > IN_TIME_FLOOR  # the probe came in time: every request is taken again
        assert all(refiner.want(f"again-{i}", SHORT, lambda: True) for i in range(3))
        assert outcomes.count("bypassed") == 10
        refiner.stop()

    asyncio.run(scenario())
