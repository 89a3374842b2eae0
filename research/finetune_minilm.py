"""Step-1 candidate d: fine-tune MiniLM-L6 (mean pooling + a linear head) on log answer tokens, CPU only.

Training rows: the English training side of the leak-free ShareGPT split (never AlpacaEval): every first turn
plus as many later turns, shuffled. Loss: MSE on standardised log tokens. AlpacaEval dev (4 models) and 600
held-out first turns are scored every --eval-every steps (scoring only; the AlpacaEval file never feeds a
gradient). Saves the final model (and its trajectory) under --out.

    nice -n 10 /tmp/encvenv/bin/python research/finetune_minilm.py --out /tmp/rcache/ft --minutes 35
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import kendalltau
from transformers import AutoModel, AutoTokenizer

CACHE = Path("/tmp/rcache")
MODEL_DIR = Path("/tmp/minilm_pkg/model")


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = AutoModel.from_pretrained(MODEL_DIR)
        self.head = torch.nn.Linear(384, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_: object) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return self.head(pooled).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=35)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--later-ratio", type=float, default=1.0)
    parser.add_argument("--resume", type=Path, help="a --out folder of an earlier run: continue from its model and step")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(42)
    s = np.load(CACHE / "sharegpt.npz")
    a = np.load(CACHE / "alpaca.npz")
    texts = [json.loads(line)["instruction"] for line in (CACHE / "texts.jsonl").read_text().splitlines()]
    atexts = [json.loads(line)["instruction"] for line in (CACHE / "alpaca_texts.jsonl").read_text().splitlines()]
    log_tokens = np.log(np.maximum(s["tokens"], 1)).astype(np.float32)
    rng = np.random.default_rng(42)
    train = ~s["test"] & s["english"]
    first = np.flatnonzero(train & (s["turn"] == 0))
    later = np.flatnonzero(train & (s["turn"] > 0))
    later = rng.choice(later, size=min(len(later), int(len(first) * args.later_ratio)), replace=False)
    rows = rng.permutation(np.concatenate([first, later]))
    mean, std = float(log_tokens[rows].mean()), float(log_tokens[rows].std())
    held = rng.choice(np.flatnonzero(s["test"] & s["english"] & (s["turn"] == 0)), size=600, replace=False)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = Regressor()
    with torch.no_grad():
        model.head.bias.fill_(0.0)
    first_step = 0
    previous: list = []
    if args.resume:
        model.load_state_dict(torch.load(args.resume / "model.pt", map_location="cpu"))
        earlier = json.loads((args.resume / "trajectory.json").read_text())
        first_step, previous = int(earlier["steps"]), earlier["trajectory"]
        print(f"resuming at step {first_step}", flush=True)
    steps_per_epoch = len(rows) // args.batch
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # warm-up then linear decay over one epoch; a resumed run continues the schedule where it stopped
    # (AdamW's moments restart from zero: a short re-warm-up of 20 steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / (20 if first_step else 50)) * max(0.05, 1 - (k + first_step) / steps_per_epoch))

    def score(batch_texts: list[str]) -> np.ndarray:
        model.eval()
        out = []
        with torch.inference_mode():
            for b in range(0, len(batch_texts), 64):
                enc = tok([t[:4000] for t in batch_texts[b : b + 64]], padding=True, truncation=True,
                          max_length=args.max_tokens, return_tensors="pt")
                out.append(model(**enc).numpy())
        model.train()
        return np.concatenate(out)

    def evaluate(step: int, elapsed: float) -> dict:
        sa = score(atexts)
        per = [float(kendalltau(sa, a["lengths"][:, m], variant="b").statistic) for m in range(4)]
        sh = score([texts[i] for i in held])
        h = float(kendalltau(sh, s["tokens"][held], variant="b").statistic)
        entry = {"step": step, "elapsed_s": round(elapsed), "alpaca": per, "alpaca_mean": float(np.mean(per)),
                 "heldout_first600": h}
        print(json.dumps(entry), flush=True)
        return entry

    args.out.mkdir(parents=True, exist_ok=True)
    trajectory = previous or [evaluate(0, 0.0)]
    start = time.perf_counter()
    model.train()
    step = first_step
    for b in range(first_step * args.batch, steps_per_epoch * args.batch, args.batch):
        idx = rows[b : b + args.batch]
        enc = tok([texts[i][:4000] for i in idx], padding=True, truncation=True, max_length=args.max_tokens,
                  return_tensors="pt")
        target = torch.from_numpy((log_tokens[idx] - mean) / std)
        loss = torch.nn.functional.mse_loss(model(**enc), target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        elapsed = time.perf_counter() - start
        if step % args.eval_every == 0:
            trajectory.append(evaluate(step, elapsed))
        if elapsed > args.minutes * 60:
            break
    if not trajectory or trajectory[-1]["step"] != step:
        trajectory.append(evaluate(step, time.perf_counter() - start))
    torch.save(model.state_dict(), args.out / "model.pt")
    (args.out / "trajectory.json").write_text(json.dumps({"rows": len(rows), "steps": step, "batch": args.batch,
                                                          "mean": mean, "std": std, "trajectory": trajectory}, indent=1))


if __name__ == "__main__":
    main()
