"""Every replica learns from every answer: the observations a completed request teaches go to one
Redis stream, and each replica applies the other replicas' to its own models, so their service-time
fits converge and their predictions stay comparable in the one shared queue.

Two kinds of entries, on the stream ``cv:{cluster}:observations``:

- ``service``: what ``Dispatcher._learn`` fed its ``ServiceTimeModel`` (``ServiceObservation``): the
  model and backend names, prompt and predicted output tokens, the service seconds less any load,
  the predicted seconds, and a load the backend reported. Applied as the dispatcher applies its own:
  ``observe_load``, then ``observe`` and the backend's slowness (``Backend.observe_service``).
- ``learner``: what the usage recorder handed its online learner: the model name, the prior's log
  tokens and the predicted tokens, the request's token cap, the observed output tokens, and the
  feature row: the prior's lexical columns (counts, flags and the lexicon's estimate, ``FEATURE_SETS``) and
  the encoder's components when the row has them, as float32 bytes. The encoder's 384-d embedding
  after them is cut off: an embedding can be inverted to an approximation of the prompt, so the
  other replicas' residual kNN never learns from it. Entries carry a digest of the learner's
  ``PriorIdentity``; a replica with another prior (another model file) skips them.

Numbers, ids and model names only: never the prompt or the answer.

Bounds: ``MAX_ENTRIES``, ``MAX_PENDING`` and ``MAX_APPLIED_PER_S`` below (a reader falls behind
rather than take more; what it missed beyond the stream's length is skipped). The learner's own
sampling rate bounds what reaches the learner (``proxy/feedback.py``: one token bucket for this
replica's and the others' observations).

Faults: publishing runs in its own task and never raises into the request path. Redis lost is
logged once at WARNING (and its return at INFO); both tasks retry with a backoff up to
``RETRY_MAX_S``. A batch whose write failed is sent again (it may have been written in part):
each entry carries its publisher's session (random per start) and a sequence number, and a reader
applies each (session, number) once, so an observation is applied once per replica either way.
The reader resumes after the last entry it read; from the stream's end when that entry was trimmed
(it fell a whole stream behind); from the start when the stream is newer than that entry and has
lost none (Redis restarted empty: its ``entries-added`` equals its length).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import math
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from clairvoyant.prediction.learner import PriorIdentity
from clairvoyant.prediction.predictor import Prediction
from clairvoyant.scheduling.cluster.shared import ServiceObservation
from clairvoyant.scheduling.routing import Backend
from clairvoyant.scheduling.service_time import ServiceTimeModel

__all__ = ["ObservationCounts", "SharedObservations", "identity_digest", "stream_key"]

logger = logging.getLogger(__name__)

MAX_ENTRIES = 10_000  # the stream's length, about (XADD MAXLEN ~): about 1 to 3 MB
MAX_PENDING = 4_096  # observations waiting to be published (Redis away): the oldest are dropped
MAX_APPLIED_PER_S = 2_000.0  # entries the reader takes a second, at most (an entry costs a few µs)
READ_BATCH = 256  # entries per XREAD, and per pipelined XADD
BLOCK_MS = 2_000  # an XREAD waits this long for new entries before it asks again
TIMEOUT_S = 2.0  # a call (or the reader's wait beyond BLOCK_MS) that takes longer: Redis is lost
MAX_SESSIONS = 1_024  # publishers' sessions whose last sequence number a reader keeps
RETRY_MIN_S, RETRY_MAX_S = 0.1, 2.0  # the backoff between attempts while Redis is lost
# How long the publisher waits after an observation before it writes, and the reader after a read
# that found entries before it reads again: under load, one round trip carries several entries (a
# loopback round trip costs the event loop about as much CPU as a request's whole scheduling).
LINGER_S = 0.005
STOP_S = 0.5  # stop waits this long for a task to end once cancelled

LearnerFeed = Callable[[Prediction, int], None]
Fields = dict[Any, Any]  # an entry's fields as written: str names, str/int/float/bytes values
Read = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]  # XREAD's reply (no decoding)


def stream_key(cluster: str) -> str:
    return f"cv:{cluster}:observations"


def identity_digest(identity: PriorIdentity) -> str:
    """A short digest of a learner's prior: replicas share learner observations only when equal."""
    return hashlib.sha256(json.dumps(identity.as_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _stream_id(value: bytes | str) -> tuple[int, int]:
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


@dataclass(slots=True)
class ObservationCounts:
    """What went through the stream here, for the metrics and the tests."""

    published: int = 0  # entries written to the stream
    dropped: int = 0  # observations never written (the pending bound, or a write that failed)
    applied: int = 0  # other replicas' entries applied here
    foreign: int = 0  # learner entries skipped: another prior
    skipped: int = 0  # times the reader jumped to the stream's end (entries trimmed unread)
    repeated: int = 0  # entries skipped as applied already (a batch its publisher sent again)


@dataclass(frozen=True, slots=True)
class _LearnerShare:
    """The learner observations shared: those of one prior."""

    identity: str  # ``identity_digest`` of the prior
    row_bytes: int  # the feature row's bytes that are shared (the embedding's are not)
    feed: LearnerFeed  # where the other replicas' observations go


class _Outage:
    """Redis lost and found: which tasks find it away now, and each one's next backoff."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.lost: set[str] = set()
        self._retry_s: dict[str, float] = {}

    async def lose(self, task: str, exc: BaseException) -> None:
        if not self.lost:
            logger.warning(
                "redis unreachable (%s): replica %s's observations are not shared until it returns; retrying",
                type(exc).__name__,
                self.replica,
            )
        retry_s = self._retry_s.get(task, RETRY_MIN_S)
        self.lost.add(task)
        self._retry_s[task] = min(RETRY_MAX_S, retry_s * 2)
        await asyncio.sleep(retry_s)

    def found(self, task: str) -> None:
        if task in self.lost:
            self.lost.discard(task)
            self._retry_s.pop(task, None)
            if not self.lost:
                logger.info("redis reachable again: replica %s's observations are shared", self.replica)


class _Publisher:
    """Queues this replica's observations (on the request path: O(1), no I/O) and writes them to
    the stream from its own task, in batches. Each entry carries its ``session`` and a ``seq`` in it."""

    def __init__(
        self, client: redis.Redis, key: str, *, max_entries: int, max_pending: int, linger_s: float,
        counts: ObservationCounts, outage: _Outage,
    ) -> None:  # fmt: skip
        self.client = client
        self.key = key
        self.session = secrets.token_hex(8)
        self.max_entries = max_entries
        self.linger_s = linger_s
        self.counts = counts
        self.outage = outage
        self.pending: deque[Fields] = deque(maxlen=max_pending)
        self._wake = asyncio.Event()
        self.seq = itertools.count(1)  # the next entry's sequence number in this session

    def queue(self, fields: Fields) -> None:
        if len(self.pending) == self.pending.maxlen:
            self.counts.dropped += 1  # the deque drops its oldest
        self.pending.append(fields)
        self._wake.set()

    async def run(self) -> None:
        max_pending = self.pending.maxlen or 0
        while True:
            await self._wake.wait()
            if self.linger_s > 0:  # let a batch form: one XADD round trip for the answers of a moment
                await asyncio.sleep(self.linger_s)
            self._wake.clear()
            while self.pending:
                batch = [self.pending.popleft() for _ in range(min(READ_BATCH, len(self.pending)))]
                try:
                    pipe = self.client.pipeline(transaction=False)
                    for fields in batch:
                        pipe.xadd(self.key, fields, maxlen=self.max_entries, approximate=True)
                    await pipe.execute()
                except (RedisError, OSError) as exc:
                    # Sent again later, in order (readers skip what was written already); the newest
                    # go when that overflows the bound.
                    self.counts.dropped += max(0, len(self.pending) + len(batch) - max_pending)
                    self.pending.extendleft(reversed(batch))
                    await self.outage.lose("publish", exc)
                    continue
                except BaseException:
                    self.pending.extendleft(reversed(batch))  # (cancelled: stop publishes nothing more)
                    raise
                self.counts.published += len(batch)
                self.outage.found("publish")


class _Reader:
    """Reads the stream from its own task, on a connection of its own (blocked in XREAD most of the
    time), and hands each entry of another replica, not applied yet, to ``apply``."""

    def __init__(
        self, client: redis.Redis, key: str, session: str, *, catch_up: bool, max_applied_per_s: float,
        linger_s: float, counts: ObservationCounts, outage: _Outage, apply: Callable[[dict[bytes, bytes]], None],
    ) -> None:  # fmt: skip
        self.client = client
        self.key = key
        self.last_id: bytes | None = None if catch_up else b"$"  # None: from the stream's start
        self.stopping = False
        self.max_applied_per_s = max_applied_per_s
        self.linger_s = linger_s
        self.counts = counts
        self.outage = outage
        self._apply = apply
        self._own_session = session.encode()
        self._applied_seq: OrderedDict[bytes, int] = OrderedDict()  # session -> the last seq applied

    async def run(self) -> None:
        budget = float(READ_BATCH)  # entries the reader may take now (a token bucket)
        at_s = time.monotonic()
        while not self.stopping:
            try:
                if self.last_id is None or self.last_id == b"$" or "read" in self.outage.lost:
                    self.last_id = await self.resume_from()
                    self.outage.found("read")
                reply = cast(Read, await self.client.xread({self.key: self.last_id}, count=READ_BATCH, block=BLOCK_MS))
                self.outage.found("read")
            except (RedisError, OSError) as exc:
                if self.stopping:
                    return
                await self.outage.lose("read", exc)
                continue
            taken = 0
            for _key, entries in reply or ():
                for entry_id, fields in entries:
                    self.last_id = entry_id
                    taken += 1
                    if self._new(fields):
                        self._apply(fields)
            now_s = time.monotonic()
            budget = min(float(READ_BATCH), budget + (now_s - at_s) * self.max_applied_per_s) - taken
            at_s = now_s
            # Took more than the rate allows: wait until it is paid back. Else, with entries, let
            # the next ones gather for a moment (one XREAD for several).
            pause_s = -budget / self.max_applied_per_s if budget < 0 else (self.linger_s if taken else 0.0)
            if pause_s > 0:
                await asyncio.sleep(pause_s)

    async def resume_from(self) -> bytes:
        """Where the reader goes on (see the module docstring)."""
        try:
            info = await self.client.xinfo_stream(self.key)
        except ResponseError:  # no stream (yet): everything it will hold is new
            return b"0-0"
        end: bytes = info["last-generated-id"]
        last = self.last_id
        if last is None:
            return b"0-0"
        if last == b"$":
            return end  # (not "$": what is added between this call and the read is kept)
        if _stream_id(end) < _stream_id(last):
            return b"0-0"  # a newer stream than the last entry read (Redis restarted empty)
        if end == last:
            return last
        first = info.get("first-entry")
        if not first or _stream_id(first[0]) > _stream_id(last):  # the last entry read is gone
            if info.get("entries-added") == info["length"]:
                return b"0-0"  # a stream that lost nothing, newer than that entry (Redis restarted empty)
            self.counts.skipped += 1  # trimmed, maybe with entries after it: go on from now
            return end
        return last

    def _new(self, fields: dict[bytes, bytes]) -> bool:
        """Whether an entry is another replica's, and not applied yet."""
        session = fields.get(b"session", b"")
        if session == self._own_session:
            return False
        try:
            seq = int(fields[b"seq"])
        except (KeyError, ValueError):
            return False
        if seq <= self._applied_seq.get(session, 0):
            self.counts.repeated += 1
            return False
        self._applied_seq[session] = seq
        self._applied_seq.move_to_end(session)
        if len(self._applied_seq) > MAX_SESSIONS:
            self._applied_seq.popitem(last=False)
        return True


class SharedObservations:
    """This replica's side of the observation stream (see the module docstring). ``service_time``
    and ``backends``: where the other replicas' service observations are applied. The dispatcher's
    ``on_observed`` is ``publish_service``; the usage recorder's is ``publish_learner`` once
    ``share_learner`` named the learner's prior and where the others' observations go."""

    def __init__(
        self,
        url: str,
        *,
        cluster: str,
        replica: str,
        service_time: ServiceTimeModel,
        backends: Sequence[Backend] = (),
        catch_up: bool = False,
        max_entries: int = MAX_ENTRIES,
        max_pending: int = MAX_PENDING,
        max_applied_per_s: float = MAX_APPLIED_PER_S,
        linger_s: float = LINGER_S,
    ) -> None:
        """``catch_up``: at start, apply what the stream holds (a replica that starts with no learned
        state); else only what is published from then on. ``linger_s``: see ``LINGER_S`` (0: a
        round trip per observation)."""
        if not (max_entries >= 1 and max_pending >= 1 and max_applied_per_s > 0):
            raise ValueError("max_entries, max_pending and max_applied_per_s must be positive")
        self.replica = replica
        self.service_time = service_time
        self.backends = {b.name: b for b in backends}
        self.counts = ObservationCounts()
        self._learner: _LearnerShare | None = None
        self._outage = _Outage(replica)
        # No retries inside the client: a retried pipeline could write an observation twice.
        options: dict[str, Any] = {"retry": Retry(NoBackoff(), 0), "socket_connect_timeout": TIMEOUT_S}
        writer = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, **options)
        self._publisher = _Publisher(
            writer, stream_key(cluster), max_entries=max_entries, max_pending=max_pending,
            linger_s=linger_s, counts=self.counts, outage=self._outage,
        )  # fmt: skip
        reader = redis.Redis.from_url(
            url, socket_timeout=BLOCK_MS / 1000 + TIMEOUT_S, single_connection_client=True, **options
        )
        self._reader = _Reader(
            reader, stream_key(cluster), self._publisher.session, catch_up=catch_up,
            max_applied_per_s=max_applied_per_s, linger_s=linger_s, counts=self.counts, outage=self._outage,
            apply=self._apply,
        )  # fmt: skip
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False

    def share_learner(self, identity: PriorIdentity, feed: LearnerFeed) -> None:
        """Share learner observations of this prior: others' go to ``feed(prediction, tokens)``."""
        row_bytes = 4 * (len(identity.feature_names) + len(identity.component_names))
        self._learner = _LearnerShare(identity_digest(identity), row_bytes, feed)

    # -- start and stop ------------------------------------------------------------------------
    def start(self) -> None:
        """Run the publisher and the reader (on the running loop). Never fails for want of Redis."""
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._publisher.run(), name="observations-publish"),
                asyncio.create_task(self._reader.run(), name="observations-read"),
            ]
            for task in self._tasks:
                task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:  # a bug: serving goes on unshared
            logger.error("replica %s's %s stopped", self.replica, task.get_name(), exc_info=exc)

    async def stop(self, flush_s: float = 1.0) -> None:
        """Publish what waits (for up to ``flush_s``), then stop both tasks and close the connections.
        Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        deadline = time.monotonic() + flush_s
        while self._tasks and self._publisher.pending and not self._outage.lost and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._reader.stopping = True
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        _, running = await asyncio.wait(tasks, timeout=STOP_S) if tasks else (set(), set())
        if running:
            # redis-py can lose a cancel that lands in a blocking read (redis/redis-py#2028): the
            # reader's connection closed under it ends the read, and the loop sees it is stopping.
            connection = self._reader.client.connection
            if connection is not None:
                await connection.disconnect(nowait=True)
            for task in running:
                task.cancel()  # (the cancel it lost, again: it may be in a pause by now)
            _, running = await asyncio.wait(running, timeout=STOP_S)
            if running:
                logger.warning("replica %s's observation reader did not stop", self.replica)
        await self._reader.client.aclose()
        await self._publisher.client.aclose()

    # -- publishing (on the request path: O(1), no I/O) ------------------------------------------
    def publish_service(self, observation: ServiceObservation) -> None:
        """The dispatcher's ``on_observed``: queue a service observation for the stream."""
        publisher = self._publisher
        fields: Fields = {
            "kind": "service",
            "replica": self.replica,
            "session": publisher.session,
            "seq": next(publisher.seq),
            "model": observation.model or "",
            "backend": observation.backend,
            "prompt_tokens": observation.prompt_tokens,
            "output_tokens": observation.output_tokens,
            "service_s": observation.service_s,
            "predicted_s": observation.predicted_s,
        }
        if observation.load_s is not None:
            fields["load_s"] = observation.load_s
        publisher.queue(fields)

    def publish_learner(self, prediction: Prediction, observed_tokens: int) -> None:
        """The usage recorder's ``on_observed``: queue what this replica's learner observed."""
        if self._learner is None:
            return
        publisher = self._publisher
        fields: Fields = {
            "kind": "learner",
            "replica": self.replica,
            "session": publisher.session,
            "seq": next(publisher.seq),
            "identity": self._learner.identity,
            "model": prediction.model or "",
            "prior_log_tokens": prediction.prior_log_tokens,
            "predicted_tokens": prediction.predicted_tokens,
            "observed_tokens": int(observed_tokens),
            "row": prediction.feature_row[: self._learner.row_bytes],
        }
        if prediction.cap_tokens is not None:
            fields["cap_tokens"] = prediction.cap_tokens
        publisher.queue(fields)

    # -- applying the other replicas' -------------------------------------------------------------
    def _apply(self, fields: dict[bytes, bytes]) -> None:
        try:
            kind = fields[b"kind"]
            if kind == b"service":
                self._apply_service(fields)
            elif kind == b"learner":
                self._apply_learner(fields)
            else:
                return
        except (KeyError, ValueError, TypeError) as exc:  # a malformed entry (another version?): skipped
            logger.debug("observation entry skipped: %s", exc)
            return
        self.counts.applied += 1

    def _apply_service(self, fields: dict[bytes, bytes]) -> None:
        model = fields[b"model"].decode() or None
        backend = fields[b"backend"].decode()
        service_s = float(fields[b"service_s"])
        load = fields.get(b"load_s")
        if load is not None:
            self.service_time.observe_load(backend, model, float(load))
        if not service_s > 0:
            return
        prompt_tokens, output_tokens = int(fields[b"prompt_tokens"]), int(fields[b"output_tokens"])
        self.service_time.observe(model, prompt_tokens, output_tokens, service_s)
        served = self.backends.get(backend)
        if served is not None:
            served.observe_service(float(fields[b"predicted_s"]), service_s)

    def _apply_learner(self, fields: dict[bytes, bytes]) -> None:
        learner = self._learner
        if learner is None:
            return
        if fields[b"identity"].decode() != learner.identity:
            self.counts.foreign += 1
            return
        cap = fields.get(b"cap_tokens")
        prediction = Prediction(
            score=0.0,  # (the learner reads no score)
            predicted_tokens=float(fields[b"predicted_tokens"]),
            prior_log_tokens=float(fields[b"prior_log_tokens"]),
            feature_row=fields[b"row"],
            model=fields[b"model"].decode() or None,
            cap_tokens=None if cap is None else int(cap),
        )
        if not math.isfinite(prediction.prior_log_tokens):
            raise ValueError("prior_log_tokens not finite")
        learner.feed(prediction, int(fields[b"observed_tokens"]))
