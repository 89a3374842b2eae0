"""Step 4 (research): the fine-tuned MiniLM regressor (research/finetune_minilm.py) as ONE ONNX graph,
input_ids + attention_mask [1, T] int64 -> ln tokens [1] (encoder, mean pooling and head inside the graph),
then int8 dynamic quantization with onnxruntime.quantization. Runs in the torch venv; serving would need only
onnxruntime + `tokenizers` (tokenizer.json).

    nice -n 10 /tmp/encvenv/bin/python research/export_minilm_onnx.py --state /tmp/rcache/ft/model.pt --out /tmp/rcache/enc
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from finetune_minilm import MODEL_DIR, Regressor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = Regressor()
    model.load_state_dict(torch.load(args.state, map_location="cpu"))
    model.eval()
    ids = torch.ones((1, 16), dtype=torch.int64)
    mask = torch.ones((1, 16), dtype=torch.int64)
    fp32 = args.out / "minilm_regressor.fp32.onnx"
    torch.onnx.export(model, (ids, mask), str(fp32), input_names=["input_ids", "attention_mask"],
                      output_names=["log_tokens"], dynamic_axes={"input_ids": {0: "batch", 1: "tokens"},
                                                                 "attention_mask": {0: "batch", 1: "tokens"},
                                                                 "log_tokens": {0: "batch"}},
                      opset_version=17, dynamo=False)
    shutil.copy(MODEL_DIR / "tokenizer.json", args.out / "tokenizer.json")
    print("exported", fp32, fp32.stat().st_size)


if __name__ == "__main__":
    main()
