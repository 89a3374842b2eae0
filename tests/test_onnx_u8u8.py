"""prediction/onnx_u8u8.py: int8 MatMulInteger weights rewritten as uint8 + 128, in the file's bytes.

The rewrite is checked against the same conversion done with the ``onnx`` package, on the shipped
encoder and kNN graphs and on small graphs built here; a product that a saturating u8 x s8 kernel
gets wrong (AVX2 without VNNI, as on this project's host) must come out exact after it; and every
model it must not touch comes back as it was.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from clairvoyant.prediction.encoder import EncoderModel
from clairvoyant.prediction.onnx_u8u8 import u8u8_weights

MODEL_DIR = Path(__file__).resolve().parents[1] / "model"


def _reference(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Every initializer after the conversion, done with the onnx package: each MatMulInteger's int8
    weight and zero point as uint8 + 128."""
    arrays = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "MatMulInteger" and len(node.input) == 4:
            for name in (node.input[1], node.input[3]):
                if arrays[name].dtype == np.int8:
                    arrays[name] = (arrays[name].astype(np.int16) + 128).astype(np.uint8)
    return arrays


@pytest.mark.parametrize(("file", "count"), [("encoder.onnx", 74), ("encoder.knn.onnx", 2)])
def test_the_shipped_graphs_are_rewritten_as_the_onnx_package_would(file: str, count: int) -> None:
    data = (MODEL_DIR / file).read_bytes()
    new, rewritten = u8u8_weights(data)
    assert rewritten == count
    assert len(new) == len(data)  # patched in place
    got = onnx.load_from_string(new)
    onnx.checker.check_model(got)
    want = _reference(onnx.load_from_string(data))
    have = {i.name: numpy_helper.to_array(i) for i in got.graph.initializer}
    assert have.keys() == want.keys()
    for name, array in want.items():
        assert have[name].dtype == array.dtype and np.array_equal(have[name], array), name
    assert sum(a.dtype == np.uint8 for a in have.values()) >= count
    assert [n.SerializeToString() for n in got.graph.node] == [
        n.SerializeToString() for n in onnx.load_from_string(data).graph.node
    ]


def _matmul_integer(
    weight: onnx.TensorProto,
    zero_point: onnx.TensorProto | None,
    *,
    extra_nodes: tuple[onnx.NodeProto, ...] = (),
    extra_outputs: tuple[onnx.ValueInfoProto, ...] = (),
    declared_inputs: tuple[onnx.ValueInfoProto, ...] = (),
) -> bytes:
    """y = MatMulInteger(a, weight, a_zero_point 0, zero_point): a uint8 [1, 2] graph input."""
    inputs = ["a", weight.name, "a_zp"] + ([zero_point.name] if zero_point is not None else [])
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", inputs, ["y"]), *extra_nodes],
        "t",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 2]), *declared_inputs],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1]), *extra_outputs],
        [weight, helper.make_tensor("a_zp", TensorProto.UINT8, [], [0])]
        + ([zero_point] if zero_point is not None else []),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _run(model: bytes, a: list[int]) -> int:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return int(session.run(["y"], {"a": np.array([a], dtype=np.uint8)})[0][0, 0])


WEIGHT = numpy_helper.from_array(np.array([[127], [127]], dtype=np.int8), "w")  # raw_data
ZERO_POINT_PACKED = helper.make_tensor("w_zp", TensorProto.INT8, [1], [0])  # int32_data, as quantize_dynamic writes it
ZERO_POINT_RAW = numpy_helper.from_array(np.array([0], dtype=np.int8), "w_zp")


@pytest.mark.parametrize("zero_point", [ZERO_POINT_PACKED, ZERO_POINT_RAW], ids=["packed", "raw"])
def test_a_product_a_saturating_kernel_gets_wrong_comes_out_exact(zero_point: onnx.TensorProto) -> None:
    """255 x 127 + 255 x 127 = 64,770 does not fit the 16-bit lane a u8 x s8 kernel without VNNI
    adds the pair in (it gives 32,767 there); the u8 x u8 kernel is exact on every CPU."""
    model = _matmul_integer(WEIGHT, zero_point)
    new, rewritten = u8u8_weights(model)
    assert rewritten == 2
    for a in ([255, 255], [0, 0], [1, 2], [200, 13]):
        assert _run(new, a) == 127 * (a[0] + a[1])
    negative = numpy_helper.from_array(np.array([[-128], [5]], dtype=np.int8), "w")
    new, rewritten = u8u8_weights(_matmul_integer(negative, ZERO_POINT_RAW))
    assert rewritten == 2 and _run(new, [255, 3]) == -128 * 255 + 5 * 3


def test_what_it_cannot_prove_is_left_as_it_was() -> None:
    gather = helper.make_node("Gather", ["w", "idx"], ["g"])
    cases = {
        "the weight is also read by a Gather": _matmul_integer(
            WEIGHT, ZERO_POINT_RAW, extra_nodes=(helper.make_node("Constant", [], ["idx"], value_int=0), gather),
            extra_outputs=(helper.make_tensor_value_info("g", TensorProto.INT8, [1]),),
        ),
        "no weight zero point (it would become 0 for a uint8 weight)": _matmul_integer(WEIGHT, None),
        "a zero point that is not zero, packed": _matmul_integer(
            WEIGHT, helper.make_tensor("w_zp", TensorProto.INT8, [1], [-3])
        ),
        "the weight is declared a graph input": _matmul_integer(
            WEIGHT, ZERO_POINT_RAW, declared_inputs=(helper.make_tensor_value_info("w", TensorProto.INT8, [2, 1]),)
        ),
    }  # fmt: skip
    for why, model in cases.items():
        assert u8u8_weights(model) == (model, 0), why
    external = onnx.load_from_string(_matmul_integer(WEIGHT, ZERO_POINT_RAW))
    weight = next(i for i in external.graph.initializer if i.name == "w")
    weight.data_location = TensorProto.EXTERNAL
    weight.external_data.add(key="location", value="w.bin")
    data = external.SerializeToString()
    assert u8u8_weights(data) == (data, 0)
    branch = helper.make_graph([helper.make_node("Identity", ["a"], ["b"])], "b", [],
                               [helper.make_tensor_value_info("b", TensorProto.UINT8, [1, 2])])  # fmt: skip
    with_if = onnx.load_from_string(_matmul_integer(WEIGHT, ZERO_POINT_RAW))
    with_if.graph.node.append(helper.make_node("If", ["cond"], ["c"], then_branch=branch, else_branch=branch))
    data = with_if.SerializeToString()
    assert u8u8_weights(data) == (data, 0)
    assert u8u8_weights(b"") == (b"", 0)
    shipped = (MODEL_DIR / "encoder.knn.onnx").read_bytes()
    for broken in (shipped[:7], shipped[:389_440], shipped[:-5], b"\x0f\xff", b"\x08\x80"):
        assert u8u8_weights(broken) == (broken, 0)  # not readable: left for onnxruntime to refuse


def test_the_encoder_runs_both_graphs_rewritten_and_says_so() -> None:
    encoder = EncoderModel()
    assert encoder.u8u8_weights == {"encoder.onnx": 74, "encoder.knn.onnx": 2}
    log_tokens, components, knn = encoder.opinion("Write a 500-word essay on the history of Rome.")
    assert np.isfinite(log_tokens) and knn is not None and np.isfinite(knn) and components
