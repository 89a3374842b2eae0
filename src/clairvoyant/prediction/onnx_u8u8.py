"""An int8-quantised ONNX model's weights as uint8 + 128, so that it gives the same answer on every CPU.

The encoder and its kNN graph were quantised by onnxruntime's ``quantize_dynamic`` (int8 weights,
uint8 activations: MatMulInteger u8 x s8). On x86 CPUs with AVX2 and no VNNI (AMD Zen 2 and 3,
Intel before Ice Lake, this project's AVX2-only AMD EPYC host), onnxruntime's u8 x s8 kernel adds
pairs of products in saturating 16-bit lanes (vpmaddubsw), so it does not compute the integer
product the graph means; with VNNI, or on ARM, it does. On that host, the shipped kNN's answer for
AlpacaEval prompts moved by up to 0.90 ln tokens (median 0.05) and the encoder's by up to 0.30.

Rewriting each such weight w as the uint8 w + 128, and its zero point 0 as 128, changes no integer:
(a - a_zp) x ((w + 128) - 128). onnxruntime's u8 x u8 kernel widens to 16 bits before multiplying,
so it is exact everywhere (10% slower per encoder opinion on that host; docs/benchmarks.md section
29). The rewrite patches the file's bytes in place, the same length: a weight's ``data_type`` varint
INT8 (3) becomes UINT8 (2), and its ``raw_data`` bytes are XORed with 0x80 (int8 v -> uint8 v + 128);
zero points that quantize_dynamic wrote as packed int32 zeros become a raw_data field of as many 128s.

Only weights it can prove are used as nothing else are rewritten: each must be an int8 initializer
held inline (in ``raw_data``, or as packed zeros), fed to MatMulInteger nodes (default domain) only, as input 1 (weight)
or 3 (weight zero point), never a graph input, output or value_info, with its partner rewritten too.
A model with subgraphs is left alone. ``u8u8_weights`` returns the bytes and how many initializers
it rewrote (0: the model as it was).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from clairvoyant.prediction.onnx_wire import spans, varint

__all__ = ["u8u8_weights"]

# Field numbers of onnx.proto (onnx/onnx.proto3).
_MODEL_GRAPH = 7
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_INPUT, _GRAPH_OUTPUT, _GRAPH_VALUE_INFO = 1, 5, 11, 12, 13
_NODE_INPUT, _NODE_OP_TYPE, _NODE_ATTRIBUTE, _NODE_DOMAIN = 1, 4, 5, 7
_ATTR_G, _ATTR_GRAPHS = 6, 11
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_INT32_DATA, _TENSOR_NAME, _TENSOR_RAW_DATA = 1, 2, 5, 8, 9
_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 13, 14
_INT32_DATA_KEY, _RAW_DATA_KEY = (_TENSOR_INT32_DATA << 3) | 2, (_TENSOR_RAW_DATA << 3) | 2
_VALUE_INFO_NAME = 1
_INT8, _UINT8 = 3, 2
_WEIGHT, _WEIGHT_ZERO_POINT = 1, 3  # MatMulInteger's inputs: A, B, a_zero_point, b_zero_point


@dataclass(slots=True)
class _Int8Initializer:
    data_type_at: int  # offset of the data_type varint (one byte: INT8)
    values: tuple[int, int]  # the values' span: raw_data's bytes, or int32_data's packed zeros
    zeros_key_at: int = -1  # the key byte of int32_data when the values are packed zeros, else -1


@dataclass(slots=True)
class _Node:
    op_type: bytes
    domain: bytes
    inputs: list[str]
    has_subgraph: bool = False


def _strings(data: bytes, start: int, end: int, number: int) -> Iterator[str]:
    for n, wire, s, e in spans(data, start, end):
        if n == number and wire == 2:
            yield bytes(data[s:e]).decode("utf-8", "replace")


def _node(data: bytes, start: int, end: int) -> _Node:
    node = _Node(b"", b"", [])
    for number, wire, s, e in spans(data, start, end):
        if wire != 2:
            continue
        if number == _NODE_INPUT:
            node.inputs.append(bytes(data[s:e]).decode("utf-8", "replace"))
        elif number == _NODE_OP_TYPE:
            node.op_type = bytes(data[s:e])
        elif number == _NODE_DOMAIN:
            node.domain = bytes(data[s:e])
        elif number == _NODE_ATTRIBUTE:
            node.has_subgraph |= any(n in (_ATTR_G, _ATTR_GRAPHS) for n, *_ in spans(data, s, e))
    return node


def _int8_initializer(data: bytes, start: int, end: int) -> tuple[str, _Int8Initializer | None]:
    """(name, where to patch it) of one TensorProto; None unless an inline int8 tensor whose values
    are in raw_data, or in int32_data as packed zeros (one byte each, as quantize_dynamic writes a
    symmetric weight's zero points): those become a raw_data field of the same length."""
    name, data_type_at, data_type, values, zeros_key_at, external, size = "", -1, -1, None, -1, False, 1
    key_at = start  # a field's key starts where the field before it ended
    for number, wire, s, e in spans(data, start, end):
        if number == _TENSOR_NAME and wire == 2:
            name = bytes(data[s:e]).decode("utf-8", "replace")
        elif number == _TENSOR_DIMS and wire == 0:
            size *= varint(data, s)[0]
        elif number == _TENSOR_DIMS:
            size = -1  # packed dims: not what onnx writes; not worth a second reader
        elif number == _TENSOR_DATA_TYPE and wire == 0:
            data_type_at, data_type = s, (varint(data, s)[0] if e - s == 1 else -1)
        elif number == _TENSOR_RAW_DATA and wire == 2:
            values = (s, e)
        elif number == _TENSOR_INT32_DATA and wire == 2:
            all_zero = e - s == size and data[key_at] == _INT32_DATA_KEY and not any(data[s:e])
            values, zeros_key_at = ((s, e), key_at) if all_zero else (None, -1)
        elif number == _TENSOR_EXTERNAL_DATA or (number == _TENSOR_DATA_LOCATION and varint(data, s)[0] != 0):
            external = True
        key_at = e
    if data_type != _INT8 or values is None or external:
        return name, None
    return name, _Int8Initializer(data_type_at, values, zeros_key_at)


def u8u8_weights(model: bytes) -> tuple[bytes, int]:
    """``model`` with its MatMulInteger int8 weights and zero points as uint8 + 128, and the number
    of initializers rewritten (see the module docstring); ``model`` itself when that is 0, and when
    its bytes are not a protobuf message this can read (onnxruntime then says what is wrong)."""
    try:
        return _u8u8_weights(model)
    except (ValueError, IndexError):  # truncated or not protobuf
        return model, 0


def _u8u8_weights(model: bytes) -> tuple[bytes, int]:
    graphs = [(s, e) for n, w, s, e in spans(model) if n == _MODEL_GRAPH and w == 2]
    if len(graphs) != 1:
        return model, 0
    g_start, g_end = graphs[0]
    nodes: list[_Node] = []
    int8: dict[str, _Int8Initializer] = {}
    declared: set[str] = set()  # graph inputs, outputs and value_info: their types are written down
    for number, wire, s, e in spans(model, g_start, g_end):
        if wire != 2:
            continue
        if number == _GRAPH_NODE:
            nodes.append(_node(model, s, e))
        elif number == _GRAPH_INITIALIZER:
            name, found = _int8_initializer(model, s, e)
            if found is not None:
                int8[name] = found
        elif number in (_GRAPH_INPUT, _GRAPH_OUTPUT, _GRAPH_VALUE_INFO):
            declared.update(_strings(model, s, e, _VALUE_INFO_NAME))
    if any(node.has_subgraph for node in nodes):
        return model, 0

    def rewritable(node: _Node) -> bool:
        return (
            node.op_type == b"MatMulInteger"
            and node.domain in (b"", b"ai.onnx")
            and len(node.inputs) > _WEIGHT_ZERO_POINT
            and node.inputs[_WEIGHT] in int8
            and node.inputs[_WEIGHT_ZERO_POINT] in int8
        )

    chosen = [node for node in nodes if rewritable(node)]
    while True:  # drop the nodes whose weight or zero point something else also reads, until none is left
        names = {node.inputs[i] for node in chosen for i in (_WEIGHT, _WEIGHT_ZERO_POINT)}
        foreign = names & declared
        chosen_ids = {id(node) for node in chosen}
        for node in nodes:
            mine = (_WEIGHT, _WEIGHT_ZERO_POINT) if id(node) in chosen_ids else ()
            foreign.update(name for i, name in enumerate(node.inputs) if name in names and i not in mine)
        kept = [c for c in chosen if not foreign & {c.inputs[_WEIGHT], c.inputs[_WEIGHT_ZERO_POINT]}]
        if len(kept) == len(chosen):
            break
        chosen = kept
    if not names:
        return model, 0
    patched = bytearray(model)
    for name in names:
        where = int8[name]
        patched[where.data_type_at] = _UINT8
        start, end = where.values
        view = np.frombuffer(patched, dtype=np.uint8, count=end - start, offset=start)
        if where.zeros_key_at >= 0:  # packed int32 zeros -> raw uint8 128s: same key and length sizes
            patched[where.zeros_key_at] = _RAW_DATA_KEY
            view[:] = 0x80
        else:
            np.bitwise_xor(view, 0x80, out=view)
    return bytes(patched), len(names)
