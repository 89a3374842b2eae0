"""Issue 8, brief TURN, idea 1 step 3: out-of-fold lexical priors for the training rows.

The shipped lexical model (model/predictor.onnx, `clairvoyant train`, preset shipped) was trained on EVERY natural
training row, and its lexicon column (src/clairvoyant/lexicons/rich_v3.json) was fit on them too, so its prior on a
training row is in-sample. This script retrains the shipped recipe K times (group K-fold over the training split's
conversation groups, K = 5) and scores each fold's rows with the model that never saw them:

  per outer fold: lexicon fit on the other folds (tools/training/lexicon.fit_lexicon) -> the fold's lexicon column;
  the training rows' lexicon column out of fold (lexicon.out_of_fold_scores, 5 inner group folds, as
  commands_train.lexicon_column_for_training does); XGBoost PRESETS["shipped"] (train.fit_regressor); isotonic
  calibration on its own training rows (calibration.isotonic_breakpoints); prior = calibrated ln tokens.

With --check, the recipe is also run once on the whole training split and compared with the shipped ONNX on the
held-out rows (it must reproduce it: same tau_b, near-identical scores), so the folds are the shipped recipe.

    PYTHONPATH=src nice -n 10 /work/main/.venv/bin/python research/turn_oof_lexical.py --out /tmp/turn/oof.npz --check
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np
from sklearn.model_selection import GroupKFold

from clairvoyant.prediction.features import get_feature_set
from clairvoyant.tools.training import calibration
from clairvoyant.tools.training.dataset import NaturalConfig, build_natural_split, load_pairs
from clairvoyant.tools.training.lexicon import LexiconConfig, fit_lexicon, out_of_fold_scores, score_terms, terms_of_texts
from clairvoyant.tools.training.metrics import kendall_tau
from clairvoyant.tools.training.scoring import ModelScorer
from clairvoyant.tools.training.train import PRESETS, featurize, fit_regressor

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    pairs = load_pairs()
    split = build_natural_split(pairs, NaturalConfig())
    config = PRESETS["shipped"]
    fs = get_feature_set(config.feature_set)
    column = fs.names.index("lexicon_log_tokens")
    lex_config = LexiconConfig()  # min_rows 20, ridge_alpha 3.0: the shipped lexicon's config
    train = split.train
    x_all = featurize(fs, [p.prompt for p in train])
    terms = terms_of_texts([p.prompt.instruction for p in train])
    y = split.train_log_tokens
    groups = np.array([p.group for p in train])
    key_index = {p.key: i for i, p in enumerate(pairs)}
    rows = np.array([key_index[p.key] for p in train], dtype=np.int64)

    def recipe(fit_idx: np.ndarray, score_idx: np.ndarray | None, x_score: np.ndarray | None = None):  # noqa: ANN202
        """The shipped recipe on train[fit_idx]; returns (regressor, calibration, calibrated prior of the scored rows)."""
        x_fit = x_all[fit_idx].copy()
        x_fit[:, column] = out_of_fold_scores([terms[i] for i in fit_idx], y[fit_idx], groups[fit_idx], lex_config,
                                              folds=5).astype(np.float32)
        lexicon = fit_lexicon([terms[i] for i in fit_idx], y[fit_idx], lex_config)
        reg = fit_regressor(x_fit, y[fit_idx], config, threads=2)
        calib = calibration.isotonic_breakpoints(reg.predict(x_fit), y[fit_idx])
        if x_score is None:
            x_score = x_all[score_idx].copy()
            x_score[:, column] = score_terms(lexicon, [terms[i] for i in score_idx]).astype(np.float32)
        else:
            x_score = x_score.copy()
            x_score[:, column] = score_terms(lexicon, terms_of_texts(test_instructions)).astype(np.float32)
        raw = reg.predict(x_score).astype(np.float64)
        return raw, calibration.apply(calib, raw)

    test_instructions = [p.prompt.instruction for p in split.test]
    oof_raw = np.full(len(train), np.nan)
    oof_prior = np.full(len(train), np.nan)
    fold_of = np.full(len(train), -1)
    for k, (fit_idx, score_idx) in enumerate(GroupKFold(args.folds).split(x_all, groups=groups)):
        started = time.perf_counter()
        oof_raw[score_idx], oof_prior[score_idx] = recipe(fit_idx, score_idx)
        fold_of[score_idx] = k
        print(f"fold {k}: fit {len(fit_idx)} rows, scored {len(score_idx)}, {time.perf_counter() - started:.0f} s; "
              f"fold tau_b {kendall_tau(oof_raw[score_idx], split.train_lengths[score_idx]):.4f}", flush=True)
    result = {"rows": rows, "oof_raw": oof_raw, "oof_prior": oof_prior, "fold": fold_of}
    if args.check:
        x_test = featurize(fs, [p.prompt for p in split.test])
        raw_t, _ = recipe(np.arange(len(train)), None, x_test)
        shipped = ModelScorer(ROOT / "model" / "predictor.onnx").score_prompts([p.prompt for p in split.test])
        print(f"check, whole training split: held-out tau_b recipe {kendall_tau(raw_t, split.test_lengths):.4f} vs "
              f"shipped {kendall_tau(shipped, split.test_lengths):.4f}; max |raw diff| "
              f"{np.abs(raw_t - shipped).max():.2e}, mean {np.abs(raw_t - shipped).mean():.2e}", flush=True)
        result["check_max_abs_diff"] = np.array(np.abs(raw_t - shipped).max())
    np.savez(args.out, **result)
    print("saved", args.out)


if __name__ == "__main__":
    main()
