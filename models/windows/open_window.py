"""Stage 1's open windows as numpy tables: a batch is folded in with a few calls, not a loop.

An ``OpenWindow`` holds one window of a worker's input partitions: a row per segment seen in it,
with that segment's counters, TTFT histogram and finish-reason counts as rows of 2-D
arrays. ``fold_batch`` maps a batch's records to (window, row) and adds them with one weighted
``np.bincount`` per column, so its cost grows with the records, not with the segments they
touch nor the windows they span: with 500 records spread over 100 segments per message, a
Python loop per (segment, window) cost more than parsing the message, and a replayed file's
batch spans dozens of windows. Python runs per segment only when a window closes
(``partials``).

Evidence is kept by reference: the slowest ``evidence_k`` requests of each row as their
TTFT and where they are (partition, message offset, position in the message), 32 bytes
each, in two more tables. The records themselves stay in Kafka (or the replayed file) and are read
back only for a window that fires (``pipeline.worker.evidence``), so a live segment costs no
request text, however long its answers.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from servewatch.models.stats.capacity import ARRIVAL_LAGS
from servewatch.models.stats.sketch import N_BUCKETS, bucket_indices
from servewatch.models.windows.batch import RowBatch
from servewatch.models.windows.segment_keys import LABEL_DIMENSIONS, model_of
from servewatch.models.windows.segments import Segmenter
from servewatch.models.windows.signal_columns import (
    DEFAULT_REASONING_MARKERS,
    PrefixMemory,
    recent_columns,
    signal_columns,
)
from servewatch.models.windows.window import COLUMN_OF, REASONS, SUMS, WindowBlock, WindowStats, pack_location

_ERROR_CODES = np.array([REASONS.index("error"), REASONS.index("abort")])
#: A segment's figures that add up to its model's (``_set_model_load``), and where they go.
_OWN = (
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "running_s",
    *(f"arrived{what}_{lag}" for what in ("", "_tokens") for lag in range(ARRIVAL_LAGS)),
)
_OWN_COLUMNS = [COLUMN_OF[name] for name in _OWN]
_ARRIVED = slice(COLUMN_OF["arrived_0"], COLUMN_OF["arrived_0"] + ARRIVAL_LAGS)
_ARRIVED_TOKENS = slice(COLUMN_OF["arrived_tokens_0"], COLUMN_OF["arrived_tokens_0"] + ARRIVAL_LAGS)
_MODEL_COLUMNS = [COLUMN_OF["model_" + name.replace("completion_tokens", "output_tokens")] for name in _OWN]


class OpenWindow:
    """One window (of all the partitions a worker reads), a table row per segment seen in it.

    >>> seg = Segmenter()
    >>> rows = [dict(request_id=str(i), timestamp=1_700_000_001.0 + i, model="m", prompt_tokens=100,
    ...              completion_tokens=10, e2e_s=1.0, ttft_s=0.1 * (i + 1), finish_reason="stop")
    ...         for i in range(3)]
    >>> windows: dict[float, OpenWindow] = {}
    >>> [w.start for w in fold_batch(RowBatch(rows), seg, 10.0, windows)]  # the windows it touched
    [1700000000.0]
    >>> [(p.key, p.requests, p.prompt_tokens, len(p.evidence)) for p in windows[1_700_000_000.0].partials(seg.keys)]
    [('model=m|route=-|prompt_band=<4k|output_band=<1k', 3, 300, 3)]
    """

    __slots__ = ("_row_of", "block", "length", "offsets", "segment_ids", "start")

    def __init__(self, start: float, length: float, evidence_k: int = 5, capacity: int = 8) -> None:
        self.start, self.length = start, length
        self._row_of = np.full(0, -1, dtype=np.int32)  # segment id -> row (-1: not in this window)
        self.segment_ids = array("l")  # row -> segment id (4-8 bytes each, not a Python int)
        self.block = WindowBlock(capacity, evidence_k)
        self.offsets: dict[int, tuple[int, int]] = {}  # partition -> (first, last) offset folded in

    def __len__(self) -> int:
        return len(self.segment_ids)

    @property
    def end(self) -> float:
        return self.start + self.length

    @property
    def evidence_k(self) -> int:
        return self.block.evidence_k

    def rows_for(self, segment_ids: np.ndarray) -> np.ndarray:
        """The table row of each segment id, adding rows for segments new to this window."""
        top = int(segment_ids.max()) + 1
        if top > len(self._row_of):
            grown = np.full(max(top, 2 * len(self._row_of)), -1, dtype=np.int32)
            grown[: len(self._row_of)] = self._row_of
            self._row_of = grown
        rows = self._row_of[segment_ids]
        missing = rows < 0
        if missing.any():
            new_ids = np.unique(segment_ids[missing])
            first = len(self.segment_ids)
            self._row_of[new_ids] = np.arange(first, first + len(new_ids), dtype=np.int32)
            self.segment_ids.extend(new_ids.tolist())
            self.block.make_room(len(self.segment_ids))
            rows = self._row_of[segment_ids]
        return rows

    def note_offset(self, partition: int, offset: int, last_offset: int | None = None) -> None:
        """Messages ``offset`` to ``last_offset`` (default: just ``offset``) of ``partition`` fed this window."""
        last_offset = offset if last_offset is None else last_offset
        first, last = self.offsets.get(partition, (offset, last_offset))
        self.offsets[partition] = (min(first, offset), max(last, last_offset))

    def partials(self, keys: Sequence[str]) -> list[WindowStats]:
        """One ``WindowStats`` per segment of the window (``keys``: the segmenter's, by id):
        handles on this window's rows, no copies (the tables live until the last is judged)."""
        sources = [(p, first, last) for p, (first, last) in sorted(self.offsets.items())]
        self._set_model_load(keys)
        # ``sources`` is shared: a WindowStats replaces its sources, never mutates them.
        return [
            WindowStats(keys[segment_id], self.start, self.length, block=self.block, row=row, sources=sources)
            for row, segment_id in enumerate(self.segment_ids)
        ]

    def _set_model_load(self, keys: Sequence[str]) -> None:
        """Give every row its model's totals in this window (requests, prompt and output
        tokens): latency is judged against the load of the engines a segment shares, which
        only stage 1, seeing all segments of a window at once, can sum."""
        n = len(self.segment_ids)
        models = [model_of(keys[segment_id]) for segment_id in self.segment_ids]
        code_of = {name: code for code, name in enumerate(dict.fromkeys(models))}
        codes = np.fromiter(map(code_of.__getitem__, models), dtype=np.intp, count=n)
        sums = self.block.sums
        own = sums[:n][:, _OWN_COLUMNS]
        totals = np.zeros((len(code_of), len(_OWN_COLUMNS)))
        np.add.at(totals, codes, own)
        sums[:n][:, _MODEL_COLUMNS] = totals[codes]


def fold_batch(
    batch: RowBatch,
    segmenter: Segmenter,
    window_s: float,
    into: dict[float, OpenWindow],
    evidence_k: int = 5,
    partition: int | np.ndarray = 0,
    offset: int | np.ndarray = 0,
    markers: Sequence[str] = DEFAULT_REASONING_MARKERS,
    prefixes: PrefixMemory | None = None,
    rows_hint: int = 8,
    also: Sequence[tuple[Segmenter, dict[float, OpenWindow]]] = (),
) -> list[OpenWindow]:
    """Fold a batch (the records of message ``offset`` of ``partition``, or of several
    messages: then both are arrays, a value per record) into the open windows ``into``
    (keyed by start), creating them as needed. Returns the windows it touched.

    ``markers``: reasoning end markers that count as leaked when an answer contains one;
    ``prefixes``: the worker's memory of prompt prefixes (None: shared prefixes not counted);
    ``rows_hint``: segments a new window is expected to hold (its table is made that big);
    ``also``: other (segmenter, open windows) to fold the same records into, keyed their
    way (the replica rows), from the same per-record figures; one that keys by instance takes
    only the records that name theirs.
    """
    n = len(batch)
    if n == 0:
        return []
    prompt, completion = batch.column("prompt_tokens"), batch.column("completion_tokens")
    cached, ttft = batch.column("cached_tokens"), batch.column("ttft_s")
    wanted = {dim for seg in (segmenter, *(seg for seg, _ in also)) for dim in seg.dimensions}
    all_labels = {dim: batch.values(dim) for dim in LABEL_DIMENSIONS if dim in wanted}

    def ids_of(seg: Segmenter, named: np.ndarray | None = None) -> np.ndarray:
        """Each record's segment id in ``seg`` (-1 for a record not ``named``: never registered)."""
        labels = {d: v for d, v in all_labels.items() if d in seg.dimensions}
        if named is None:
            return seg.ids_for_columns(labels, prompt, completion)
        ids = np.full(n, -1, dtype=np.int64)
        if named.any():
            kept = np.flatnonzero(named)
            rows = kept.tolist()
            subset = {d: [values[i] for i in rows] for d, values in labels.items()}
            ids[kept] = seg.ids_for_columns(subset, prompt[kept], completion[kept])
        return ids

    # A record goes into an ``also`` table keyed by instance only if it names its instance: the
    # replica rows compare instances, and a row of requests of no instance would cost a table
    # row per segment (most of a live segment's windows in flight) to compare nothing.
    targets: list[tuple[np.ndarray, dict[float, OpenWindow], np.ndarray | None, bool]] = [
        (ids_of(segmenter), into, None, "instance" in segmenter.dimensions)
    ]
    for seg, windows in also:
        named = _named(seg, all_labels)
        targets.append((ids_of(seg, named), windows, named, "instance" in seg.dimensions))

    reason_codes = batch.reason_codes()
    # Same rule as RequestLog.is_error: error/abort finish, or a 5xx status.
    errors = np.isin(reason_codes, _ERROR_CODES) | (batch.column("status_code") >= 500)
    reported = ~np.isnan(cached)
    cached_known = np.where(reported, cached, 0.0)
    has_ttft = ~np.isnan(ttft)
    uncached = prompt - cached_known
    # The columns of SUMS per record ("requests" is a count; columns left out are zeros).
    columns = {
        "prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached_known,
        "uncached_prompt_tokens": uncached, "cache_reported_prompt_tokens": np.where(reported, prompt, 0.0),
        "errors": errors, "e2e_sum": batch.column("e2e_s"), "ttft_sum": np.where(has_ttft, ttft, 0.0),
        **signal_columns(batch, completion, uncached, markers, prefixes, reported & (cached_known == 0)),
    }  # fmt: skip
    buckets = bucket_indices(ttft)
    # Where each record came from, for evidence: (partition, message offset, position in it).
    partitions = np.broadcast_to(np.asarray(partition, dtype=np.int64), n)
    offsets = np.broadcast_to(np.asarray(offset, dtype=np.int64), n)

    timestamps, e2e = batch.column("timestamp"), batch.column("e2e_s")
    window_ids = np.floor(timestamps / window_s).astype(np.int64)
    lags = window_ids - np.floor((timestamps - e2e) / window_s)  # windows back the request started
    queue = batch.column("queue_s")
    columns["running_s"] = e2e - np.where(np.isnan(queue), 0.0, queue)
    # Read only by the replica comparison: folded only into the tables keyed by instance.
    by_instance = any(keyed for *_, keyed in targets)
    recent = recent_columns(columns, timestamps - window_ids * window_s, e2e) if by_instance else {}
    low, high = int(window_ids.min()), int(window_ids.max())
    # Each window's records, in their order. A live worker's batch spans a window or two; a
    # replayed file's spans dozens, and folding them one window at a time cost a few dozen
    # numpy calls per window for a few dozen records each.
    if low == high:
        spans: list[tuple[float, Any]] = [(float(low * window_s), slice(None))]
    else:
        by_window = np.argsort(window_ids, kind="stable")
        ids, firsts = np.unique(window_ids[by_window], return_index=True)
        picks = np.split(by_window, firsts[1:])
        spans = [(float(w * window_s), picked) for w, picked in zip(ids.tolist(), picks, strict=True)]
    per_record = _PerRecord(columns, recent, buckets, reason_codes, ttft, has_ttft, lags, partitions, offsets)
    touched = []
    for k, (segment_ids, windows, named, keyed) in enumerate(targets):
        parts = []
        for start, picked in spans:
            mine = picked
            if named is not None:
                mine = np.flatnonzero(named) if isinstance(picked, slice) else picked[named[picked]]
                if not len(mine):
                    continue
            window = windows.get(start)
            if window is None:
                window = windows[start] = OpenWindow(start, window_s, evidence_k, capacity=rows_hint)
            parts.append((window, mine, window.rows_for(segment_ids[mine])))  # each record's table row
            if k == 0:
                touched.append(window)
        if parts:
            _fold_into(parts, batch, per_record, keyed)
    return touched


def _named(seg: Segmenter, labels: dict[str, list[Any]]) -> np.ndarray | None:
    """Which records name their instance, where ``seg`` keys by instance; None where all do
    (or ``seg`` does not key by instance). A batch holds a few distinct instances: each is
    looked at once, not once per record."""
    if "instance" not in seg.dimensions:
        return None
    values = labels["instance"]
    unnamed = {value for value in set(values) if not (value and value.strip())}
    if not unnamed:
        return None
    return ~np.fromiter(map(unnamed.__contains__, values), dtype=bool, count=len(values))


class _PerRecord(NamedTuple):
    """A batch's figures per record, as ``fold_batch`` computed them for every table it feeds."""

    columns: dict[str, np.ndarray]  # the columns of SUMS
    recent: dict[str, np.ndarray]  # the recent-weighted columns of SUMS (``recent_columns``)
    buckets: np.ndarray  # TTFT histogram bucket
    reason_codes: np.ndarray
    ttft: np.ndarray
    has_ttft: np.ndarray
    lags: np.ndarray  # windows back the request started
    partitions: np.ndarray
    offsets: np.ndarray


def _fold_into(
    parts: list[tuple[OpenWindow, Any, np.ndarray]], batch: RowBatch, per_record: _PerRecord, by_instance: bool
) -> None:
    """Add records to their windows' rows: ``parts`` holds, per window, the records picked for
    it and each one's row there. Every figure is counted for all windows at once, one
    ``np.bincount`` per column over (window, row) slots; only the adding into each window's
    table (and its evidence) is done window by window. ``by_instance``: the tables are keyed
    by instance (replica rows), and take the recent-weighted columns too."""
    # Each record's slot among the rows this fold touches, numbered window after window,
    # without a sort: a sort of the records, or np.add.at into a table of 55 columns, cost
    # more than all the adding.
    touched_rows, slots = [], []
    first = 0
    for window, _, rows in parts:
        present = np.zeros(len(window), dtype=bool)
        present[rows] = True
        touched = np.flatnonzero(present)
        slots.append((np.cumsum(present) - 1)[rows] + first)
        touched_rows.append(touched)
        first += len(touched)
    n_slots = first
    if len(parts) == 1:
        slot, picked = slots[0], parts[0][1]
    else:
        slot, picked = np.concatenate(slots), np.concatenate([mine for _, mine, _ in parts])
    # Sums per slot: one weighted bincount per column (a pass over the records each).
    added = np.zeros((len(SUMS), n_slots))
    added[COLUMN_OF["requests"]] = np.bincount(slot, minlength=n_slots)
    for name, values in (per_record.columns | per_record.recent if by_instance else per_record.columns).items():
        added[COLUMN_OF[name]] = np.bincount(slot, weights=values[picked], minlength=n_slots)
    _count_arrivals(added, slot, per_record.lags[picked], per_record.columns["prompt_tokens"][picked], n_slots)
    # Counts per (slot, code) by one bincount: np.add.at cost ~0.1 µs per record and cell,
    # the fold's largest cost after the sums.
    reasons = _counts(slot, per_record.reason_codes[picked], n_slots, len(REASONS))
    timed = per_record.has_ttft[picked]
    hist = _counts(slot[timed], per_record.buckets[picked][timed], n_slots, N_BUCKETS)
    first = 0
    for (window, _, _), touched in zip(parts, touched_rows, strict=True):
        span = slice(first, first + len(touched))
        first = span.stop
        block = window.block
        block.sums[touched] += added[:, span].T
        block.fit(int(block.sums[touched, 0].max()))
        block.reasons[touched] += reasons[span].astype(block.reasons.dtype, copy=False)
        block.hist[touched] += hist[span].astype(block.hist.dtype, copy=False)
    if parts[0][0].evidence_k > 0:  # every window of a fold keeps as many (``fold_batch``'s evidence_k)
        _offer_slowest([window.block for window, _, _ in parts], touched_rows, slot, picked, batch, per_record)


def _offer_slowest(
    blocks: list[WindowBlock], touched_rows: list[np.ndarray], slot: np.ndarray, picked: Any, batch: RowBatch,
    per_record: _PerRecord,
) -> None:  # fmt: skip
    """Keep, per slot (a row of one of ``blocks``, numbered as ``_fold_into`` does), the
    slowest ``evidence_k`` of its requests kept so far and of the ``picked`` records.

    Most records are turned away by one vectorised compare with their row's slowest-but-k-th
    kept one (-inf while fewer are kept); the rest are ranked and merged for all windows at
    once. On equal TTFT the request kept first stays (so the result does not depend on how
    batches were cut)."""
    k = blocks[0].evidence_k
    bounds = np.cumsum([0] + [len(touched) for touched in touched_rows])
    kth = np.concatenate([block.evidence_ttft[rows, k - 1] for block, rows in zip(blocks, touched_rows, strict=True)])
    times = per_record.ttft[picked]
    candidate = per_record.has_ttft[picked] & (times > kth[slot])
    if not candidate.any():
        return
    records = np.arange(len(batch))[picked][candidate]
    slots, times = slot[candidate], times[candidate]
    order = np.lexsort((-times, slots))  # by slot, slowest first
    ordered = slots[order]
    ranks = np.arange(len(order)) - np.searchsorted(ordered, ordered, side="left")
    best = ranks < k
    keep = order[best]
    kept = records[keep]
    offered, slot_of = np.unique(slots[keep], return_inverse=True)
    new_ttft = np.full((len(offered), k), -math.inf, dtype=np.float32)
    new_at = np.zeros((len(offered), k, 2), dtype=np.int64)
    new_ttft[slot_of, ranks[best]] = times[keep]
    new_at[slot_of, ranks[best]] = np.column_stack(
        pack_location(per_record.partitions[kept], per_record.offsets[kept], batch.positions[kept])
    )
    # Each offered slot's window and row: the merge reads and writes them window by window.
    split = np.searchsorted(offered, bounds)
    places = [
        (block, touched[offered[a:b] - first], slice(a, b))
        for block, touched, first, a, b in zip(blocks, touched_rows, bounds[:-1], split[:-1], split[1:], strict=True)
        if b > a
    ]
    old_ttft = np.concatenate([block.evidence_ttft[rows] for block, rows, _ in places])
    old_at = np.concatenate([block.evidence_at[rows] for block, rows, _ in places])
    both_ttft = np.concatenate((old_ttft, new_ttft), axis=1)
    both_at = np.concatenate((old_at, new_at), axis=1)
    slowest = np.argsort(-both_ttft, axis=1, kind="stable")[:, :k]
    merged_ttft = np.take_along_axis(both_ttft, slowest, axis=1)
    merged_at = np.take_along_axis(both_at, slowest[:, :, None], axis=1)
    for block, rows, span in places:
        block.evidence_ttft[rows] = merged_ttft[span]
        block.evidence_at[rows] = merged_at[span]


def _count_arrivals(added: np.ndarray, slot: np.ndarray, lag: np.ndarray, prompt: np.ndarray, n_slots: int) -> None:
    """Add each record (and its prompt tokens) to its slot's ``arrived_<lag>`` column, the
    window it started in counted back from this one; starts older than ``ARRIVAL_LAGS``
    windows (or unknown) go in none. Two bincounts over (slot, lag) cells, not one per lag."""
    known = (lag >= 0) & (lag < ARRIVAL_LAGS)  # NaN compares false: in no column
    if not known.any():
        return
    cells = slot[known] * ARRIVAL_LAGS + lag[known].astype(np.intp)
    size = n_slots * ARRIVAL_LAGS
    added[_ARRIVED] += np.bincount(cells, minlength=size).reshape(-1, ARRIVAL_LAGS).T
    added[_ARRIVED_TOKENS] += np.bincount(cells, weights=prompt[known], minlength=size).reshape(-1, ARRIVAL_LAGS).T


def _counts(slots: np.ndarray, codes: np.ndarray, n_slots: int, n_codes: int) -> np.ndarray:
    """An (n_slots, n_codes) table: records per slot and code."""
    return np.bincount(slots * n_codes + codes, minlength=n_slots * n_codes).reshape(n_slots, n_codes)


def aggregate_rows(
    rows: Sequence[Any],
    segmenter: Segmenter,
    window_s: float,
    evidence_k: int = 5,
    markers: Sequence[str] = DEFAULT_REASONING_MARKERS,
    prefixes: PrefixMemory | None = None,
) -> list[WindowStats]:
    """Partials of one batch on their own, ordered by (window start, segment key)."""
    windows: dict[float, OpenWindow] = {}
    prefixes = PrefixMemory() if prefixes is None else prefixes
    # evidence: offset 0, by position
    fold_batch(RowBatch(rows), segmenter, window_s, windows, evidence_k, markers=markers, prefixes=prefixes)
    partials = [p for start in sorted(windows) for p in windows[start].partials(segmenter.keys)]
    return sorted(partials, key=lambda p: (p.start, p.key))
