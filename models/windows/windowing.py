"""Event-time windowing in two stages, shared by the Faust worker and ``servewatch replay``.

Stage 1 (``Windower``, one per worker, shared by the input partitions it reads) folds
batches of request logs into per-(segment, window) tables and releases a window's partials
once every partition's watermark (newest event time minus the allowed lateness) has passed
its end. Sharing the open windows across partitions keeps one table row per segment, not
one per segment and partition, and sends stage 2 one partial per segment window.

Stage 2 (``WindowAssembler``, keyed by segment) merges the partials that different
partitions sent for the same window and releases each segment's windows in order after a
short grace period, dropping duplicates (a replay after a crash resends partials with the
same source offsets) and counting partials that arrive after their window was released.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servewatch.models.windows.batch import RowBatch
from servewatch.models.windows.lateness import LearnedLateness, disorder_of
from servewatch.models.windows.open_window import OpenWindow, fold_batch
from servewatch.models.windows.segments import Segmenter
from servewatch.models.windows.signal_columns import DEFAULT_REASONING_MARKERS, PrefixMemory
from servewatch.models.windows.window import WindowBlock, WindowStats

#: Request ids remembered per open window for de-duplication: beyond, repeats go uncounted
#: (8 MB of hashes for a window of a million requests).
DEDUP_IDS_PER_WINDOW = 1_000_000
#: Sorted runs of remembered ids a window keeps before merging them into one.
DEDUP_RUNS = 8
#: Released windows per partials partition whose record offsets stage 2 remembers, to tell
#: a partial re-read after a rebalance (a duplicate) from a late one.
RELEASED_MEMORY_WINDOWS = 64


@dataclass
class Windower:
    """Stage 1: records of the worker's input partitions -> closed per-segment window partials.

    Each partition has its own watermark; the windows are shared, and one closes when the
    slowest partition's watermark has passed it (a partition that went quiet moves on with
    the wall clock, see ``advance_idle``; one handed to another worker is ``forget``-ten).

    The event-time contract (docs/operating.md, "Event time"): a watermark is the partition's newest
    event time minus the allowed lateness, fixed (``allowed_lateness_s``) or learned from
    how far behind records arrive (``lateness``); a record more than ``max_future_s`` past
    both the wall clock and its partition's newest event time is refused (``future``), so
    that no window is held open, and no offset left unacknowledged, for longer than that
    plus the lateness; with ``dedup``, a ``request_id`` seen before in its window is
    counted (``duplicates``) and not folded again.

    >>> w = Windower(Segmenter(), window_s=10, allowed_lateness_s=0)
    >>> base = dict(model="m", prompt_tokens=10, completion_tokens=5, e2e_s=1.0, finish_reason="stop")
    >>> w.add([{"request_id": "a", "timestamp": 1_700_000_001.0, "ttft_s": 0.2, **base}])  # fed until
    1700000010.0
    >>> w.close_due()
    []
    >>> w.add([{"request_id": "b", "timestamp": 1_700_000_011.0, "ttft_s": 0.3, **base}])
    1700000020.0
    >>> [(p.start, p.requests) for p in w.close_due()]
    [(1700000000.0, 1)]
    """

    segmenter: Segmenter
    window_s: float = 10.0
    allowed_lateness_s: float = 5.0
    evidence_k: int = 5
    markers: tuple[str, ...] = DEFAULT_REASONING_MARKERS  # reasoning end markers that must not reach answers
    prefixes: PrefixMemory = field(default_factory=PrefixMemory)  # prompt prefixes seen by this worker
    open: dict[float, OpenWindow] = field(default_factory=dict)  # by window start
    max_event_time: dict[int, float] = field(default_factory=dict)  # by partition
    # Watermark floors set by processing time while a partition is silent, by partition.
    idle_floor: dict[int, float] = field(default_factory=dict)
    # Partitions assigned here and not read yet: each holds every window open until its
    # first records (or ``release``, once it has stayed silent), as a partition read since
    # long would. A batch of another partition's records must not close the windows that a
    # partition taken over from a crashed worker, still behind, has records for.
    held: set[int] = field(default_factory=set)
    rows_hint: int = 0  # segments in the last window closed: the next one's table starts that big
    lateness: LearnedLateness | None = None  # None: ``allowed_lateness_s``, fixed
    max_future_s: float = math.inf
    dedup: bool = False
    duplicates: int = 0  # records dropped as a request_id already seen in their window
    # Replica rows (``models.detect.replicas``): every record that names its instance folded
    # again by segment and instance into windows of their own, closed with the segments'
    # windows. None: off.
    replicas: Segmenter | None = None
    open_replicas: dict[float, OpenWindow] = field(default_factory=dict, repr=False)
    # window start -> sorted runs of the hashes of the request ids folded into it
    _seen_ids: dict[float, list[np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def allowed_lateness(self) -> float:
        return self.allowed_lateness_s if self.lateness is None else self.lateness.value

    def watermark_of(self, partition: int) -> float:
        newest = self.max_event_time.get(partition, -math.inf)
        return max(newest - self.allowed_lateness, self.idle_floor.get(partition, -math.inf))

    def future_horizon(self, partition: int, now: float) -> float:
        """The latest event time ``partition`` may deliver now: ``max_future_s`` past both the
        wall clock ``now`` and the partition's newest event time (a backfill or a simulated
        clock may run ahead of the wall, never jump). Later records are refused."""
        return max(now, self.max_event_time.get(partition, -math.inf)) + self.max_future_s

    @property
    def watermark(self) -> float:
        """The slowest partition's watermark: every window ending by it is complete here."""
        if self.held:
            return -math.inf
        return min((self.watermark_of(p) for p in self.max_event_time), default=-math.inf)

    def hold(self, partitions: set[int]) -> None:
        """``partitions`` were assigned here: hold the windows open until each is read (see ``held``)."""
        self.held |= partitions - self.max_event_time.keys()

    def release(self, partitions: set[int]) -> list[WindowStats]:
        """Held ``partitions`` that stayed silent stop holding the windows; what that closes."""
        self.held -= partitions
        return self.close_due()

    def advance_idle(self, silent_s: float, partition: int = 0) -> list[WindowStats]:
        """``partition`` has been silent for ``silent_s`` wall seconds: let its event time
        move on by as much (as a live source's would) and close what that completes.

        Without this a quiet partition would hold its last windows open until traffic came
        back; with it, a window closes about ``allowed_lateness_s`` after its end even when
        nothing follows it.
        """
        newest = self.max_event_time.get(partition, -math.inf)
        floor = max(self.idle_floor.get(partition, -math.inf), newest + silent_s - self.allowed_lateness)
        self.idle_floor[partition] = floor
        return self.close_due()

    def forget(self, partitions: set[int]) -> None:
        """Partitions no longer read here (revoked) stop holding windows back."""
        for partition in partitions:
            self.max_event_time.pop(partition, None)
            self.idle_floor.pop(partition, None)
            self.held.discard(partition)

    def add(self, rows: RowBatch | Sequence[Mapping[str, Any]], partition: int = 0, offset: int | None = None) -> float:
        """Fold a batch of rows in; return the latest window end they touched (-inf for none)."""
        batch = rows if isinstance(rows, RowBatch) else RowBatch(rows)
        return self.add_many([(batch, partition, offset)])[0]

    def add_many(self, messages: Sequence[tuple[RowBatch, int, int | np.ndarray | None]]) -> list[float]:
        """Fold several messages' rows, as (batch, partition, offset), in one pass; per message,
        the latest window end it touched (-inf for none). ``offset`` may also be one offset
        per row: a run of one-record messages folded as one.

        One pass over a few thousand records costs much less than one per 500-record
        message: the fold's numpy calls are paid per pass, not per record.
        """
        fed = [-math.inf] * len(messages)
        parts = [(i, batch, partition, offset) for i, (batch, partition, offset) in enumerate(messages) if len(batch)]
        if not parts:
            return fed
        batch = RowBatch.concat([part[1] for part in parts])
        message = np.repeat(np.arange(len(parts)), [len(part[1]) for part in parts])
        window_ids = np.floor(batch.column("timestamp") / self.window_s).astype(np.int64)
        repeated = self._repeated_ids(batch, window_ids) if self.dedup else None
        if repeated is not None:
            self.duplicates += int(repeated.sum())
            batch, message, window_ids = batch.without(repeated), message[~repeated], window_ids[~repeated]
        partitions = np.array([part[2] for part in parts], dtype=np.int64)[message]
        offsets = _row_offsets(parts) if repeated is None else _row_offsets(parts)[~repeated]
        if len(batch):
            fold_batch(
                batch, self.segmenter, self.window_s, self.open, self.evidence_k, partitions, offsets,
                self.markers, self.prefixes, rows_hint=max(self.rows_hint, 8),
                also=[] if self.replicas is None else [(self.replicas, self.open_replicas)],
            )  # fmt: skip
        times = batch.column("timestamp")
        lengths = np.bincount(message, minlength=len(parts)).tolist()
        ends = np.cumsum(lengths)
        for (i, _, partition, offset), end, length in zip(parts, ends.tolist(), lengths, strict=True):
            if not length:
                continue  # every record of it was a repeat
            mine = slice(end - length, end)
            touched = np.unique(window_ids[mine]).tolist()
            if offset is not None:
                for window_id in touched:
                    first, last = (
                        _offsets_in(offsets[mine], window_ids[mine], window_id, len(touched))
                        if isinstance(offset, np.ndarray)
                        else (offset, offset)
                    )
                    self.open[float(window_id * self.window_s)].note_offset(partition, first, last)
                    replica_window = self.open_replicas.get(float(window_id * self.window_s))
                    if replica_window is not None:  # none where no record of the window names its instance
                        replica_window.note_offset(partition, first, last)
            newest_before = self.max_event_time.get(partition, -math.inf)
            if self.lateness is not None:
                self.lateness.observe(disorder_of(times[mine], newest_before))
            self.max_event_time[partition] = max(newest_before, float(times[mine].max()))
            self.held.discard(partition)
            fed[i] = float((touched[-1] + 1) * self.window_s)
        return fed

    def _repeated_ids(self, batch: RowBatch, window_ids: np.ndarray) -> np.ndarray | None:
        """Rows whose ``request_id`` was already folded into their window (a shipper's
        re-sent batch), or None when there is none: the first sighting counts, later ones
        are repeats. Each open window keeps the 64-bit hashes of its ids (8 bytes an id, up
        to ``DEDUP_IDS_PER_WINDOW``) as a few sorted runs, searched with numpy and merged
        once there are more than ``DEDUP_RUNS``: no Python step per row, and no re-sort of
        the whole window per batch."""
        hashes = np.fromiter(map(hash, batch.values("request_id")), dtype=np.int64, count=len(batch))
        repeated = np.zeros(len(hashes), dtype=bool)
        distinct = np.unique(window_ids)
        for window_id in distinct.tolist():
            start = float(window_id * self.window_s)
            runs = self._seen_ids.setdefault(start, [])
            if sum(len(run) for run in runs) >= DEDUP_IDS_PER_WINDOW:
                continue
            rows = np.arange(len(hashes)) if len(distinct) == 1 else np.flatnonzero(window_ids == window_id)
            order = np.argsort(hashes[rows], kind="stable")  # stable: the first of equal ids comes first
            ordered = hashes[rows][order]
            again = np.zeros(len(ordered), dtype=bool)
            again[1:] = ordered[1:] == ordered[:-1]  # repeats within the batch
            for run in runs:  # repeats of ids folded before; sorted needles search in cache order
                again |= run[np.minimum(np.searchsorted(run, ordered), len(run) - 1)] == ordered
            repeated[rows[order]] = again
            fresh = ordered[~again]
            if len(fresh):
                runs.append(fresh)
            if len(runs) > DEDUP_RUNS:
                runs[:] = [np.sort(np.concatenate(runs))]
        return repeated if repeated.any() else None

    def would_advance(self, partition: int, newest: float) -> bool:
        """Whether event time ``newest`` moves ``partition``'s watermark into another window:
        data held back from the fold up to then changes nothing that closes (windows close
        on whole multiples of the window length), so a caller may batch until it does."""
        folded = self.max_event_time.get(partition)
        if folded is None:
            return True
        length, lateness = self.window_s, self.allowed_lateness
        return math.floor((newest - lateness) / length) > math.floor((folded - lateness) / length)

    def first_advancing(self, partition: int, times: np.ndarray) -> int:
        """Index of the first of ``times`` that ``would_advance``, or the last index when none does."""
        folded = self.max_event_time.get(partition)
        if folded is None:
            return 0
        length, lateness = self.window_s, self.allowed_lateness
        advancing = np.floor((times - lateness) / length) > math.floor((folded - lateness) / length)
        return int(np.argmax(advancing)) if advancing.any() else len(times) - 1

    @property
    def oldest_open_start(self) -> float:
        """Start of the oldest window still held here (+inf when none): everything before it was sent."""
        return min(self.open, default=math.inf)

    def close_due(self) -> list[WindowStats]:
        """Partials whose window ended at or before the watermark, oldest first."""
        watermark = self.watermark
        return self._close(sorted(start for start in self.open if start + self.window_s <= watermark), watermark)

    def flush_all(self) -> list[WindowStats]:
        """Everything still open (end of input, a partition revoked, or shutting down)."""
        starts = sorted(self.open)
        # Flushing declares this stage done with every window it had: its watermark moves
        # to the end of the newest one.
        done = max((start + self.window_s for start in starts), default=self.watermark)
        return self._close(starts, max(done, self.watermark))

    def _close(self, starts: list[float], watermark: float) -> list[WindowStats]:
        """The partials of the given windows, in (start, key) order, stamped with the watermark."""
        closed = []
        for start in starts:
            window = self.open.pop(start)
            self._seen_ids.pop(start, None)
            if self.lateness is not None:
                self.lateness.window_closed()
            self.rows_hint = len(window)
            self.segmenter.note_seen(window.segment_ids, start + self.window_s)
            partials = window.partials(self.segmenter.keys)
            replica_window = self.open_replicas.pop(start, None)
            if replica_window is not None and self.replicas is not None:
                self.replicas.note_seen(replica_window.segment_ids, start + self.window_s)
                partials += replica_window.partials(self.replicas.keys)
            for partial in sorted(partials, key=lambda p: p.key):
                partial.watermark = watermark
                closed.append(partial)
        return closed


@dataclass(slots=True)
class _Pending:
    """One window's partials that came through one partials partition, merged per segment
    into rows of a block of its own (so the blocks the partials arrived in can go)."""

    first_seen: float
    block: WindowBlock
    by_segment: dict[str, WindowStats] = field(default_factory=dict)

    def target(self, partial: WindowStats) -> WindowStats:
        """The segment's accumulator, a new empty row the first time."""
        merged = self.by_segment.get(partial.key)
        if merged is None:
            row = len(self.by_segment)
            self.block.make_room(row + 1)
            merged = self.by_segment[partial.key] = WindowStats(
                partial.key, partial.start, partial.length, block=self.block, row=row, watermark=partial.watermark
            )
        return merged


def _overlaps(ranges: list[tuple[int, int, int]], candidate: tuple[int, int, int]) -> bool:
    partition, first, last = candidate
    return any(p == partition and a <= last and first <= b for p, a, b in ranges)


def _covered(ranges: list[tuple[int, int, int]], candidate: tuple[int, int, int]) -> bool:
    """Every offset of ``candidate`` lies in ``ranges`` (adjacent ranges join up)."""
    partition, first, last = candidate
    reach = first - 1  # the highest offset known covered, walking up from ``first``
    for _, a, b in sorted(r for r in ranges if r[0] == partition):
        if a > reach + 1:
            break
        reach = max(reach, b)
    return reach >= last


@dataclass
class WindowAssembler:
    """Stage 2: merge partials per (segment, window); release complete windows in order.

    Watermarks travel with the data: every stage-1 partition broadcasts its watermark to
    every partials partition after the partials it sent there (``heartbeat``). Kafka keeps
    order within a partition, so once source ``q``'s watermark has arrived through partials
    partition ``k`` past a window's end, every partial ``q`` sent to ``k`` for that window is
    already here. A window is released when that holds for every source partition heard
    from recently and ``grace_s`` has passed, or in any case ``max_wait_s`` after its first
    partial. ``expected_partitions`` source partitions count as heard from at start-up, so a
    worker starting on a backlog waits for all of them. Times are wall-clock seconds from
    the caller, so tests and replay drive it with their own clock.

    Bookkeeping is per (partials partition, window), not per segment: all segments of a
    window that came through one partials partition become due together, so a thousand
    segments cost a thousand dict entries while they wait, not a thousand heap entries.
    A partial that arrives after its window was released through its partition is late.
    """

    grace_s: float = 0.0
    max_wait_s: float = 10.0
    expected_partitions: int = 0
    pending: dict[tuple[int, float], _Pending] = field(default_factory=dict)  # (via, start) ->
    released_until: dict[int, float] = field(default_factory=dict)  # via -> end of newest window released
    # (partials partition, source partition) -> (watermark, wall time heard)
    progress: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    late_partials: int = 0
    duplicate_partials: int = 0
    # Partials holding some offsets already merged into their window and some not (a worker
    # re-reading after a crash folds records judged before together with new ones). They
    # cannot be split, so they are not merged; the caller dead-letters where their records are.
    overlapping_partials: int = 0
    # Where the records of recently released windows were, as (via, start) -> source
    # partition -> (first, last) offset: a partial re-read after a rebalance or a crash
    # falls inside and is a duplicate; a late one carries offsets read after its window
    # closed. Kept for ``RELEASED_MEMORY_WINDOWS`` windows per partials partition.
    released_sources: dict[tuple[int, float], dict[int, tuple[int, int]]] = field(default_factory=dict, repr=False)
    _by_end: dict[int, list[tuple[float, float]]] = field(default_factory=dict, repr=False)  # via -> (end, start)
    _by_age: list[tuple[float, tuple[int, float]]] = field(default_factory=list, repr=False)
    _rows_hint: dict[int, int] = field(default_factory=dict, repr=False)  # via -> segments of its last window

    def heartbeat(self, source: int, watermark: float, now: float, via: int = 0) -> None:
        self._expect_partitions(via, now)
        newest, _ = self.progress.get((via, source), (-math.inf, now))
        self.progress[(via, source)] = (max(newest, watermark), now)

    def _expect_partitions(self, via: int, now: float) -> None:
        if self.expected_partitions and (via, 0) not in self.progress:
            for source in range(self.expected_partitions):
                self.progress.setdefault((via, source), (-math.inf, now))

    def add(self, partial: WindowStats, now: float, via: int = 0) -> None:
        # A partial's own watermark is not progress: the partials sent with it may still be
        # on their way. Progress comes only from heartbeats, which follow them; a source seen
        # for the first time is registered as "not there yet".
        self._expect_partitions(via, now)
        for source, _, _ in partial.sources:
            self.progress.setdefault((via, source), (-math.inf, now))
        if partial.end <= self.released_until.get(via, -math.inf):
            where = self.released_sources.get((via, partial.start), {})
            if partial.sources and all(
                part in where and where[part][0] <= first and last <= where[part][1]
                for part, first, last in partial.sources
            ):
                self.duplicate_partials += 1  # re-read: its records were judged with the window
            else:
                self.late_partials += 1
            return
        slot = (via, partial.start)
        pending = self.pending.get(slot)
        if pending is None:
            rows = max(self._rows_hint.get(via, 0), 8)  # as many segments as its last window had
            pending = self.pending[slot] = _Pending(now, WindowBlock(rows, partial.evidence_k))
            heapq.heappush(self._by_end.setdefault(via, []), (partial.end, partial.start))
            heapq.heappush(self._by_age, (now, slot))
        merged = pending.target(partial)
        if not any(_overlaps(merged.sources, src) for src in partial.sources):
            merged.merge(partial)
        elif all(_covered(merged.sources, src) for src in partial.sources):
            self.duplicate_partials += 1  # every offset merged already: a replay after a crash
        else:
            self.overlapping_partials += 1

    def restart_silence(self, now: float) -> None:
        """Every wait starts over at ``now``: each source's silence and each pending window's
        age. For a silence that says nothing about the sources (the broker did not answer):
        measured through it, the sources would count as idle and their windows be released
        without the partials the broker held back, which would then be late."""
        self.progress = {slot: (watermark, now) for slot, (watermark, _) in self.progress.items()}
        self._by_age = [(now, slot) for _, slot in self._by_age if slot in self.pending]
        heapq.heapify(self._by_age)
        for pending in self.pending.values():
            pending.first_seen = now

    def _slowest(self, via: int, now: float) -> float:
        # Sources silent for max_wait_s no longer hold windows back (they went idle).
        active = [w for (k, _), (w, heard) in self.progress.items() if k == via and now - heard < self.max_wait_s]
        return min(active, default=math.inf)

    def due(self, now: float) -> list[WindowStats]:
        ready: set[tuple[int, float]] = set()
        for via, heap in self._by_end.items():
            slowest = self._slowest(via, now)
            while heap and ((via, heap[0][1]) not in self.pending or heap[0][0] <= slowest):
                end, start = heapq.heappop(heap)
                pending = self.pending.get((via, start))
                if pending is None:
                    continue  # already released (lazy deletion)
                if now - pending.first_seen < self.grace_s:
                    heapq.heappush(heap, (end, start))
                    break
                ready.add((via, start))
        while self._by_age and now - self._by_age[0][0] >= self.max_wait_s:
            _, slot = heapq.heappop(self._by_age)
            if slot in self.pending:
                ready.add(slot)
        return self._release(ready)

    def complete_until(self, now: float) -> float:
        """Event time up to which every partials partition heard from has released each window
        it will get partials of: a window's segments travel through several partitions, so a
        figure over all of them (a model's requests in the window) is whole only then."""
        bound = min((self._slowest(via, now) for via in {via for via, _ in self.progress}), default=math.inf)
        return min([bound, *(start for _, start in self.pending)])

    def flush_all(self) -> list[WindowStats]:
        return self._release(set(self.pending))

    def _release(self, slots: set[tuple[int, float]]) -> list[WindowStats]:
        # Oldest first, so models see each segment's windows in order.
        released = []
        for via, start in sorted(slots, key=lambda slot: (slot[1], slot[0])):
            windows = self.pending.pop((via, start)).by_segment
            self._rows_hint[via] = len(windows)
            where: dict[int, tuple[int, int]] = {}
            for key in sorted(windows):
                released.append(windows[key])
                for part, first, last in windows[key].sources:
                    low, high = where.get(part, (first, last))
                    where[part] = (min(low, first), max(high, last))
            self.released_sources[(via, start)] = where
            end = start + windows[key].length
            self.released_until[via] = max(self.released_until.get(via, -math.inf), end)
            horizon = end - RELEASED_MEMORY_WINDOWS * windows[key].length
            for slot in [s for s in self.released_sources if s[0] == via and s[1] < horizon]:
                del self.released_sources[slot]
        if len(self._by_age) > 4 * len(self.pending) + 64:  # drop stale heap entries now and then
            self._by_age = [item for item in self._by_age if item[1] in self.pending]
            heapq.heapify(self._by_age)
        return released


def _row_offsets(parts: Sequence[tuple[int, RowBatch, int, int | np.ndarray | None]]) -> np.ndarray:
    """The message offset of every row of ``parts``, in order (0 where none is known)."""
    return np.concatenate(
        [np.broadcast_to(np.asarray(0 if offset is None else offset, dtype=np.int64), len(batch))
         for _, batch, _, offset in parts]
    )  # fmt: skip


def _offsets_in(offsets: np.ndarray, window_ids: np.ndarray, window_id: int, windows: int) -> tuple[int, int]:
    """First and last offset of the rows in ``window_id`` (all rows when they touch one window)."""
    mine = offsets if windows == 1 else offsets[window_ids == window_id]
    return int(mine.min()), int(mine.max())
