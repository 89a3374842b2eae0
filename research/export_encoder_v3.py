"""Issue 8, task B: the fine-tuned MiniLM regressor (finetune_minilm_continue.py) as ONE ONNX graph with two
outputs, and smaller variants of it built with onnx + numpy.

Graph: input_ids, attention_mask [N, T] int64 -> log_tokens [N] (ln answer tokens: the head's standardised output
times the training std plus the mean, folded into the head) and embedding [N, 384] (the mean-pooled vector the
head reads, for an online learner). Variants, each written to --out/variants/:
  fp32          the export as is
  fp16          every float initializer of >= 1024 values stored as float16, a Cast to float32 after each
                (a valid graph as it stands; load_encoder() folds the casts at load: the session holds fp32)
  emb8          the word-embedding table int8 per row (a float32 scale per word piece): Gather(int8) and
                Gather(scale), Cast, Mul -> the same [N, T, 384] floats; everything else fp32
  emb8_fp16     emb8 + fp16-stored initializers for the rest
  emb8_mm8      emb8 + onnxruntime dynamic quantization of the MatMuls only, per-channel int8 weights
The loader (load_encoder) needs onnx + numpy + onnxruntime only.

    nice -n 10 /tmp/encvenv/bin/python research/export_encoder_v3.py --state /tmp/rcache/ft3/model.pt \
        --trajectory /tmp/rcache/ft3/trajectory.json --out /tmp/rcache/enc3
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FP16_MIN_VALUES = 1024


def export_fp32(state: Path, mean: float, std: float, path: Path) -> None:
    import torch

    from finetune_minilm import MODEL_DIR, Regressor

    class TwoOutputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Regressor()
            self.inner.load_state_dict(torch.load(state, map_location="cpu"))
            with torch.no_grad():  # standardised output -> ln tokens, inside the head
                self.inner.head.weight.mul_(std)
                self.inner.head.bias.mul_(std).add_(mean)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
            hidden = self.inner.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return self.inner.head(pooled).squeeze(-1), pooled

    model = TwoOutputs().eval()
    ids = torch.ones((2, 16), dtype=torch.int64)
    torch.onnx.export(model, (ids, torch.ones_like(ids)), str(path), input_names=["input_ids", "attention_mask"],
                      output_names=["log_tokens", "embedding"],
                      dynamic_axes={"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"},
                                    "log_tokens": {0: "batch"}, "embedding": {0: "batch"}},
                      opset_version=17, dynamo=False)
    shutil.copy(MODEL_DIR / "tokenizer.json", path.parent / "tokenizer.json")


def _word_gather(model: onnx.ModelProto) -> tuple[onnx.NodeProto, onnx.TensorProto]:
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Gather" and node.input[0] in inits and node.input[1] == "input_ids":
            return node, inits[node.input[0]]
    raise ValueError("no Gather of input_ids on an initializer")


def int8_word_embeddings(model: onnx.ModelProto) -> onnx.ModelProto:
    """Word-embedding table -> int8 per row (symmetric, scale = max|row| / 127) + a float32 scale per row."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    node, table = _word_gather(model)
    w = numpy_helper.to_array(table).astype(np.float32)
    scale = np.maximum(np.abs(w).max(axis=1, keepdims=True), 1e-12) / 127.0
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    name, out = table.name, node.output[0]
    model.graph.initializer.remove(table)
    model.graph.initializer.extend([numpy_helper.from_array(q, name + "_int8"),
                                    numpy_helper.from_array(scale.astype(np.float32), name + "_scale")])
    nodes = [
        helper.make_node("Gather", [name + "_int8", "input_ids"], [out + "_q"], axis=0),
        helper.make_node("Gather", [name + "_scale", "input_ids"], [out + "_s"], axis=0),
        helper.make_node("Cast", [out + "_q"], [out + "_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", [out + "_f", out + "_s"], [out]),
    ]
    at = list(model.graph.node).index(node)
    model.graph.node.remove(node)
    for k, n in enumerate(nodes):
        model.graph.node.insert(at + k, n)
    return model


def fp16_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """Float initializers of >= FP16_MIN_VALUES values stored as float16, each followed by a Cast to float32."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    casts = []
    for init in list(model.graph.initializer):
        if init.data_type != TensorProto.FLOAT or int(np.prod(init.dims)) < FP16_MIN_VALUES:
            continue
        w = numpy_helper.to_array(init)
        name = init.name
        model.graph.initializer.remove(init)
        model.graph.initializer.append(numpy_helper.from_array(w.astype(np.float16), name + "_fp16"))
        casts.append(helper.make_node("Cast", [name + "_fp16"], [name], to=TensorProto.FLOAT, name="upcast_" + name))
    for k, n in enumerate(casts):
        model.graph.node.insert(k, n)
    return model


def load_encoder(path: Path, threads: int = 1):
    """An onnxruntime session for an exported encoder: fp16-stored initializers (Cast nodes named upcast_*) are
    upcast to float32 here, so the session runs the fp32 graph. onnx + numpy + onnxruntime only."""
    import onnxruntime as ort

    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    for node in [n for n in model.graph.node if n.op_type == "Cast" and n.name.startswith("upcast_")]:
        src = inits.pop(node.input[0])
        model.graph.initializer.remove(src)
        model.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(src).astype(np.float32),
                                                               node.output[0]))
        model.graph.node.remove(node)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--trajectory", type=Path, required=True, help="its run's trajectory.json (mean, std)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    meta = json.loads(args.trajectory.read_text())
    var = args.out / "variants"
    var.mkdir(parents=True, exist_ok=True)
    fp32 = var / "fp32.onnx"
    export_fp32(args.state, float(meta["mean"]), float(meta["std"]), fp32)
    shutil.move(var / "tokenizer.json", args.out / "tokenizer.json")
    base = onnx.load(str(fp32))
    onnx.save(fp16_initializers(base), str(var / "fp16.onnx"))
    emb8 = int8_word_embeddings(base)
    onnx.save(emb8, str(var / "emb8.onnx"))
    onnx.save(fp16_initializers(emb8), str(var / "emb8_fp16.onnx"))
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(var / "emb8.onnx"), str(var / "emb8_mm8.onnx"), weight_type=QuantType.QInt8,
                     per_channel=True, op_types_to_quantize=["MatMul"])
    for p in sorted(var.glob("*.onnx")):
        print(p.name, p.stat().st_size, flush=True)


if __name__ == "__main__":
    main()
