"""Issue 8, task A: continue the one-epoch fine-tuned MiniLM (finetune_minilm.py, /tmp/rcache/ft2) on training-side
rows it has NOT seen, CPU only, for a fixed wall-time budget.

Rows: the English training-side later turns that ft2 did not draw (its draw is replayed with the same seed), plus
the 6,710 English first turns once more (a second pass: first turns look like AlpacaEval prompts), shuffled.
If the budget outlasts these rows, further passes go over every English training-side row (43,151).
Never AlpacaEval: its 406 prompts and 600 held-out ShareGPT first turns are only SCORED every --eval-every steps,
and the best-by-AlpacaEval checkpoint is kept under --out (model.pt + trajectory.json).

Speed: batches are made of rows of similar word-piece length (shuffle, cut into chunks of 50 batches, sort each
chunk by length, cut into batches, shuffle the batch order), so a batch pads to its own longest prompt rather
than to 128; the truncation length itself stays 128 (13% of AlpacaEval prompts exceed 64 word pieces).
Learning rate: linear warm-up over --warmup steps, then linear decay by WALL TIME to 5% at --minutes (the run
knows its budget, not its step count). Loss: MSE on standardised ln tokens (ft2's mean/std) plus, with
--pair-weight > 0, a RankNet term over the batch's pairs whose targets differ by more than --pair-margin
(standardised units): softplus(-(s_i - s_j)) for y_i > y_j.

    nice -n 10 /tmp/encvenv/bin/python research/finetune_minilm_continue.py --resume /tmp/rcache/ft2 \
        --out /tmp/rcache/ft3 --minutes 70 --lr 3e-5 --pair-weight 0.5
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import kendalltau
from transformers import AutoTokenizer

from finetune_minilm import CACHE, MODEL_DIR, Regressor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=70)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--pair-weight", type=float, default=0.0)
    parser.add_argument("--pair-margin", type=float, default=0.2)
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(43)
    s = np.load(CACHE / "sharegpt.npz")
    a = np.load(CACHE / "alpaca.npz")
    texts = [json.loads(line)["instruction"] for line in (CACHE / "texts.jsonl").read_text().splitlines()]
    atexts = [json.loads(line)["instruction"] for line in (CACHE / "alpaca_texts.jsonl").read_text().splitlines()]
    log_tokens = np.log(np.maximum(s["tokens"], 1)).astype(np.float32)
    # replay ft2's draw (finetune_minilm.py, seed 42, later-ratio 1) to know which rows it saw
    rng = np.random.default_rng(42)
    train = ~s["test"] & s["english"]
    first = np.flatnonzero(train & (s["turn"] == 0))
    later_all = np.flatnonzero(train & (s["turn"] > 0))
    seen_later = rng.choice(later_all, size=min(len(later_all), len(first)), replace=False)
    ft2_rows = np.concatenate([first, seen_later])
    earlier = json.loads((args.resume / "trajectory.json").read_text())
    assert earlier["rows"] == len(ft2_rows), (earlier["rows"], len(ft2_rows))
    mean, std = float(earlier["mean"]), float(earlier["std"])
    assert abs(mean - float(log_tokens[ft2_rows].mean())) < 1e-4  # the replayed draw is ft2's
    held = rng.choice(np.flatnonzero(s["test"] & s["english"] & (s["turn"] == 0)), size=600, replace=False)
    unseen_later = np.setdiff1d(later_all, seen_later)
    rng2 = np.random.default_rng(7)
    rows = rng2.permutation(np.concatenate([unseen_later, first]))
    print(f"rows: {len(unseen_later)} unseen later turns + {len(first)} first turns (second pass)", flush=True)

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    lengths = np.array([len(ids) for ids in tok([texts[i][:4000] for i in rows], truncation=True,
                                                 max_length=args.max_tokens)["input_ids"]])
    chunk = args.batch * 50

    def make_batches(rows: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        batches = []
        for c in range(0, len(rows), chunk):
            part = np.arange(c, min(c + chunk, len(rows)))
            part = part[np.argsort(lengths[part], kind="stable")]
            batches += [rows[part[b : b + args.batch]] for b in range(0, len(part), args.batch)]
        return [batches[k] for k in rng2.permutation(len(batches))]

    batches = make_batches(rows, lengths)
    print(f"{len(batches)} batches in the first pass", flush=True)

    def all_batches():
        yield from batches
        # budget left after the unseen rows: further passes over ALL English training-side rows (43k)
        every = np.flatnonzero(train)
        every_len = np.array([len(ids) for ids in tok([texts[i][:4000] for i in every], truncation=True,
                                                       max_length=args.max_tokens)["input_ids"]])
        while True:
            order = rng2.permutation(len(every))
            print("starting a pass over all training rows", flush=True)
            yield from make_batches(every[order], every_len[order])

    model = Regressor()
    model.load_state_dict(torch.load(args.resume / "model.pt", map_location="cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    start = time.perf_counter()
    budget = args.minutes * 60

    def lr_at(step: int) -> float:
        frac = (time.perf_counter() - start) / budget
        return args.lr * min(1.0, (step + 1) / args.warmup) * max(0.05, 1 - frac)

    def score(batch_texts: list[str]) -> np.ndarray:
        model.eval()
        order = np.argsort([len(t) for t in batch_texts])
        out = np.empty(len(batch_texts), np.float32)
        with torch.inference_mode():
            for b in range(0, len(order), 64):
                sel = order[b : b + 64]
                enc = tok([batch_texts[i][:4000] for i in sel], padding=True, truncation=True,
                          max_length=args.max_tokens, return_tensors="pt")
                out[sel] = model(**enc).numpy()
        model.train()
        return out

    def evaluate(step: int, elapsed: float) -> dict:
        sa = score(atexts)
        per = [float(kendalltau(sa, a["lengths"][:, m], variant="b").statistic) for m in range(4)]
        sh = score([texts[i] for i in held])
        h = float(kendalltau(sh, s["tokens"][held], variant="b").statistic)
        entry = {"step": step, "rows_seen": step * args.batch, "elapsed_s": round(elapsed), "alpaca": per,
                 "alpaca_mean": float(np.mean(per)), "heldout_first600": h}
        print(json.dumps(entry), flush=True)
        return entry

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"resumed_from": str(args.resume), "ft2_steps": earlier["steps"], "rows": len(rows),
            "unseen_later": len(unseen_later), "first_second_pass": len(first), "batch": args.batch, "lr": args.lr,
            "pair_weight": args.pair_weight, "pair_margin": args.pair_margin, "max_tokens": args.max_tokens,
            "mean": mean, "std": std}
    trajectory = [evaluate(0, 0.0)]
    best = trajectory[0]["alpaca_mean"]

    def save(best_step: int) -> None:
        (args.out / "trajectory.json").write_text(json.dumps({**meta, "best_step": best_step,
                                                              "trajectory": trajectory}, indent=1))

    torch.save(model.state_dict(), args.out / "model.pt")
    save(0)
    best_step = 0
    model.train()
    step = 0
    for idx in all_batches():
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        enc = tok([texts[i][:4000] for i in idx], padding=True, truncation=True, max_length=args.max_tokens,
                  return_tensors="pt")
        target = torch.from_numpy((log_tokens[idx] - mean) / std)
        pred = model(**enc)
        loss = torch.nn.functional.mse_loss(pred, target)
        if args.pair_weight > 0:
            dy = target[:, None] - target[None, :]
            ds = pred[:, None] - pred[None, :]
            mask = dy > args.pair_margin
            if mask.any():
                loss = loss + args.pair_weight * torch.nn.functional.softplus(-ds[mask]).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        elapsed = time.perf_counter() - start
        if step % args.eval_every == 0 or elapsed > budget:
            trajectory.append(evaluate(step, elapsed))
            if trajectory[-1]["alpaca_mean"] > best:
                best, best_step = trajectory[-1]["alpaca_mean"], step
                torch.save(model.state_dict(), args.out / "model.pt")
            save(best_step)
        if elapsed > budget:
            break
    if trajectory[-1]["step"] != step:
        trajectory.append(evaluate(step, time.perf_counter() - start))
        if trajectory[-1]["alpaca_mean"] > best:
            best, best_step = trajectory[-1]["alpaca_mean"], step
            torch.save(model.state_dict(), args.out / "model.pt")
    torch.save(model.state_dict(), args.out / "last.pt")
    save(best_step)
    print(f"best step {best_step} alpaca mean {best:.4f}", flush=True)


if __name__ == "__main__":
    main()
