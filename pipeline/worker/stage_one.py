"""Stage 1 of the worker, without Kafka: raw messages of the requests topic -> dead letters
and closed window partials, one ``Windower`` shared by the worker's input partitions.
The Faust agents (``app``) and ``servewatch replay`` both run it; ``stage_two`` takes its
partials on."""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from servewatch.models.windows.batch import RowBatch
from servewatch.models.windows.lateness import LearnedLateness
from servewatch.models.windows.signal_columns import PrefixMemory
from servewatch.models.windows.window import WindowStats
from servewatch.models.windows.windowing import Windower
from servewatch.models.windows.wire import windows_to_wire
from servewatch.pipeline.messages.dead_letters import row_letter
from servewatch.pipeline.messages.decode import Decoded, decode_message, decode_records, one_record_line
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.messages.partitioning import partials_partition
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.worker import metrics
from servewatch.schemas.dead_letter import DeadLetter

logger = logging.getLogger(__name__)


#: Segments per partials message (see ``StageOne.bundles``).
BUNDLE_PARTIALS = 256


@dataclass
class StageOne:
    settings: Settings
    windower: Windower = field(init=False)
    last_seen: dict[int, float] = field(default_factory=dict)  # partition -> monotonic time of last message
    announced: dict[int, float] = field(default_factory=dict)  # partition -> last watermark broadcast
    # partition -> (token, latest window end it fed), in offset order: messages not yet safe to ack
    unacked: dict[int, deque[tuple[Any, float]]] = field(default_factory=dict)
    # Decoded messages not yet folded, as (rows, partition, offset, token), in arrival order.
    # A run of one-record messages is one entry, with an offset per row.
    pending: list[tuple[RowBatch, int, int | np.ndarray | None, Any]] = field(default_factory=list)
    pending_records: int = 0
    # partition -> the newest offset read here. Faust fetches again, after a seek to the
    # committed offsets (a rebalance, the group membership lost while the broker was
    # frozen), messages this worker already folded: their window may have been sent since,
    # and forgotten with it the request ids that tell a repeat, so folded again they would
    # form a second partial of the window, mixed with records read since, which stage 2
    # cannot tell apart from a replay. Kept across revocations: what was read here and is
    # read here again was sent from here.
    read_until: dict[int, int] = field(default_factory=dict)
    redelivered: int = 0  # records of messages read here before (counted as duplicates)
    _reading_again: set[int] = field(init=False, default_factory=set)  # partitions told of (one warning a seek)
    _warned_ids: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        # One segmenter and one set of open windows for all partitions of this worker: the
        # segment cap is per worker, and a segment costs one table row, not one per partition.
        self._segmenter = self.settings.segmenter()
        settings = self.settings
        learned = settings.windows.max_lateness_s > settings.windows.allowed_lateness_s
        self.windower = Windower(
            self._segmenter,
            window_s=settings.windows.window_s,
            allowed_lateness_s=settings.windows.allowed_lateness_s,
            evidence_k=settings.evidence_budget().worst,
            markers=tuple(settings.detection.reasoning_markers),
            prefixes=PrefixMemory(settings.segments.prefix_memory),
            lateness=LearnedLateness(
                settings.windows.allowed_lateness_s, settings.windows.max_lateness_s, settings.windows.lateness_prior_s
            )
            if learned
            else None,
            max_future_s=settings.windows.max_future_s,
            dedup=settings.windows.dedup_request_ids,
            replicas=settings.replica_segmenter(),
        )

    def process(
        self,
        raw: bytes | None,
        source: MessageOrigin,
        now: float | None = None,
        token: Any = None,
        wall: float | None = None,
    ) -> tuple[list[DeadLetter], list[WindowStats]]:
        """Decode one message, fold its records in (with the messages before it, once enough
        are pending: ``fold_pending``), return dead letters and closed partials.

        ``token`` (the Faust event) is handed back by ``safe_to_ack`` once the message was
        folded and every window it fed has been released, so offsets are committed only for
        records whose partials are on their way: a crash replays the rest (at-least-once).
        Records too far in the future (``Windower.future``, against the wall clock ``wall``)
        are dead letters: waiting for their window would hold every later offset back.
        """
        decoded = decode_message(raw, source, self.settings.kafka.max_message_bytes)
        partition = source.partition or 0
        rows = self._refuse_future(decoded, partition, source, time.time() if wall is None else wall)
        metrics.RECORDS.inc(len(rows))  # read, whether folded or read before (then a duplicate too)
        if source.offset is not None:
            read_until = self.read_until.get(partition, -1)
            if source.offset <= read_until:
                self._note_read_again(partition, source.offset, read_until, len(rows))
                rows = rows.without(np.ones(len(rows), dtype=bool))  # acknowledged in its turn, folded once
            else:
                self._reading_again.discard(partition)
                self.read_until[partition] = source.offset
        self.pending.append((rows, partition, source.offset, token))
        self.pending_records += len(rows)
        self.last_seen[partition] = time.monotonic() if now is None else now
        metrics.MESSAGES.inc()
        metrics.LAST_MESSAGE.set_to_current_time()
        for letter in decoded.dead_letters:
            metrics.DEAD_LETTERS.labels(letter.reason).inc()
        # Folding is batched across messages (its numpy calls cost per pass), but never past
        # a message that moves a watermark into another window: what closes, and when, is
        # what folding every message at once would give.
        if self.pending_records >= self.settings.windows.fold_records or (
            len(rows) and self.windower.would_advance(partition, float(rows.column("timestamp").max()))
        ):
            self.fold_pending()
        closed = self.windower.close_due()
        if closed:
            metrics.ALLOWED_LATENESS.set(self.windower.allowed_lateness)
        return decoded.dead_letters, closed

    def process_batch(
        self,
        topic: str,
        partition: int,
        messages: Sequence[tuple[bytes | None, int]],
        token_of: Callable[[int], Any],
        now: float | None = None,
        wall: float | None = None,
    ) -> tuple[list[DeadLetter], list[WindowStats]]:
        """Several messages of one partition in offset order, as (value, offset): what
        ``process`` gives for each in turn, at a fraction of its cost per message.

        Runs of messages that hold one record each (``one_record_line``) are decoded in one
        call and folded as one batch with an offset per row; any other message, or a run
        with a record that needs the careful path, goes through ``process``. ``token_of``
        makes a message's token; tokens must be cumulative (acknowledging one acknowledges
        every earlier message of the partition, as a ``BatchReader``'s do), so only the
        messages that end a step of the fold get one.
        """
        letters: list[DeadLetter] = []
        closed: list[WindowStats] = []
        run: list[tuple[bytes, int]] = []
        max_bytes = self.settings.kafka.max_message_bytes
        for raw, offset in messages:
            if one_record_line(raw) and len(raw or b"") <= max_bytes:
                run.append((raw or b"", offset))
                continue
            if run:
                self._process_run(topic, partition, run, token_of, now, wall, letters, closed)
                run = []
            origin = MessageOrigin(topic, partition, offset)
            more_letters, more_closed = self.process(raw, origin, now, token_of(offset), wall)
            letters.extend(more_letters)
            closed.extend(more_closed)
        if run:
            self._process_run(topic, partition, run, token_of, now, wall, letters, closed)
        return letters, closed

    def _process_run(
        self,
        topic: str,
        partition: int,
        run: list[tuple[bytes, int]],
        token_of: Callable[[int], Any],
        now: float | None,
        wall: float | None,
        letters: list[DeadLetter],
        closed: list[WindowStats],
    ) -> None:
        """One-record messages of ``partition`` in offset order: folded together, or one by one
        through ``process`` when any needs it (a bad record, one ahead of the clock)."""
        read_until = self.read_until.get(partition, -1)
        fresh = run if run[0][1] > read_until else [message for message in run if message[1] > read_until]
        rows = decode_records([raw for raw, _ in fresh]) if fresh else RowBatch([])
        horizon = self.windower.future_horizon(partition, time.time() if wall is None else wall)
        if rows is None or (len(rows) and bool((rows.column("timestamp") > horizon).any())):
            for raw, offset in run:
                origin = MessageOrigin(topic, partition, offset)
                more_letters, more_closed = self.process(raw, origin, now, token_of(offset), wall)
                letters.extend(more_letters)
                closed.extend(more_closed)
            return
        if len(fresh) < len(run):
            self._note_read_again(partition, run[0][1], read_until, len(run) - len(fresh))
        metrics.RECORDS.inc(len(run))
        metrics.MESSAGES.inc(len(run))
        metrics.LAST_MESSAGE.set_to_current_time()
        self.last_seen[partition] = time.monotonic() if now is None else now
        if not fresh:
            self.pending.append((rows, partition, None, token_of(run[-1][1])))
            return
        self.read_until[partition] = fresh[-1][1]
        offsets = np.fromiter((offset for _, offset in fresh), dtype=np.int64, count=len(fresh))
        times = rows.column("timestamp")
        start = 0
        while start < len(rows):
            # Fold up to and with the first record that moves the watermark into another
            # window, close what that closes, go on: what ``process`` does message by message.
            stop = start + self.windower.first_advancing(partition, times[start:]) + 1
            for first, last in self._ack_steps(times, start, stop):
                token = token_of(int(offsets[last - 1]))
                self.pending.append((rows.slice(first, last), partition, offsets[first:last], token))
            self.pending_records += stop - start
            if stop < len(rows) or self.windower.would_advance(partition, float(times[stop - 1])):
                self.fold_pending()
                self._close_due(closed)
            start = stop
        if self.pending_records >= self.settings.windows.fold_records:
            self.fold_pending()
        self._close_due(closed)

    def _ack_steps(self, times: np.ndarray, start: int, stop: int) -> list[tuple[int, int]]:
        """Records ``start`` to ``stop`` as runs that each end just before the latest window
        fed so far moves on: a message is acknowledged once every window it and those before
        it fed was sent, so cutting there acknowledges each message as soon as reading them
        one by one would."""
        windows = np.maximum.accumulate(np.floor(times[start:stop] / self.windower.window_s))
        cuts = (np.flatnonzero(np.diff(windows) > 0) + 1 + start).tolist()
        edges = [start, *cuts, stop]
        return list(itertools.pairwise(edges))

    def _close_due(self, closed: list[WindowStats]) -> None:
        more = self.windower.close_due()
        if more:
            metrics.ALLOWED_LATENESS.set(self.windower.allowed_lateness)
            closed.extend(more)

    def _note_read_again(self, partition: int, offset: int, read_until: int, records: int) -> None:
        if partition not in self._reading_again:
            self._reading_again.add(partition)
            logger.warning("partition %d is read again from offset %d (read here up to %d): those records "
                           "were folded already and are counted as duplicates", partition, offset,
                           read_until)  # fmt: skip
        self.redelivered += records
        metrics.DUPLICATE_RECORDS.inc(records)

    def _refuse_future(self, decoded: Decoded, partition: int, source: MessageOrigin, wall: float) -> RowBatch:
        rows = decoded.rows()
        if not len(rows):
            return rows
        times = rows.column("timestamp")
        horizon = self.windower.future_horizon(partition, wall)
        future = times > horizon
        if not future.any():
            return rows
        allowed = self.settings.windows.max_future_s
        for index in np.flatnonzero(future).tolist():
            error = (
                f"timestamp {times[index]:.3f} is {times[index] - horizon + allowed:,.0f} s past the wall clock and "
                f"its partition's newest event time (at most {allowed:g} s, SERVEWATCH_MAX_FUTURE_S)"
            )
            position = int(rows.positions[index])
            decoded.dead_letters.append(row_letter("future_timestamp", error, rows.rows[index], source, position))
        return rows.without(future)

    def fold_pending(self) -> None:
        """Fold every decoded message still waiting; each becomes ackable once its windows are sent."""
        if not self.pending:
            return
        pending, self.pending, self.pending_records = self.pending, [], 0
        repeats = self.windower.duplicates
        fed = self.windower.add_many([(rows, partition, offset) for rows, partition, offset, _ in pending])
        if self.windower.duplicates > repeats:
            repeated = self.windower.duplicates - repeats
            metrics.DUPLICATE_RECORDS.inc(repeated)
            folded = sum(len(rows) for rows, _, _, _ in pending)
            if repeated > 100 and repeated > folded / 2 and not self._warned_ids:
                self._warned_ids = True  # once: a retried batch is normal, half the stream is not
                logger.warning(
                    "%d of %d records repeat a request_id already in their window: if request ids are not unique "
                    "in your logs, set SERVEWATCH_DEDUP_REQUEST_IDS=false", repeated, folded,
                )  # fmt: skip
        for (_, partition, _, token), fed_until in zip(pending, fed, strict=True):
            if token is not None:
                self.unacked.setdefault(partition, deque()).append((token, fed_until))

    @property
    def oldest_pending_offset(self) -> dict[int, int]:
        """Per partition, the first offset decoded but not yet folded."""
        oldest: dict[int, int] = {}
        for _, partition, offset, _ in self.pending:
            if offset is not None:
                oldest.setdefault(partition, int(offset[0]) if isinstance(offset, np.ndarray) else offset)
        return oldest

    def bundles(self, partials: list[WindowStats], partitions: int) -> list[tuple[int, bytes]]:
        """What to send to each partials partition: its partials, then every source's new
        watermark, as (partition, message) in sending order.

        A few messages per partials partition per flush, not one per partial: Faust pays per
        message on both ends. At most ``BUNDLE_PARTIALS`` segments per message, so neither
        side ever holds a whole window's worth of encoded partials at once (with thousands of
        segments closing together, that was the worker's memory high-water mark). Partials
        go to ``partials_partition(key)``, so a segment (and every replica row of a
        model) always lands on the same stage-2 partition; watermarks go to every partition,
        in the last message, after the partials, which is what lets stage 2 know a window is
        complete.
        """
        grouped: dict[int, list[WindowStats]] = {}
        for partial in partials:
            grouped.setdefault(partials_partition(partial.key, partitions), []).append(partial)
        marks = {str(source): mark for source, mark in self.watermarks_to_announce().items()}
        out = []
        for k in range(partitions) if marks else sorted(grouped):
            mine = grouped.get(k, [])
            for start in range(0, len(mine), BUNDLE_PARTIALS) if mine else [0]:
                last = start + BUNDLE_PARTIALS >= len(mine)
                chunk = windows_to_wire(mine[start : start + BUNDLE_PARTIALS])
                out.append((k, orjson.dumps({"windows": chunk, "watermarks": marks if last else {}})))
        return out

    def acknowledge_in_order(self, partition: int, token: Any) -> None:
        """A message that could not be processed (it was dead-lettered whole): acknowledged
        after every earlier message of its partition, never at once. Faust commits the end of
        the first run of acknowledged offsets, past an unacknowledged one below it, so acking
        it at once would commit past earlier messages still feeding open windows."""
        self.fold_pending()  # earlier messages first in the queue
        self.unacked.setdefault(partition, deque()).append((token, -math.inf))

    def safe_to_ack(self) -> list[Any]:
        """Tokens of messages all of whose windows have been released (call after sending partials)."""
        safe: list[Any] = []
        horizon = self.windower.oldest_open_start
        for waiting in self.unacked.values():
            # Kafka commits a contiguous prefix of offsets, so acknowledging in order, stopping
            # at the first message still feeding an open window, loses nothing and is O(acked).
            while waiting and waiting[0][1] <= horizon:
                safe.append(waiting.popleft()[0])
        return safe

    def watermarks_to_announce(self) -> dict[int, float]:
        """Partitions whose watermark crossed a window boundary since it was last broadcast.

        Every partition announces the shared watermark (the slowest partition's): windows
        are shared, so a partition's records up to its own watermark are not all sent
        until the slowest partition lets their windows close.
        """
        length = self.settings.windows.window_s
        due = {}
        # A watermark says every window ending by it was sent: never past a window still open.
        # (Closing one can move the watermark on: the allowed lateness it learns shrinks.)
        mark = min(self.windower.watermark, self.windower.oldest_open_start)
        for partition in self.windower.max_event_time:
            last = self.announced.get(partition)
            if math.isfinite(mark) and (last is None or math.floor(mark / length) > math.floor(last / length)):
                due[partition] = mark
                self.announced[partition] = mark
        return due

    def quiet(self, now: float | None = None) -> bool:
        """Whether some partition has been silent long enough for ``flush_idle`` to move it on."""
        now = time.monotonic() if now is None else now
        idle_s = self.settings.windows.idle_flush_s
        return bool(self.windower.open or self.windower.held) and any(
            now - seen >= idle_s for seen in self.last_seen.values()
        )

    def hold_idle(self, now: float | None = None) -> None:
        """The broker is not answering: silence is not idleness. Every partition's silence
        starts over, so that what the broker held back is not late when it comes back."""
        now = time.monotonic() if now is None else now
        for partition in self.last_seen:
            self.last_seen[partition] = now

    def take_over(self, partitions: set[int], now: float | None = None) -> None:
        """``partitions`` were assigned here: until each is read (or silent for ``idle_flush_s``
        with nothing left to read), it holds the windows open (``Windower.hold``). A partition
        taken over from a crashed worker is behind the others; its records are not late."""
        now = time.monotonic() if now is None else now
        self.windower.hold(partitions)
        for partition in partitions:
            self.last_seen.setdefault(partition, now)

    def flush_idle(self, now: float | None = None, unread: Set[int] = frozenset()) -> list[WindowStats]:
        """Partials that silence completed: partitions quiet for ``idle_flush_s`` advance their
        event time with the wall clock (see ``Windower.advance_idle``); a partition assigned
        and silent as long stops holding the windows.

        A partition in ``unread`` still has records to read (the consumer knows its end is
        past its position): its silence is a slow read, not idleness, and it holds the
        windows for up to ``assembler_max_wait_s``, as stage 2 waits for a silent source."""
        now = time.monotonic() if now is None else now
        self.fold_pending()
        windows = self.settings.windows

        def idle(partition: int) -> bool:
            silent_s = now - self.last_seen.get(partition, now)
            return silent_s >= (windows.assembler_max_wait_s if partition in unread else windows.idle_flush_s)

        silent = {p for p in self.windower.held if idle(p)}
        flushed: list[WindowStats] = self.windower.release(silent) if silent else []
        flushed += self.windower.close_due()
        for partition, seen in self.last_seen.items():
            if idle(partition) and self.windower.open:
                flushed.extend(self.windower.advance_idle(now - seen, partition))
        return flushed

    def flush_all(self) -> list[WindowStats]:
        self.fold_pending()
        return self.windower.flush_all()

    def drop_partitions(self, partitions: set[int]) -> list[WindowStats]:
        """On revocation: hand over what was aggregated so far, then forget the partitions.

        The open windows are shared, so all of them are sent: the partitions kept send
        what they add later as further partials of the same windows, which stage 2 merges
        (or counts as late, if every source had already moved past them).
        """
        self.fold_pending()
        flushed = self.windower.flush_all() if partitions & set(self.windower.max_event_time) else []
        self.windower.forget(partitions)
        for part in partitions:
            self.last_seen.pop(part, None)  # its unacked messages become safe: all was flushed
        return flushed

    @property
    def overflowed_records(self) -> int:
        return self._segmenter.overflowed
