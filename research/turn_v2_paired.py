"""Paired bootstrap: V2 (head+tail) vs the turn-aware baseline, AlpacaEval prompts and held-out conversation groups."""
import sys
from pathlib import Path
import numpy as np
from scipy.stats import kendalltau
sys.path.insert(0, "research")
from turn_variants import head_tail_scores, W_FIRST
from clairvoyant.prediction.encoder import EncoderModel
from clairvoyant.tools.training.dataset import load_pairs
from clairvoyant.tools.training.scoring import ModelScorer

ROOT = Path(".")
s, a = np.load("/tmp/turn/scores.npz"), np.load("/tmp/turn/study.alpaca.npz")
enc = EncoderModel(ROOT / "model" / "encoder.card.json")
pairs = load_pairs()
from clairvoyant.tools.training.evaluate import load_alpaca_eval
al = load_alpaca_eval(Path("/work/shared/data/alpaca_eval_dev.jsonl"))
a_ht, a_long = head_tail_scores(enc, [p.instruction for p in al.prompts])
held = s["kind"] == 3
rows = s["rows"][held]
texts = [pairs[i].prompt.instruction for i in rows]
from tokenizers import Tokenizer
tok = Tokenizer.from_file(str(enc.card.tokenizer_path)); tok.no_truncation(); tok.no_padding()
long_idx = [i for i, t in enumerate(texts) if len(tok.encode(t[:4000].encode("utf-8", "replace").decode("utf-8")).ids) > 128]
h_ht = s["enc"][held].astype(np.float64).copy()
vals, _ = head_tail_scores(enc, [texts[i] for i in long_idx])
h_ht[long_idx] = vals
np.savez("/tmp/turn/v2_scores.npz", a_ht=a_ht, h_ht=h_ht, long_idx=np.array(long_idx))
scorer = ModelScorer(ROOT / "model" / "predictor.onnx")
col = scorer.feature_set.names.index("history_chars")
hist = scorer.features([pairs[i].prompt for i in rows])[:, col]
w = np.where(hist > 0, 0.45, W_FIRST)
hp, he, ht = s["prior"][held], s["enc"][held], s["tokens"][held]
base_h, v2_h = hp + w * (he - hp), hp + w * (h_ht - hp)
base_a, v2_a = a["prior"] + W_FIRST * (a["enc"] - a["prior"]), a["prior"] + W_FIRST * (a_ht - a["prior"])
L = a["lengths"]
t = lambda x, y: kendalltau(x, y, variant="b").statistic
rng = np.random.default_rng(0)
da = []
for _ in range(1000):
    b = rng.integers(0, len(L), len(L))
    da.append(np.mean([t(v2_a[b], L[b, j]) - t(base_a[b], L[b, j]) for j in range(4)]))
groups = np.array([pairs[i].group for i in rows])
ug, inv = np.unique(groups, return_inverse=True)
members = [np.flatnonzero(inv == g) for g in range(len(ug))]
dh = []
for _ in range(200):
    gb = rng.integers(0, len(ug), len(ug))
    b = np.concatenate([members[g] for g in gb])
    dh.append(t(v2_h[b], ht[b]) - t(base_h[b], ht[b]))
print(f"AlpacaEval: V2 - baseline {np.mean([t(v2_a, L[:, j]) - t(base_a, L[:, j]) for j in range(4)]):+.4f}, paired bootstrap (1000 prompt resamples) p5..p95 {np.percentile(da,5):+.4f}..{np.percentile(da,95):+.4f}, share > 0 {np.mean(np.array(da) > 0):.2f}")
print(f"held-out all turns: V2 - baseline {t(v2_h, ht) - t(base_h, ht):+.4f}, paired bootstrap (200 group resamples) p5..p95 {np.percentile(dh,5):+.4f}..{np.percentile(dh,95):+.4f}, share > 0 {np.mean(np.array(dh) > 0):.2f}; {len(long_idx)} long held-out instructions")
