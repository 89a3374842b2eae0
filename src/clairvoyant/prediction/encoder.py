"""A second opinion for requests that wait: a fine-tuned MiniLM encoder of the instruction.

The lexical predictor (``predictor.OnnxPredictor``) scores every request in tens of microseconds.
The encoder reads the same instruction (the last user turn: all of it up to ``max_word_pieces``
word pieces; a longer one as its first pieces and its last ``tail_word_pieces``, where a long
pasted text usually ends with the actual request) with a small transformer fine-tuned on ShareGPT
answer lengths, and ranks prompts unlike the training data better (``model/MODEL_CARD.md`` gives
both figures). It costs milliseconds, so it never stands in a request's way:

- a request that finds a free slot is never refined (there is no order to decide); with online
  learning on it is encoded after it completes, for the learner, within ``LEARNING_SHARE`` of
  the thread's time (``Refiner.encode_later``);
- a request that waits is handed to ``Refiner``, one background thread; when its turn comes and
  it is still waiting, the encoder's log tokens are blended into its prediction and the queue
  re-keys it (``Dispatcher.repredicted``). A request dispatched meanwhile is skipped.

Blend, in log tokens, with the weights of the encoder's card (``predictor.BlendWeights``):

    refined prior = lexical prior + w x (encoder log tokens - lexical prior)
    final prior = refined prior + v x (kNN log tokens - refined prior)

w is ``blend_weight_with_history`` for a request with conversation history (history_chars > 0),
which the encoder cannot see, and ``blend_weight`` otherwise. The kNN (a card's ``knn`` block,
``model/ENCODER_CARD.md``), run on the same thread right after the encoder, is the cosine-weighted
mean ln tokens of the 16 training-side ShareGPT instructions nearest to the request's pooled
embedding. The learner's after-completion encodes need only the components and the pooled embedding
(the key of the learner's residual kNN), from the same run, and never run the kNN graph. The learned
correction and the request's cap then apply as to a lexical prediction (``OnnxPredictor.refined``).
Serving needs onnxruntime and ``tokenizers`` only: no torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clairvoyant.errors import ModelError
from clairvoyant.prediction.predictor import BlendWeights, OnnxPredictor, Prediction, single_threaded_session

__all__ = ["DEFAULT_ENCODER_CARD", "EncoderCard", "EncoderModel", "Refiner", "encoder_for", "refined_by"]

logger = logging.getLogger(__name__)

DEFAULT_ENCODER_CARD = Path(__file__).resolve().parent.parent / "model" / "encoder.card.json"

# The instruction is cut before tokenizing: the encoder reads at most max_word_pieces word pieces,
# which never need more than about 6 characters each; the cut bounds both the work and what a
# pending request holds.
_CHARS_PER_WORD_PIECE = 8


@dataclass(frozen=True, slots=True)
class CardFile:
    """A file an encoder card names, and the sha256 it must have."""

    path: Path
    sha256: str

    def read(self) -> bytes:
        if not self.path.is_file():
            raise ModelError(f"encoder file {self.path} not found")
        content = self.path.read_bytes()
        if hashlib.sha256(content).hexdigest() != self.sha256:
            raise ModelError(f"encoder file {self.path} does not match the sha256 in its card")
        return content


@dataclass(frozen=True, slots=True)
class EncoderCard:
    """What the encoder's card promises (``encoder.card.json``)."""

    onnx: CardFile
    tokenizer: CardFile
    knn: CardFile | None  # the card's "knn" block: embedding -> its neighbours' ln tokens (None: no kNN)
    max_word_pieces: int  # word pieces read at most, [CLS] and [SEP] included (the training cut)
    tail_word_pieces: int  # a longer instruction: its last N pieces are read after its first ones (0: first only)
    blend_weights: BlendWeights  # the card's blend_weight, blend_weight_with_history and knn.blend_weight
    output: str  # the graph's ln(answer tokens) output
    raw: dict[str, Any]  # the whole card (training, metrics), for reports

    @classmethod
    def load(cls, card_path: Path) -> EncoderCard:
        folder = card_path.parent
        try:
            raw = json.loads(card_path.read_text())
            knn = raw.get("knn")
            weights = {
                "blend_weight": float(raw["blend_weight"]),
                # a card from before the turn-aware blend: one weight for every request
                "blend_weight_with_history": float(raw.get("blend_weight_with_history", raw["blend_weight"])),
                "knn_weight": 0.0 if knn is None else float(knn["blend_weight"]),
            }
            for name, weight in weights.items():
                if not 0.0 <= weight <= 1.0:
                    raise ModelError(f"encoder card {card_path}: {name} {weight} is not in [0, 1]")
            card = cls(
                onnx=CardFile(folder / raw["onnx_file"], str(raw["onnx_sha256"])),
                tokenizer=CardFile(folder / raw["tokenizer_file"], str(raw["tokenizer_sha256"])),
                knn=None if knn is None else CardFile(folder / str(knn["file"]), str(knn["sha256"])),
                max_word_pieces=int(raw["max_word_pieces"]),
                tail_word_pieces=int(raw.get("tail_word_pieces", 0)),  # a card from before: first pieces only
                blend_weights=BlendWeights(*weights.values()),
                output=str(raw.get("output", "log_tokens")),
                raw=raw,
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelError(f"encoder card {card_path} is unreadable: {exc}") from exc
        if card.max_word_pieces < 8:
            raise ModelError(f"encoder card {card_path}: max_word_pieces {card.max_word_pieces} is below 8")
        if not 0 <= card.tail_word_pieces <= card.max_word_pieces - 8:
            raise ModelError(
                f"encoder card {card_path}: tail_word_pieces {card.tail_word_pieces} is not in [0, max_word_pieces - 8]"
            )
        return card


def _fixed_width(outputs: dict[str, Any], name: str, graph: Path) -> int:
    """The last dimension of the graph's output ``name`` (0: it has no such output)."""
    if name not in outputs:
        return 0
    width = outputs[name].shape[-1]
    if not isinstance(width, int) or width < 1:
        raise ModelError(f"encoder {graph}: its {name} output has no fixed width")
    return width


class EncoderModel:
    """The encoder: instruction text -> predicted ln(answer tokens), on one onnxruntime thread."""

    def __init__(self, card_path: Path | str | None = None) -> None:
        """Loads the card's files as they are, each checked against its sha256 in the card.

        The shipped graphs hold their MatMulInteger weights as uint8 (int8 + 128, zero points moved
        by 128: ``clairvoyant.tools.training.quantization``, at export), so onnxruntime runs them
        with its u8 x u8 kernel, which gives the same integers on every CPU."""
        from tokenizers import Tokenizer  # imported here: importing this module stays cheap

        path = Path(card_path) if card_path is not None else DEFAULT_ENCODER_CARD
        if not path.is_file():
            raise ModelError(f"encoder card {path} not found")
        self.card = card = EncoderCard.load(path)
        # every file is read and checked before any is used
        graph, _, knn = (None if f is None else f.read() for f in (card.onnx, card.tokenizer, card.knn))
        self.tokenizer = Tokenizer.from_file(str(card.tokenizer.path))
        self._tail = self.card.tail_word_pieces
        self._head = self.card.max_word_pieces - 2 - self._tail  # after [CLS], before the tail and [SEP]
        if self._tail:
            self.tokenizer.no_truncation()  # the pieces are cut in encode(); clip() bounds the text
        else:
            self.tokenizer.enable_truncation(self.card.max_word_pieces)
        self.tokenizer.no_padding()
        self._session = single_threaded_session(card.onnx.path, "encoder", graph)
        outputs = {o.name: o for o in self._session.get_outputs()}
        if self.card.output not in outputs:
            raise ModelError(f"encoder {card.onnx.path} has no {self.card.output!r} output (has {sorted(outputs)})")
        # The online learner's columns (``clairvoyant train-encoder``'s export step): the embedding's top
        # principal components over ShareGPT training prompts, then the pooled embedding (the key of the
        # learner's residual kNN) from the same run, in the bytes ``encode`` and ``opinion`` return.
        # 0 = a graph without them (without components, the embedding is not read either).
        self.components = _fixed_width(outputs, "components", card.onnx.path)
        self.embedding_width = _fixed_width(outputs, "embedding", card.onnx.path) if self.components else 0
        self._both = [self.card.output, "components"] if self.components else [self.card.output]
        if self.embedding_width:
            self._both.append("embedding")
        # The kNN (the card's knn block): a second session on this thread, fed the pooled embedding.
        self._knn: Any = None
        if card.knn is not None:
            if "embedding" not in outputs:
                raise ModelError(f"encoder {card.onnx.path} has no 'embedding' output for its kNN")
            self._knn = single_threaded_session(card.knn.path, "encoder kNN", knn)
            names = ([i.name for i in self._knn.get_inputs()], [o.name for o in self._knn.get_outputs()])
            if names != (["embedding"], ["knn_log_tokens"]):
                raise ModelError(
                    f"encoder kNN {card.knn.path} takes {names[0]} and gives {names[1]}, "
                    "not ['embedding'] -> ['knn_log_tokens']"
                )
        self._all = self._both if self.embedding_width else [*self._both, "embedding"]  # the embedding last
        self._max_chars = self.card.max_word_pieces * _CHARS_PER_WORD_PIECE
        self.opinion("warm up")  # first-run allocations, and proof that the graphs run

    @property
    def blend_weights(self) -> BlendWeights:
        """The blend's weights by turn (``OnnxPredictor.refined`` picks one per request)."""
        return self.card.blend_weights

    def clip(self, text: str) -> str:
        """The part of ``text`` the encoder can read (what a pending request keeps), as valid
        UTF-8: the tokenizer refuses lone surrogates, which JSON bodies can carry. With a tail: the
        whole text up to twice the head's character bound, else its first and last characters
        joined by a space (``clip(clip(t)) == clip(t)``; in ordinary text each half holds far more than
        its share of word pieces, so the join falls in the pieces not read)."""
        cut = self._max_chars
        if self._tail and len(text) > 2 * cut:
            text = text[:cut] + " " + text[-cut:]
        elif not self._tail:
            text = text[:cut]
        return text.encode("utf-8", "replace").decode("utf-8")

    def word_pieces(self, text: str) -> list[int]:
        """The word-piece ids the encoder reads for ``text``: [CLS], the pieces, [SEP]; a text
        longer than ``max_word_pieces`` as its first pieces and its last ``tail_word_pieces``."""
        ids = self.tokenizer.encode(self.clip(text)).ids
        if self._tail and len(ids) > self.card.max_word_pieces:
            ids = ids[: 1 + self._head] + ids[-1 - self._tail :]
        return ids

    def encode(self, text: str) -> tuple[float, bytes]:
        """Predicted ln(answer tokens) for one instruction, and the online learner's columns: its
        components, then its pooled embedding (``embedding_width`` floats, for the learner's
        residual kNN) as float32 bytes; empty for a graph without components."""
        value, components, _ = self._run(text, self._both)
        return value, components

    def _run(self, text: str, outputs: list[str]) -> tuple[float, bytes, list[Any]]:
        """One run of the graph on ``text``'s word pieces: its ln tokens, the learner's columns
        (``encode``) and every output asked for."""
        ids = np.asarray([self.word_pieces(text)], dtype=np.int64)
        out = self._session.run(outputs, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        value = float(np.asarray(out[0]).reshape(-1)[0])
        return value, b"".join(np.asarray(o, dtype=np.float32).tobytes() for o in out[1 : len(self._both)]), out

    def opinion(self, text: str) -> tuple[float, bytes, float | None]:
        """``encode``, and the kNN's ln tokens from the same run's pooled embedding (None without a
        kNN): what a waiting request is refined with."""
        if self._knn is None:
            value, components = self.encode(text)
            return value, components, None
        value, components, out = self._run(text, self._all)
        embedding = np.asarray(out[-1], dtype=np.float32).reshape(1, -1)
        knn = float(self._knn.run(None, {"embedding": embedding})[0].reshape(-1)[0])
        return value, components, knn

    def log_tokens(self, text: str) -> float:
        """Predicted ln(answer tokens) for one instruction."""
        return self.encode(text)[0]

    def opinions_many(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray | None]:
        """The encoder's and the kNN's ln tokens for each instruction (the kNN's None without one),
        one at a time: batching would pad, and a quantized graph scales its activations over the
        whole batch, padding included, so a padded batch does not give the served values."""
        values = [self.opinion(t) for t in texts]
        encoder = np.array([v[0] for v in values], dtype=np.float64)
        knn = np.array([v[2] for v in values], dtype=np.float64) if self._knn is not None else None
        return encoder, knn


@dataclass(slots=True)
class _Waiting:
    """A waiting request handed over for its second opinion."""

    key: Any  # the caller's handle (the dispatcher's ticket)
    text: str  # the clipped instruction
    still_wanted: Callable[[], bool]  # read from the worker thread: a plain attribute read
    dispatched: Callable[[], bool]  # read from the worker thread, once it is not wanted


@dataclass(slots=True)
class _Learning:
    """A completed request to encode for the online learner."""

    text: str  # the clipped instruction
    then: Callable[[float, bytes], None]  # on the event loop: log tokens, components


# The learner's encodes (requests that completed without waiting) may take at most this share of
# one core, so a fast backend's completions (thousands a second against a cache) never make the
# encoder a second busy core; at an LLM's pace (a few completions a second) it never binds.
LEARNING_SHARE = 0.25
LEARNING_MAX_PENDING = 64  # completed requests waiting to be encoded for the learner

# A waiting request's opinion is worth asking for only if it comes while the request still waits.
# When the queue turns over faster than the encoder answers (thousands of tiny answers a second,
# the loop busy enough to starve the thread of the interpreter lock), nearly none does: then one
# waiting request a PROBE_INTERVAL_S is handed over, to notice when that changes.
IN_TIME_WEIGHT = 1 / 16  # of each waiting request's outcome in the moving share that came in time
IN_TIME_FLOOR = 0.05  # the share below which the encoder is only probed
PROBE_INTERVAL_S = 1.0


class _Delivery:
    """Hands waiting requests' opinions back (``deliver``) and keeps ``in_time``, the moving share
    of them that was used, out of those used or dispatched before (a skipped request counts as not
    when its ``dispatched`` says so; requests withdrawn by their clients say nothing of the pace).
    Under ``IN_TIME_FLOOR``, one request a ``probe_interval_s`` is asked for."""

    def __init__(
        self, deliver: Callable[[Any, float, bytes, float | None], bool | None], probe_interval_s: float
    ) -> None:
        self.deliver = deliver
        self.in_time = 1.0
        self.probe_interval_s = probe_interval_s
        self._next_probe_s = 0.0  # time.monotonic() from which the next probe is taken

    def worth_asking(self) -> bool:
        if self.in_time >= IN_TIME_FLOOR:
            return True
        now_s = time.monotonic()
        if now_s < self._next_probe_s:
            return False
        self._next_probe_s = now_s + self.probe_interval_s
        return True

    def __call__(self, key: Any, value: float, components: bytes, knn: float | None) -> None:
        """On the event loop: deliver, and whether the opinion came in time (None: neither)."""
        used = self.deliver(key, value, components, knn)
        if used is not None:
            self.came_in_time(used)

    def came_in_time(self, used: bool) -> None:
        # From the loop (delivered) or the thread (skipped): a lost update between the two only
        # delays the moving share by one outcome.
        self.in_time += IN_TIME_WEIGHT * ((1.0 if used else 0.0) - self.in_time)


class _WorkQueue:
    """The thread's two queues under one condition: waiting requests first; the learner's only when
    none waits, each learning encode of t seconds followed by t x (1 / share - 1) seconds of rest."""

    def __init__(self, learning_share: float, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.waiting: deque[_Waiting] = deque()
        self.learning: deque[_Learning] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._rest_per_busy = 1.0 / learning_share - 1.0  # seconds of rest per second of learning
        self._learning_after_s = 0.0  # time.monotonic() before which no learning encode starts

    def put(self, item: _Waiting | _Learning) -> bool:
        """False if its queue is full."""
        queue: deque[Any] = self.waiting if isinstance(item, _Waiting) else self.learning
        bound = self.max_waiting if isinstance(item, _Waiting) else LEARNING_MAX_PENDING
        with self._wake:
            if len(queue) >= bound:
                return False
            queue.append(item)
            self._wake.notify()
        return True

    def next(self) -> _Waiting | _Learning | None:
        """The next item, once it may start; None once stopped."""
        with self._wake:
            while not self._stopping:
                if self.waiting:
                    return self.waiting.popleft()
                if self.learning:
                    rest_s = self._learning_after_s - time.monotonic()
                    if rest_s <= 0:
                        return self.learning.popleft()
                    self._wake.wait(rest_s)
                else:
                    self._wake.wait()
            return None

    def learned(self, busy_s: float) -> None:
        self._learning_after_s = time.monotonic() + busy_s * self._rest_per_busy

    def open(self) -> None:
        self._stopping = False

    def stop(self) -> None:
        with self._wake:  # what is pending now is not worth encoding
            self._stopping = True
            self.waiting.clear()
            self.learning.clear()
            self._wake.notify()


class Refiner:
    """One background thread that encodes waiting requests, oldest first, and hands each result
    back on the event loop: ``deliver(key, encoder_log_tokens, components, knn_log_tokens)``. The
    event loop never waits for the encoder. Outcomes counted (``count``):

    - ``dropped``: beyond ``max_pending`` waiting requests; it keeps its lexical prediction;
    - ``skipped``: no longer waiting when its turn came; not encoded;
    - ``bypassed``: passed over while opinions come too late (``_Delivery``): they would not change
      an order, and asking for them costs the loop and the thread;
    - ``learning``, ``learning_dropped``: a completed request encoded for the online learner
      (``encode_later``), or refused beyond ``LEARNING_MAX_PENDING`` (the learner then counts it for
      its quality figures only). These come only when no waiting request is pending, within
      ``learning_share`` of the thread's time;
    - ``failed``: the encoder raised.

    ``deliver`` returns whether the opinion was used (True: the request still waited; False: it
    was dispatched first; None: neither, e.g. its client left).
    """

    def __init__(
        self,
        encoder: EncoderModel,
        deliver: Callable[[Any, float, bytes, float | None], bool | None],
        *,
        max_pending: int = 256,
        learning_share: float = LEARNING_SHARE,
        observe_seconds: Callable[[float], None] | None = None,
        count: Callable[[str], None] | None = None,
        probe_interval_s: float = PROBE_INTERVAL_S,
    ) -> None:
        if not 0.0 < learning_share <= 1.0:
            raise ValueError(f"learning_share must be in (0, 1], got {learning_share}")
        self.encoder = encoder
        self.observe_seconds = observe_seconds  # the encoder's seconds per request (from its thread)
        self.count = count  # an outcome: skipped, dropped, failed, learning... (from either thread)
        self._delivery = _Delivery(deliver, probe_interval_s)
        self._queue = _WorkQueue(learning_share, max_pending)
        self._loop: Any = None
        self._thread: threading.Thread | None = None

    def start(self, loop: Any) -> None:
        self._loop = loop
        self._queue.open()
        self._thread = threading.Thread(target=self._run, name="clairvoyant-encoder", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._thread is None:
            return
        self._queue.stop()
        self._thread.join(timeout_s)
        self._thread = None

    @property
    def pending(self) -> int:
        """Requests handed over and not yet taken by the thread (both kinds)."""
        return len(self._queue.waiting) + len(self._queue.learning)

    @property
    def in_time(self) -> float:
        return self._delivery.in_time

    def want(
        self, key: Any, text: str, still_wanted: Callable[[], bool], dispatched: Callable[[], bool] = lambda: False
    ) -> bool:
        """Ask for ``key``'s second opinion (from the event loop). False if it was not taken.
        ``still_wanted`` and ``dispatched`` (it left the queue for a slot) are read from the thread."""
        if not self._delivery.worth_asking():
            self._count("bypassed")
            return False
        item = _Waiting(key, self.encoder.clip(text), still_wanted, dispatched)
        return self._put(item, "dropped")

    def encode_later(self, text: str | Callable[[], str | None], then: Callable[[float, bytes], None]) -> bool:
        """Encode ``text`` when the thread has time to spare and call ``then(log_tokens,
        components)`` on the event loop: for the learner, which needs the components of a completed
        request (none keeps them: see proxy/feedback.py). ``text`` may be a function, called only
        when there is room (None: nothing to encode). False if it was not taken."""
        if len(self._queue.learning) >= LEARNING_MAX_PENDING:  # full (read without the lock: put checks again)
            self._count("learning_dropped")  # under load, most are: not worth finding the text first
            return False
        found = text() if callable(text) else text
        if found is None:
            return False
        return self._put(_Learning(self.encoder.clip(found), then), "learning_dropped")

    def _put(self, item: _Waiting | _Learning, refused: str) -> bool:
        if self._thread is None:
            return False
        if not self._queue.put(item):
            self._count(refused)
            return False
        return True

    def _count(self, outcome: str) -> None:
        if self.count is not None:
            self.count(outcome)

    def _run(self) -> None:
        while (item := self._queue.next()) is not None:
            if isinstance(item, _Waiting) and not item.still_wanted():
                self._count("skipped")
                if item.dispatched():
                    self._delivery.came_in_time(False)
                continue
            started = time.perf_counter()
            try:
                if isinstance(item, _Waiting):
                    value, components, knn = self.encoder.opinion(item.text)
                else:  # the learner needs its columns only (components, embedding): no kNN graph
                    value, components = self.encoder.encode(item.text)
            except Exception:  # never let one request end the thread
                self._count("failed")
                logger.exception("encoder failed on one request; it keeps its lexical prediction")
                continue
            elapsed_s = time.perf_counter() - started
            if self.observe_seconds is not None:
                self.observe_seconds(elapsed_s)
            try:
                if isinstance(item, _Waiting):
                    self._loop.call_soon_threadsafe(self._delivery, item.key, value, components, knn)
                else:
                    self._queue.learned(elapsed_s)
                    self._count("learning")
                    self._loop.call_soon_threadsafe(item.then, value, components)
            except RuntimeError:  # the loop closed under us (shutdown)
                return


def encoder_for(predictor: Any, card_path: Path | None = None) -> EncoderModel | None:
    """The encoder that refines ``predictor``'s predictions, or None where it does not apply: a
    class model (``--preset paper``) has no log-token prior to blend into."""
    output = getattr(predictor, "output", None)
    if output is None or output.kind != "regressor":
        return None
    encoder = EncoderModel(card_path)
    weights = encoder.blend_weights
    if weights.first != weights.later and getattr(predictor, "history_column", None) is None:
        raise ModelError(
            f"encoder {encoder.card.onnx.path}: its blend weights differ by turn, and the predictor's feature set "
            "has no history_chars column to tell turns apart"
        )
    return encoder


def refined_by(encoder: Any, predictor: OnnxPredictor, prediction: Prediction, text: str) -> Prediction:
    """``prediction`` refined by ``encoder``'s opinion of ``text`` (and its kNN's) at once, as the
    proxy refines a request that waits (for the offline commands: replay, predict, demo)."""
    encoder_log_tokens, components, knn_log_tokens = encoder.opinion(text)
    return predictor.refined(prediction, encoder_log_tokens, encoder.blend_weights, components, knn_log_tokens)
