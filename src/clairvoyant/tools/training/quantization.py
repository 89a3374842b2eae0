"""An int8-quantised ONNX graph's MatMulInteger weights as uint8 + 128: the same integers on every CPU.

onnxruntime's ``quantize_dynamic`` writes MatMul weights as int8 and activations as uint8
(MatMulInteger u8 x s8). On x86 CPUs with AVX2 and no VNNI (AMD Zen 2 and 3, Intel before Ice
Lake), onnxruntime's u8 x s8 kernel adds pairs of products in saturating 16-bit lanes (vpmaddubsw):
255 x 127 + 255 x 127 comes out 32,767, not 64,770. There the encoder's kNN moved by up to 0.90 ln
tokens on AlpacaEval prompts (median 0.05) and the encoder by up to 0.30. With VNNI, or on ARM,
the kernel is exact.

``uint8_matmul_weights`` rewrites each such weight w as the uint8 w + 128 and its zero point z as
z + 128 (an absent zero point, 0, becomes a 128). Every integer the node multiplies is unchanged:
(a - a_zp) x (w - z) = (a - a_zp) x ((w + 128) - (z + 128)). onnxruntime's u8 x u8 kernel widens to
16 bits before multiplying, so it is exact on every CPU (about 10% slower per encoder opinion on an
AVX2 CPU without VNNI: docs/benchmarks.md section 29). It runs once, when a graph is exported
(``encoder_card.install``); serving loads the files as they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

__all__ = ["export_uint8", "matmul_integer_weights", "uint8_matmul_weights"]

# MatMulInteger's inputs: A, B (the weight), a_zero_point, b_zero_point
_WEIGHT, _WEIGHT_ZERO_POINT = 1, 3
_WEIGHT_SLOTS = (_WEIGHT, _WEIGHT_ZERO_POINT)


def _is_matmul_integer(node: onnx.NodeProto) -> bool:
    return node.op_type == "MatMulInteger" and node.domain in ("", "ai.onnx")


def _no_subgraphs(graph: onnx.GraphProto) -> None:
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                raise ValueError(f"node {node.name or node.op_type} holds a subgraph: not supported")


def matmul_integer_weights(model: onnx.ModelProto) -> dict[str, int]:
    """The data type (a ``TensorProto`` enum value) of every tensor a MatMulInteger node reads as its
    weight or weight zero point, by name; ``TensorProto.UNDEFINED`` for one that is not an
    initializer (computed or fed at run time, so of no type known here). Raises ValueError for a
    graph with subgraphs."""
    graph = model.graph
    _no_subgraphs(graph)
    types = {t.name: t.data_type for t in graph.initializer}
    declared = {v.name for v in (*graph.input, *graph.output, *graph.value_info)}
    found: dict[str, int] = {}
    for node in filter(_is_matmul_integer, graph.node):
        for slot in _WEIGHT_SLOTS:
            if slot < len(node.input) and node.input[slot]:
                name = node.input[slot]
                found[name] = TensorProto.UNDEFINED if name in declared else types.get(name, TensorProto.UNDEFINED)
    return found


def uint8_matmul_weights(model: onnx.ModelProto) -> list[str]:
    """Rewrites ``model`` in place: every int8 weight of a MatMulInteger node as the uint8 w + 128,
    with its zero point moved by 128 (see the module docstring). Returns the names of the
    initializers rewritten or added (none: nothing to do, e.g. a graph rewritten before).

    Raises ValueError, leaving ``model`` as it was, for what it cannot rewrite exactly: an int8
    weight or zero point that is not an initializer (a graph input could override it), one that
    something else also reads (a Gather of the int8 word-embedding table, say), a zero point of
    another type than its weight, or a graph with subgraphs."""
    graph = model.graph
    weights = matmul_integer_weights(model)
    initializers = {t.name: t for t in graph.initializer}
    nodes = [n for n in graph.node if _is_matmul_integer(n) and weights.get(n.input[_WEIGHT]) != TensorProto.UINT8]
    int8: set[str] = set()
    for node in nodes:
        for slot in _WEIGHT_SLOTS:
            name = node.input[slot] if slot < len(node.input) else ""
            if name and weights[name] != TensorProto.INT8:
                raise ValueError(
                    f"MatMulInteger {node.name!r}: {name!r} is not an int8 initializer "
                    f"({TensorProto.DataType.Name(weights[name])})"
                )
            if name:
                int8.add(name)
    for node in graph.node:  # nothing but MatMulInteger weights may read them
        for slot, name in enumerate(node.input):
            if name in int8 and not (_is_matmul_integer(node) and slot in _WEIGHT_SLOTS):
                raise ValueError(f"{name!r} is also read by {node.op_type} {node.name!r}: it must stay int8")
    for output in graph.output:
        if output.name in int8:
            raise ValueError(f"{output.name!r} is also a graph output: it must stay int8")
    changed = sorted(int8)
    for name in changed:
        tensor = initializers[name]
        shifted = numpy_helper.to_array(tensor).astype(np.int16) + 128
        tensor.CopyFrom(numpy_helper.from_array(shifted.astype(np.uint8), name))
    for node in nodes:  # no zero point: it was 0, and is 128 now
        if len(node.input) <= _WEIGHT_ZERO_POINT or not node.input[_WEIGHT_ZERO_POINT]:
            name = _unused_name(f"{node.input[_WEIGHT]}_zero_point", _names(graph))
            graph.initializer.append(numpy_helper.from_array(np.array(128, dtype=np.uint8), name))
            while len(node.input) < _WEIGHT_ZERO_POINT:
                node.input.append("")
            if len(node.input) == _WEIGHT_ZERO_POINT:
                node.input.append(name)
            else:
                node.input[_WEIGHT_ZERO_POINT] = name
            changed.append(name)
    return changed


def _names(graph: onnx.GraphProto) -> set[str]:
    names: set[str] = {t.name for t in graph.initializer}
    names.update(v.name for v in (*graph.input, *graph.output, *graph.value_info))
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
    return names


def _unused_name(stem: str, taken: Iterable[str]) -> str:
    taken = set(taken)
    name, k = stem, 1
    while name in taken:
        name, k = f"{stem}_{k}", k + 1
    return name


def export_uint8(source: Path, target: Path) -> list[str]:
    """Writes ``source``'s graph to ``target`` (the same path is fine) with its MatMulInteger
    weights as uint8 (``uint8_matmul_weights``), checked by the ONNX checker; returns the names
    rewritten or added."""
    model = onnx.load(str(source))
    changed = uint8_matmul_weights(model)
    onnx.checker.check_model(model)
    onnx.save(model, str(target))
    return changed
