"""``servewatch ship``'s engine: a source's units -> an adapter -> batched messages in Kafka.

Why batches: a worker pays per Kafka message, so records travel as JSON arrays of up to
``batch_records`` (500) records or ``batch_bytes``, sent once full or after ``linger_s``.
Every unit that cannot become a ``RequestLog`` (broken JSON, a bad field, an oversized
line, even an adapter bug) becomes one ``DeadLetter`` message on the dead-letter topic,
with its reason, the rejected bytes, ``source_topic`` naming the input (``file:<path>``,
``stdin``, ``http``), ``source_offset`` the byte offset of its line and ``record_index`` its
line number (from 1), or for HTTP its index in the posted array. The shipper never stops
for a bad line.

Delivery: batches are sent in order, up to ``max_in_flight`` unacknowledged; a chunk's
``on_published`` runs only when the chunk and everything before it is acknowledged (the
file's position is saved then, an HTTP client answered then). A failed send is retried,
with backoff, until it succeeds; a message the broker finds too large is split in halves,
down to one record, which is then dead-lettered. On ``stop`` (SIGTERM) the source stops
reading, and what was read is flushed and awaited for up to ``drain_timeout_s``: ``read =
sent + rejected`` unless Kafka stayed unreachable that long (``ShipStats.pending``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, RecordTooLargeError

from servewatch.pipeline import topics
from servewatch.pipeline.ingest.ship.adapters import Adapter, Rejection
from servewatch.pipeline.ingest.ship.sources import UNPARSED, Chunk, ChunkResult, Source, Unit
from servewatch.pipeline.messages.dead_letters import dead_letter
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.schemas.dead_letter import DeadLetter

logger = logging.getLogger(__name__)

TOO_LARGE = (MessageSizeTooLargeError, RecordTooLargeError)


class Producer(Protocol):
    """What the shipper needs of ``aiokafka.AIOKafkaProducer``."""

    async def send(
        self, topic: str, value: bytes | None = None, key: bytes | None = None, partition: int | None = None
    ) -> asyncio.Future[Any]: ...


@dataclass(frozen=True)
class ShipConfig:
    batch_records: int = 500
    batch_bytes: int = 1_000_000  # under Apache Kafka's default message.max.bytes (1,048,588)
    linger_s: float = 0.2
    max_in_flight: int = 8  # batches sent and not yet acknowledged
    retry_initial_s: float = 0.5  # first pause after a failed send, doubled on each failure in a row
    retry_max_s: float = 30.0  # longest pause between two attempts
    drain_timeout_s: float = 30.0  # after stop: how long to keep trying to deliver what was read

    def __post_init__(self) -> None:
        if self.batch_records < 1 or self.batch_bytes < 1024 or self.linger_s < 0 or self.max_in_flight < 1:
            raise ValueError("batch_records >= 1, batch_bytes >= 1024, linger_s >= 0, max_in_flight >= 1")


@dataclass
class ShipStats:
    """Counts of units: ``read`` from the source, ``sent`` as records and ``rejected`` as dead
    letters, both acknowledged by Kafka. ``elapsed_s``: first unit read to last acknowledgement."""

    read: int = 0
    sent: int = 0
    rejected: int = 0
    messages: int = 0
    by_reason: Counter[str] = field(default_factory=Counter)
    samples: list[DeadLetter] = field(default_factory=list)  # the first few, for people
    started: float | None = None
    finished: float | None = None

    @property
    def pending(self) -> int:
        """Read but not (yet) in Kafka: 0 after a clean shutdown."""
        return self.read - self.sent - self.rejected

    @property
    def elapsed_s(self) -> float:
        if self.started is None or self.finished is None:
            return 0.0
        return max(self.finished - self.started, 1e-9)

    @property
    def records_per_s(self) -> float:
        return self.sent / self.elapsed_s if self.sent else 0.0


class ShipAborted(RuntimeError):
    """Delivery gave up: Kafka stayed unreachable past the drain timeout after a stop."""


@dataclass(slots=True)
class _Message:
    topic: str
    values: list[bytes]  # records (a JSON array on the wire), or one dead letter
    positions: list[tuple[int | None, int | None]]  # (offset, index) per record: for a split down to one
    future: asyncio.Future[Any] | None = None

    def payload(self) -> bytes:
        if self.topic != topics.REQUESTS:
            return self.values[0]
        return b"".join((b"[", b",".join(self.values), b"]"))


@dataclass(slots=True)
class _Batch:
    messages: list[_Message]
    callbacks: list[Callable[[], None]]


class Shipper:
    """Ships one source through one adapter; ``run`` until the source ends or ``stop`` is set."""

    SAMPLES = 5

    def __init__(self, source: Source, adapter: Adapter, producer: Producer, config: ShipConfig | None = None) -> None:
        self.source, self.adapter, self.producer = source, adapter, producer
        self.config = config or ShipConfig()
        self.stats = ShipStats()
        self._max_record = self.config.batch_bytes - 2
        self._records: list[bytes] = []
        self._positions: list[tuple[int | None, int | None]] = []
        self._bytes = 0
        self._letters: list[_Message] = []
        self._callbacks: list[Callable[[], None]] = []
        self._opened_at: float | None = None
        self._ready: deque[_Batch] = deque()
        self._inflight: deque[_Batch] = deque()
        self._lock = asyncio.Lock()
        self._sent = asyncio.Event()  # a batch went in flight
        self._acked = asyncio.Event()  # a batch was acknowledged (or delivery aborted)
        self._give_up_at: float | None = None
        self._aborted: ShipAborted | None = None
        self._delay = self.config.retry_initial_s
        self._partitions: list[int] | None = None  # of the requests topic, once looked up
        self._turn = 0

    # -- the loop -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> ShipStats:
        completer = asyncio.create_task(self._complete())
        tasks = [completer, asyncio.create_task(self._linger()), asyncio.create_task(self._on_stop(stop))]
        try:
            async with contextlib.aclosing(self.source.chunks(stop)) as chunks:
                async for chunk in chunks:
                    self._take(chunk)
                    await self._send_ready()
        except ShipAborted:
            pass  # reported by the drain below
        finally:
            self._give_up_at = self._give_up_at or time.monotonic() + self.config.drain_timeout_s
            try:
                await self._drain(completer)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await self.source.close()
        return self.stats

    async def _on_stop(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._give_up_at = time.monotonic() + self.config.drain_timeout_s

    async def _linger(self) -> None:
        """Send a partly filled batch once it is ``linger_s`` old (a quiet source's records)."""
        tick = max(self.config.linger_s / 2, 0.01)
        with contextlib.suppress(ShipAborted):
            while True:
                await asyncio.sleep(tick)
                if self._opened_at is not None and time.monotonic() - self._opened_at >= self.config.linger_s:
                    self._cut()
                    await self._send_ready()

    async def _drain(self, completer: asyncio.Task[None]) -> None:
        self._cut()
        with contextlib.suppress(ShipAborted):
            await self._send_ready()
        while (self._inflight or self._ready) and self._aborted is None and not completer.done():
            self._acked.clear()
            acked = asyncio.ensure_future(self._acked.wait())
            await asyncio.wait({completer, acked}, return_when=asyncio.FIRST_COMPLETED)
            acked.cancel()
        if self._aborted is not None:
            logger.error("%s; %d records read were not delivered", self._aborted, self.stats.pending)

    # -- units -> batches -----------------------------------------------------------------

    def _take(self, chunk: Chunk) -> None:
        result = ChunkResult()
        for unit in chunk.units:
            self._unit(unit, result)
        if chunk.on_published is not None:
            self._add_callback(functools.partial(chunk.on_published, result))

    def _unit(self, unit: Unit, result: ChunkResult) -> None:
        stats = self.stats
        stats.read += 1
        if stats.started is None:
            stats.started = time.monotonic()
        if unit.rejection is not None:
            self._reject(unit, unit.value, *unit.rejection, result)
            return
        value = unit.value
        if value is UNPARSED:
            try:
                value = orjson.loads(unit.raw or b"")
            except orjson.JSONDecodeError as exc:
                self._reject(unit, UNPARSED, "invalid_json", str(exc), result)
                return
        try:
            adapted = self.adapter(value)
            data = b"" if isinstance(adapted, Rejection) else orjson.dumps(adapted)
        except Exception as exc:  # a bug of ours: the line is kept as a dead letter, shipping goes on
            logger.exception("adapter failed on %s record %s", self.source.label, unit.index)
            adapted = Rejection("internal_error", f"{type(exc).__name__}: {exc}")
        if isinstance(adapted, Rejection):
            self._reject(unit, value, adapted.reason, adapted.error, result)
            return
        if len(data) > self._max_record:
            self._reject(unit, value, "too_large", f"record of {len(data):,} bytes exceeds the batch limit of "
                         f"{self.config.batch_bytes:,}", result)  # fmt: skip
            return
        if self._records and self._bytes + len(data) + 1 > self.config.batch_bytes:
            self._cut()
        self._open()
        self._records.append(data)
        self._positions.append((unit.offset, unit.index))
        self._bytes += len(data) + 1
        result.accepted += 1
        if len(self._records) >= self.config.batch_records:
            self._cut()

    def _reject(self, unit: Unit, value: Any, reason: str, error: str, result: ChunkResult) -> None:
        raw = unit.raw if unit.raw is not None else _as_bytes(value)
        letter = dead_letter(reason, error, raw, MessageOrigin(topic=self.source.label, offset=unit.offset), unit.index)
        self._letter(letter)
        result.rejected.append((unit.index, reason, error))

    def _letter(self, letter: DeadLetter) -> None:
        self._open()
        self._letters.append(_Message(topics.DEADLETTER, [letter.model_dump_json().encode()], []))
        self.stats.by_reason[letter.reason] += 1
        if len(self.stats.samples) < self.SAMPLES:
            self.stats.samples.append(letter)
        if len(self._letters) >= self.config.batch_records:
            self._cut()

    def _open(self) -> None:
        if self._opened_at is None:
            self._opened_at = time.monotonic()

    def _add_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once everything taken so far is acknowledged."""
        if self._records or self._letters:
            self._callbacks.append(callback)
        elif self._ready:
            self._ready[-1].callbacks.append(callback)
        elif self._inflight:
            self._inflight[-1].callbacks.append(callback)
        else:
            _call(callback)

    def _cut(self) -> None:
        """The open batch, ready to send."""
        if not (self._records or self._letters or self._callbacks):
            return
        messages = [_Message(topics.REQUESTS, self._records, self._positions)] if self._records else []
        self._ready.append(_Batch([*messages, *self._letters], self._callbacks))
        self._records, self._positions, self._bytes, self._letters, self._callbacks = [], [], 0, [], []
        self._opened_at = None

    # -- batches -> Kafka -----------------------------------------------------------------

    def _remaining(self) -> float | None:
        """Seconds left to deliver after a stop (None: no stop yet, retry for ever)."""
        if self._give_up_at is None:
            return None
        left = self._give_up_at - time.monotonic()
        if left <= 0:
            raise ShipAborted(f"Kafka still unreachable {self.config.drain_timeout_s:g} s after the stop")
        return left

    def _abort(self, exc: ShipAborted) -> None:
        if self._aborted is None:
            self._aborted = exc
        self._acked.set()

    async def _send_ready(self) -> None:
        try:
            await self._send_ready_locked()
        except ShipAborted as exc:
            self._abort(exc)
            raise

    async def _send_ready_locked(self) -> None:
        async with self._lock:
            while self._ready:
                while len(self._inflight) >= self.config.max_in_flight:
                    if self._aborted is not None:
                        raise self._aborted
                    self._acked.clear()
                    await self._acked.wait()
                batch = self._ready.popleft()
                for message in batch.messages:
                    await self._deliver(message)
                self._inflight.append(batch)
                self._sent.set()

    async def _deliver(self, message: _Message) -> None:
        """Hand ``message`` to the producer (its ``future`` then says when Kafka has it)."""
        while True:
            try:
                left = self._remaining()
                partition = await self._partition(message.topic)
                send = (
                    self.producer.send(message.topic, message.payload())
                    if partition is None
                    else self.producer.send(message.topic, message.payload(), partition=partition)
                )
                message.future = await (send if left is None else asyncio.wait_for(send, left))
                return
            except TOO_LARGE as exc:
                message.future = asyncio.get_running_loop().create_future()
                message.future.set_exception(exc)
                return
            except (KafkaError, TimeoutError) as exc:
                await self._backoff(exc)

    async def _partition(self, topic: str) -> int | None:
        """Request batches take the requests topic's partitions in turn. The worker's watermark
        is its slowest partition's, so every partition must move with the stream: spread at
        random, a fast backfill leaves a partition behind, and its windows then wait for the
        wall clock to close them. None: the producer chooses (dead letters; a producer that
        cannot list partitions)."""
        if topic != topics.REQUESTS:
            return None
        if self._partitions is None:
            lookup = getattr(self.producer, "partitions_for", None)
            self._partitions = sorted(await lookup(topic)) if lookup is not None else []
        if not self._partitions:
            return None
        self._turn += 1
        return self._partitions[self._turn % len(self._partitions)]

    async def _backoff(self, exc: Exception) -> None:
        left = self._remaining()
        logger.warning("Kafka: %s; retrying in %.1f s", exc or type(exc).__name__, self._delay)
        await asyncio.sleep(self._delay if left is None else min(self._delay, left))
        self._delay = min(self._delay * 2, self.config.retry_max_s)

    async def _complete(self) -> None:
        """Acknowledge batches in order: count them, run their callbacks."""
        try:
            while True:
                if not self._inflight:
                    self._sent.clear()
                    await self._sent.wait()
                    continue
                batch = self._inflight[0]
                await self._settle(batch)
                self._inflight.popleft()
                self._delay = self.config.retry_initial_s
                stats = self.stats
                for message in batch.messages:
                    if message.topic == topics.REQUESTS:
                        stats.sent += len(message.values)
                    else:
                        stats.rejected += 1
                stats.messages += len(batch.messages)
                stats.finished = time.monotonic()
                for callback in batch.callbacks:
                    _call(callback)
                self._acked.set()
        except ShipAborted as exc:
            self._abort(exc)

    async def _settle(self, batch: _Batch) -> None:
        """Wait until Kafka has every message of ``batch``, re-sending or splitting what failed."""
        index = 0
        while index < len(batch.messages):
            message = batch.messages[index]
            future = message.future
            assert future is not None
            try:
                while not future.done():  # in steps, so that a stop's deadline is noticed
                    left = self._remaining()
                    await asyncio.wait({future}, timeout=1.0 if left is None else min(1.0, left))
                future.result()
                index += 1
            except TOO_LARGE:
                batch.messages[index : index + 1] = parts = self._split(message)
                for part in parts:
                    await self._deliver(part)
            except (KafkaError, TimeoutError) as exc:
                await self._backoff(exc)
                await self._deliver(message)

    def _split(self, message: _Message) -> list[_Message]:
        """A message the broker refused as too large: halves, or for one record a dead letter."""
        if message.topic == topics.REQUESTS and len(message.values) > 1:
            half = len(message.values) // 2
            logger.warning("the broker refused %d records in one message as too large: sending them in halves",
                           len(message.values))  # fmt: skip
            return [_Message(message.topic, message.values[:half], message.positions[:half]),
                    _Message(message.topic, message.values[half:], message.positions[half:])]  # fmt: skip
        if message.topic == topics.REQUESTS:
            offset, index = message.positions[0]
            letter = dead_letter("too_large", f"record of {len(message.values[0]):,} bytes exceeds the broker's "
                                 "message size limit", message.values[0], MessageOrigin(topic=self.source.label,
                                 offset=offset), index)  # fmt: skip
            self.stats.by_reason[letter.reason] += 1
            return [_Message(topics.DEADLETTER, [letter.model_dump_json().encode()], [])]
        # A dead letter (at most 64 KiB of raw bytes) the broker refuses: keep its reason and position.
        shorter = DeadLetter.model_validate_json(message.values[0])
        shorter = shorter.model_copy(update={"raw": shorter.raw[:1024], "raw_truncated": True})
        return [_Message(topics.DEADLETTER, [shorter.model_dump_json().encode()], [])]


def _call(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:  # a consumer's callback must not stop the shipping
        logger.exception("a shipped-chunk callback failed")


def _as_bytes(value: Any) -> bytes:
    """A parsed item re-serialised for its dead letter; never raises."""
    if value is UNPARSED:
        return b""
    try:
        return orjson.dumps(value)
    except (orjson.JSONEncodeError, TypeError):
        return repr(value)[:65536].encode("utf-8", errors="replace")
