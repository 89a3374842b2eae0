"""clairvoyant.tools.training.quantization: int8 MatMulInteger weights rewritten as uint8 + 128 at export.

A product that a saturating u8 x s8 kernel gets wrong (AVX2 without VNNI) must come out exact after
the rewrite, zero points of any value included; the shipped graphs' int8 form must rewrite to the
shipped files' very arrays; and whatever the rewrite cannot prove exact is refused, not half done.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from clairvoyant.prediction.encoder import DEFAULT_ENCODER_CARD  # noqa: E402
from clairvoyant.tools.training.quantization import (  # noqa: E402
    export_uint8,
    matmul_integer_weights,
    uint8_matmul_weights,
)

MODEL_DIR = DEFAULT_ENCODER_CARD.parent


def _matmul_integer(
    weight: onnx.TensorProto,
    zero_point: onnx.TensorProto | None,
    *,
    extra_nodes: tuple[onnx.NodeProto, ...] = (),
    extra_outputs: tuple[onnx.ValueInfoProto, ...] = (),
    declared_inputs: tuple[onnx.ValueInfoProto, ...] = (),
) -> onnx.ModelProto:
    """y = MatMulInteger(a, weight, a_zero_point 0, zero_point): a uint8 [1, 2] graph input."""
    inputs = ["a", weight.name, "a_zp"] + ([zero_point.name] if zero_point is not None else [])
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", inputs, ["y"], name="mm"), *extra_nodes],
        "t",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 2]), *declared_inputs],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1]), *extra_outputs],
        [weight, helper.make_tensor("a_zp", TensorProto.UINT8, [], [0])]
        + ([zero_point] if zero_point is not None else []),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _run(model: onnx.ModelProto, a: list[int]) -> int:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return int(session.run(["y"], {"a": np.array([a], dtype=np.uint8)})[0][0, 0])


WEIGHT = numpy_helper.from_array(np.array([[127], [127]], dtype=np.int8), "w")  # raw_data
ZERO_POINT_PACKED = helper.make_tensor("w_zp", TensorProto.INT8, [1], [0])  # int32_data, as quantize_dynamic writes it
ZERO_POINT_RAW = numpy_helper.from_array(np.array([0], dtype=np.int8), "w_zp")


@pytest.mark.parametrize("zero_point", [ZERO_POINT_PACKED, ZERO_POINT_RAW, None], ids=["packed", "raw", "absent"])
def test_a_product_a_saturating_kernel_gets_wrong_comes_out_exact(zero_point: onnx.TensorProto | None) -> None:
    """255 x 127 + 255 x 127 = 64,770 does not fit the 16-bit lane a u8 x s8 kernel without VNNI
    adds the pair in (it gives 32,767 there); the u8 x u8 kernel is exact on every CPU."""
    model = _matmul_integer(WEIGHT, zero_point)
    changed = uint8_matmul_weights(model)
    assert len(changed) == 2  # the weight, and its zero point (an absent one added as 128)
    onnx.checker.check_model(model)
    assert set(matmul_integer_weights(model).values()) == {TensorProto.UINT8}
    for a in ([255, 255], [0, 0], [1, 2], [200, 13]):
        assert _run(model, a) == 127 * (a[0] + a[1])
    assert uint8_matmul_weights(model) == []  # done once: nothing left to rewrite


def test_negative_weights_and_zero_points_other_than_zero_keep_their_integers() -> None:
    weight = numpy_helper.from_array(np.array([[-128], [5]], dtype=np.int8), "w")
    model = _matmul_integer(weight, ZERO_POINT_RAW)
    assert uint8_matmul_weights(model) == ["w", "w_zp"]
    assert _run(model, [255, 3]) == -128 * 255 + 5 * 3
    shifted = numpy_helper.from_array(np.array([-3], dtype=np.int8), "w_zp")  # (w - (-3))
    model = _matmul_integer(weight, shifted)
    uint8_matmul_weights(model)
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert arrays["w"].tolist() == [[0], [133]] and arrays["w_zp"].tolist() == [125]
    assert _run(model, [255, 3]) == (-128 + 3) * 255 + (5 + 3) * 3


@pytest.mark.parametrize("file", ["encoder.onnx", "encoder.knn.onnx"])
def test_the_shipped_graphs_int8_form_rewrites_to_the_shipped_arrays(file: str) -> None:
    shipped = onnx.load(str(MODEL_DIR / file))
    weights = matmul_integer_weights(shipped)
    int8 = onnx.ModelProto()
    int8.CopyFrom(shipped)
    for tensor in int8.graph.initializer:  # back to what quantize_dynamic wrote
        if tensor.name in weights:
            array = numpy_helper.to_array(tensor).astype(np.int16) - 128
            tensor.CopyFrom(numpy_helper.from_array(array.astype(np.int8), tensor.name))
    assert set(matmul_integer_weights(int8).values()) == {TensorProto.INT8}
    assert sorted(uint8_matmul_weights(int8)) == sorted(weights)
    have = {t.name: numpy_helper.to_array(t) for t in int8.graph.initializer}
    want = {t.name: numpy_helper.to_array(t) for t in shipped.graph.initializer}
    assert have.keys() == want.keys()
    for name, array in want.items():
        assert have[name].dtype == array.dtype and np.array_equal(have[name], array), name
    assert [n.SerializeToString() for n in int8.graph.node] == [n.SerializeToString() for n in shipped.graph.node]
    if file == "encoder.onnx":  # the word-embedding table feeds a Gather: it stays int8
        assert any(t.data_type == TensorProto.INT8 for t in shipped.graph.initializer)


def test_what_it_cannot_prove_exact_is_refused_and_left_as_it_was() -> None:
    gather = helper.make_node("Gather", ["w", "idx"], ["g"])
    cases = {
        "also read by Gather": _matmul_integer(
            WEIGHT, ZERO_POINT_RAW, extra_nodes=(helper.make_node("Constant", [], ["idx"], value_int=0), gather),
            extra_outputs=(helper.make_tensor_value_info("g", TensorProto.INT8, [1]),),
        ),
        "not an int8 initializer": _matmul_integer(  # a graph input could override it
            WEIGHT, ZERO_POINT_RAW, declared_inputs=(helper.make_tensor_value_info("w", TensorProto.INT8, [2, 1]),)
        ),
    }  # fmt: skip
    uint8_zero_point = numpy_helper.from_array(np.array([128], dtype=np.uint8), "w_zp")
    mixed = _matmul_integer(WEIGHT, ZERO_POINT_RAW)
    mixed.graph.initializer[-1].CopyFrom(uint8_zero_point)
    cases["'w_zp' is not an int8 initializer (UINT8)"] = mixed
    for why, model in cases.items():
        before = model.SerializeToString()
        with pytest.raises(ValueError, match=re.escape(why)):
            uint8_matmul_weights(model)
        assert model.SerializeToString() == before, why
    branch = helper.make_graph([helper.make_node("Identity", ["a"], ["b"])], "b", [],
                               [helper.make_tensor_value_info("b", TensorProto.UINT8, [1, 2])])  # fmt: skip
    with_if = _matmul_integer(WEIGHT, ZERO_POINT_RAW)
    with_if.graph.node.append(helper.make_node("If", ["cond"], ["c"], then_branch=branch, else_branch=branch))
    with pytest.raises(ValueError, match="subgraph"):
        uint8_matmul_weights(with_if)


def test_export_writes_a_checked_file_and_may_rewrite_in_place(tmp_path: Path) -> None:
    source = tmp_path / "int8.onnx"
    onnx.save(_matmul_integer(WEIGHT, ZERO_POINT_PACKED), str(source))
    target = tmp_path / "uint8.onnx"
    assert export_uint8(source, target) == ["w", "w_zp"]
    assert _run(onnx.load(str(target)), [255, 255]) == 64_770
    assert export_uint8(source, source) == ["w", "w_zp"]
    assert source.read_bytes() == target.read_bytes()
    assert export_uint8(target, target) == [] and source.read_bytes() == target.read_bytes()
