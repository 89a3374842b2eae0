"""The encoder's and the kNN's ONNX graphs after fine-tuning: quantisation, the components output,
the kNN graph. onnx, numpy and onnxruntime only (no torch).

Encoder (from the fine-tuned fp32 export: input_ids, attention_mask -> log_tokens, embedding):

1. ``int8_word_embeddings``: the word-embedding table as int8 per row and a float32 scale per word
   piece (Gather both, Cast, Mul: the same [N, T, 384] floats within a rounding);
2. ``quantize_matmuls``: onnxruntime's dynamic quantisation of the MatMuls, per-channel int8 weights;
3. ``quantization.export_uint8``: those weights as uint8 + 128, exact on every CPU;
4. ``add_components``: the top principal components of the pooled embedding over training rows, as
   a third output, ``components`` = (embedding - mean) @ basis.

kNN (``knn_graph``): embedding -> L2-normalise -> MatMul with the unit-normalised memory -> TopK ->
cosine weights max(cos, 0) + 1e-9 -> the weighted mean of the neighbours' labels
(``knn_log_tokens``); its MatMul is quantised the same way (per-channel int8, then uint8).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "add_components",
    "int8_word_embeddings",
    "knn_graph",
    "pooled_embeddings",
    "principal_components",
    "quantize_matmuls",
]


def _word_gather(model: onnx.ModelProto) -> tuple[onnx.NodeProto, onnx.TensorProto]:
    initializers = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Gather" and node.input[0] in initializers and node.input[1] == "input_ids":
            table = initializers[node.input[0]]
            if table.data_type != TensorProto.FLOAT:
                raise ValueError(f"the word-embedding table {table.name!r} is not float32 (quantised before?)")
            return node, table
    raise ValueError("the graph has no Gather of input_ids on an initializer (its word embeddings)")


def int8_word_embeddings(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with its word-embedding table as int8 per row (symmetric: scale =
    max|row| / 127) and a float32 scale per row. Raises ValueError for a graph without a Gather of
    ``input_ids`` on a float32 initializer."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    node, table = _word_gather(model)
    weights = numpy_helper.to_array(table).astype(np.float32)
    scale = np.maximum(np.abs(weights).max(axis=1, keepdims=True), 1e-12) / 127.0
    quantised = np.clip(np.round(weights / scale), -127, 127).astype(np.int8)
    name, out = table.name, node.output[0]
    model.graph.initializer.remove(table)
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(quantised, name + "_int8"),
            numpy_helper.from_array(scale.astype(np.float32), name + "_scale"),
        ]
    )
    nodes = [
        helper.make_node("Gather", [name + "_int8", "input_ids"], [out + "_q"], axis=0),
        helper.make_node("Gather", [name + "_scale", "input_ids"], [out + "_s"], axis=0),
        helper.make_node("Cast", [out + "_q"], [out + "_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", [out + "_f", out + "_s"], [out]),
    ]
    at = list(model.graph.node).index(node)
    model.graph.node.remove(node)
    for k, new in enumerate(nodes):
        model.graph.node.insert(at + k, new)
    return model


def quantize_matmuls(source: Path, target: Path) -> None:
    """onnxruntime's dynamic quantisation of ``source``'s MatMuls only (per-channel int8 weights;
    a Gather or a label initializer is left as it is), to ``target``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        str(source), str(target), weight_type=QuantType.QInt8, per_channel=True, op_types_to_quantize=["MatMul"]
    )


def pooled_embeddings(graph: Path, tokenizer_path: Path, texts: Iterable[str], max_word_pieces: int) -> np.ndarray:
    """The graph's ``embedding`` output for each text's first ``max_word_pieces`` word pieces (as
    training reads it), one text per run on one thread: a quantised graph scales its activations
    over the whole batch."""
    from tokenizers import Tokenizer

    from clairvoyant.prediction.predictor import single_threaded_session
    from clairvoyant.tools.training.encoder_data import readable

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.enable_truncation(max_word_pieces)
    tokenizer.no_padding()
    session = single_threaded_session(graph, "encoder", graph.read_bytes())
    rows = []
    for text in texts:
        ids = np.asarray([tokenizer.encode(readable(text[: max_word_pieces * 8])).ids], dtype=np.int64)
        out = session.run(["embedding"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        rows.append(np.asarray(out[0], dtype=np.float64).reshape(-1))
    return np.asarray(rows)


def principal_components(embeddings: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(mean [d], basis [k, d], share of the variance the k components explain) of ``embeddings`` [n, d]."""
    x = np.asarray(embeddings, dtype=np.float64)
    mean = x.mean(axis=0)
    _, singular, vt = np.linalg.svd(x - mean, full_matrices=False)
    explained = singular**2 / np.sum(singular**2)
    return mean, vt[:k], float(explained[:k].sum())


def add_components(model: onnx.ModelProto, mean: np.ndarray, basis: np.ndarray) -> onnx.ModelProto:
    """A copy of ``model`` with a ``components`` output [N, k] = (embedding - mean) @ basis^T."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    graph.initializer.extend(
        [
            numpy_helper.from_array(mean.astype(np.float32), "components_mean"),
            numpy_helper.from_array(basis.T.astype(np.float32), "components_basis"),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("Sub", ["embedding", "components_mean"], ["components_centred"]),
            helper.make_node("MatMul", ["components_centred", "components_basis"], ["components"]),
        ]
    )
    graph.output.append(helper.make_tensor_value_info("components", TensorProto.FLOAT, ["batch", len(basis)]))
    onnx.checker.check_model(model)
    return model


def knn_graph(memory: np.ndarray, labels: np.ndarray, k: int) -> onnx.ModelProto:
    """The fp32 kNN graph: ``embedding`` [N, d] -> ``knn_log_tokens`` [N], the cosine-weighted mean
    of the ``labels`` of the ``k`` rows of ``memory`` [n, d] nearest by cosine. Raises ValueError
    when the memory holds fewer than ``k`` rows."""
    memory = np.asarray(memory, dtype=np.float32)
    if len(memory) < k:
        raise ValueError(f"a kNN of {k} neighbours needs at least {k} memory rows, not {len(memory)}")
    unit = memory / np.linalg.norm(memory, axis=1, keepdims=True)
    dim = unit.shape[1]
    initializers = [
        numpy_helper.from_array(np.ascontiguousarray(unit.T, dtype=np.float32), "memory"),
        numpy_helper.from_array(np.asarray(labels, dtype=np.float32), "labels"),
        numpy_helper.from_array(np.array([k], dtype=np.int64), "k"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
        numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero"),
        numpy_helper.from_array(np.array(1e-9, dtype=np.float32), "eps"),
    ]
    nodes = [
        helper.make_node("ReduceL2", ["embedding", "axis1"], ["norm"], keepdims=1),
        helper.make_node("Div", ["embedding", "norm"], ["unit"]),
        helper.make_node("MatMul", ["unit", "memory"], ["cos"]),
        helper.make_node("TopK", ["cos", "k"], ["top_cos", "top_idx"], axis=-1),
        helper.make_node("Max", ["top_cos", "zero"], ["pos"]),
        helper.make_node("Add", ["pos", "eps"], ["w"]),
        helper.make_node("Gather", ["labels", "top_idx"], ["top_y"], axis=0),
        helper.make_node("Mul", ["w", "top_y"], ["wy"]),
        helper.make_node("ReduceSum", ["wy", "axis1"], ["num"], keepdims=0),
        helper.make_node("ReduceSum", ["w", "axis1"], ["den"], keepdims=0),
        helper.make_node("Div", ["num", "den"], ["knn_log_tokens"]),
    ]
    graph = helper.make_graph(
        nodes,
        "encoder_knn",
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", dim])],
        [helper.make_tensor_value_info("knn_log_tokens", TensorProto.FLOAT, ["N"])],
        initializers,
    )
    model: Any = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model
