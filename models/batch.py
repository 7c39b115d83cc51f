"""Columnar aggregation: one batch of validated rows -> one ``WindowStats`` per (segment, window).

This is the worker's hot path. Python touches each row only to pull a handful of fields
into numpy arrays; everything else (banding, grouping, sums, histograms, picking the worst
requests as evidence) is a few vectorised numpy calls per batch, so the cost per record is
a small fraction of what parsing it took.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

from models.segments import Segmenter
from models.sketch import N_BUCKETS, bucket_indices
from models.window import EVIDENCE_FIELDS, WindowStats
from schemas.request_log import FinishReason, RequestLogRow

_REASONS = tuple(reason.value for reason in FinishReason)
_ERROR_REASONS = {FinishReason.ERROR.value, FinishReason.ABORT.value}


def normalise_reason(raw: str) -> str:
    """Engines disagree on case and vocabulary; unknown reasons are kept as ``other``."""
    lowered = raw.strip().lower()
    return lowered if lowered in _REASONS else FinishReason.OTHER.value


class RowBatch:
    """Validated rows plus the numeric columns the hot path reads, each extracted once.

    Columns are float64 (a missing optional value is NaN; token counts are exact in float64
    far beyond any plausible sum), built with one list comprehension each.
    """

    __slots__ = ("_columns", "rows")

    def __init__(self, rows: Sequence[RequestLogRow]) -> None:
        self.rows = rows
        self._columns: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def column(self, name: str) -> np.ndarray:
        values = self._columns.get(name)
        if values is None:
            values = self._columns[name] = np.array([row.get(name) for row in self.rows], dtype=np.float64)
        return values

    def inconsistent(self) -> np.ndarray:
        """Rows breaking the cross-field rules of ``RequestLog`` (NaN compares False: missing is fine)."""
        return (self.column("cached_tokens") > self.column("prompt_tokens")) | (
            self.column("ttft_s") > self.column("e2e_s") + 1e-3
        )

    def without(self, drop: np.ndarray) -> RowBatch:
        keep = np.flatnonzero(~drop)
        kept = RowBatch([self.rows[i] for i in keep.tolist()])
        kept._columns = {name: values[keep] for name, values in self._columns.items()}
        return kept


def evidence_from_row(row: RequestLogRow | dict[str, Any] | tuple[Any, ...]) -> dict[str, Any]:
    """What a person needs to find the request in their own log store; never prompt or answer text.

    Accepts a row, an evidence dict (idempotent) or a ``compact_evidence`` tuple.
    """
    source: Any = dict(zip(EVIDENCE_FIELDS, row, strict=True)) if isinstance(row, tuple) else row
    record = {name: source[name] for name in EVIDENCE_FIELDS if source.get(name) is not None}
    record["finish_reason"] = normalise_reason(source["finish_reason"])
    return record


def compact_evidence(row: RequestLogRow) -> tuple[Any, ...]:
    """The evidence fields' values only: what an open window keeps (a fraction of the row's memory)."""
    get = row.get
    return tuple(get(name) for name in EVIDENCE_FIELDS)


def fold_rows(
    batch: RowBatch | Sequence[RequestLogRow],
    segmenter: Segmenter,
    window_s: float,
    into: dict[tuple[float, str], WindowStats],
    evidence_k: int = 5,
) -> list[WindowStats]:
    """Fold one batch into the open windows ``into`` (keyed by (start, segment key)).

    Returns the windows the batch touched.
    """
    if not isinstance(batch, RowBatch):
        batch = RowBatch(batch)
    rows, n = batch.rows, len(batch)
    if n == 0:
        return []
    timestamps = batch.column("timestamp")
    prompt = batch.column("prompt_tokens")
    completion = batch.column("completion_tokens")
    e2e = batch.column("e2e_s")
    ttft = batch.column("ttft_s")
    cached = batch.column("cached_tokens")
    status = batch.column("status_code")
    reason_raw = [row["finish_reason"] for row in rows]

    segment_ids, keys = segmenter.ids_for_rows(rows, prompt, completion)
    window_ids = np.floor(timestamps / window_s).astype(np.int64)
    # One group per (window, segment) present in the batch, via one int64 code per row.
    first_window = int(window_ids.min())
    codes_ws = (window_ids - first_window) * len(keys) + segment_ids
    unique_codes, group = np.unique(codes_ws, return_inverse=True)
    group = group.reshape(-1)
    n_groups = len(unique_codes)
    group_windows = unique_codes // len(keys) + first_window
    group_segments = unique_codes % len(keys)

    def total(weights: np.ndarray) -> np.ndarray:
        return np.bincount(group, weights=weights, minlength=n_groups)

    reported = ~np.isnan(cached)
    cached_known = np.where(reported, cached, 0.0)
    counts = np.bincount(group, minlength=n_groups)
    sums = {
        "prompt_tokens": total(prompt),
        "completion_tokens": total(completion),
        "cached_tokens": total(cached_known),
        "uncached_prompt_tokens": total(prompt - cached_known),
        "cache_reported_prompt_tokens": total(np.where(reported, prompt, 0)),
        "e2e_sum": total(e2e),
    }
    has_ttft = ~np.isnan(ttft)
    sums["ttft_sum"] = total(np.where(has_ttft, ttft, 0.0))
    hist = np.bincount(
        group[has_ttft] * N_BUCKETS + bucket_indices(ttft[has_ttft]), minlength=n_groups * N_BUCKETS
    ).reshape(n_groups, N_BUCKETS)

    # Finish reasons: normalise each distinct raw value once, then count per group.
    distinct = {raw: normalise_reason(raw) for raw in set(reason_raw)}
    reason_codes = {value: code for code, value in enumerate(_REASONS)}
    codes = np.array([reason_codes[distinct[raw]] for raw in reason_raw], dtype=np.int64)
    reason_counts = np.bincount(group * len(_REASONS) + codes, minlength=n_groups * len(_REASONS)).reshape(
        n_groups, len(_REASONS)
    )
    error_codes = np.array([reason_codes[r] for r in _ERROR_REASONS])
    # Same rule as RequestLog.is_error: error/abort finish, or a 5xx status.
    errors = total((np.isin(codes, error_codes) | (status >= 500)).astype(np.float64))

    # Evidence: the slowest requests per group (highest TTFT first; request id breaks ties).
    picks: list[list[int]] = [[] for _ in range(n_groups)]
    if evidence_k > 0 and has_ttft.any():
        candidates = np.flatnonzero(has_ttft)
        order = candidates[np.lexsort((-ttft[candidates], group[candidates]))]
        ordered_groups = group[order]
        # Rank within its group = position minus where the group starts in the sorted order.
        starts = np.searchsorted(ordered_groups, ordered_groups, side="left")
        keep = np.arange(len(order)) - starts < evidence_k
        for index, g in zip(order[keep].tolist(), ordered_groups[keep].tolist(), strict=True):
            picks[g].append(index)

    # Fold each group into its window's accumulator (created on first sight). Everything is
    # converted to Python lists once, so the per-group loop touches no numpy scalars.
    prompt_s, completion_s = sums["prompt_tokens"].tolist(), sums["completion_tokens"].tolist()
    cached_s, uncached_s = sums["cached_tokens"].tolist(), sums["uncached_prompt_tokens"].tolist()
    reported_s = sums["cache_reported_prompt_tokens"].tolist()
    e2e_sums, ttft_sums = sums["e2e_sum"].tolist(), sums["ttft_sum"].tolist()
    counts_list, errors_list = counts.tolist(), errors.tolist()
    reasons_by_group: list[list[tuple[str, int]]] = [[] for _ in range(n_groups)]
    for g, code in zip(*(axis.tolist() for axis in np.nonzero(reason_counts)), strict=True):
        reasons_by_group[g].append((_REASONS[code], int(reason_counts[g, code])))
    touched: list[WindowStats] = []
    for g, (window_id, segment_id) in enumerate(zip(group_windows.tolist(), group_segments.tolist(), strict=True)):
        slot = (float(window_id * window_s), keys[segment_id])
        stats = into.get(slot)
        if stats is None:
            stats = into[slot] = WindowStats(key=slot[1], start=slot[0], length=window_s, evidence_k=evidence_k)
        stats.requests += counts_list[g]
        stats.prompt_tokens += int(prompt_s[g])
        stats.completion_tokens += int(completion_s[g])
        stats.cached_tokens += int(cached_s[g])
        stats.uncached_prompt_tokens += int(uncached_s[g])
        stats.cache_reported_prompt_tokens += int(reported_s[g])
        stats.e2e_sum += e2e_sums[g]
        stats.ttft_sum += ttft_sums[g]
        stats.errors += int(errors_list[g])
        stats.ttft.counts += hist[g]
        for reason, count in reasons_by_group[g]:
            stats.finish_reasons[reason] = stats.finish_reasons.get(reason, 0) + count
        if picks[g]:
            _offer_evidence(stats, picks[g], ttft, rows)
        touched.append(stats)
    return touched


def _offer_evidence(stats: WindowStats, picks: list[int], ttft: np.ndarray, rows: Sequence[RequestLogRow]) -> None:
    """Candidates arrive slowest first; keep those that make the cut, as compact tuples
    (turned into evidence records only when the window is sent)."""
    heap = stats.evidence
    for index in picks:
        row = rows[index]
        item = (float(ttft[index]), row["request_id"])
        if len(heap) >= stats.evidence_k and item <= heap[0][:2]:
            break
        kept = compact_evidence(row)
        if len(heap) < stats.evidence_k:
            heapq.heappush(heap, (*item, kept))
        else:
            heapq.heapreplace(heap, (*item, kept))


def aggregate_rows(
    rows: Sequence[RequestLogRow], segmenter: Segmenter, window_s: float, evidence_k: int = 5
) -> list[WindowStats]:
    """Partials of one batch on their own, ordered by (window start, segment key)."""
    windows: dict[tuple[float, str], WindowStats] = {}
    fold_rows(RowBatch(rows), segmenter, window_s, windows, evidence_k)
    return [windows[slot] for slot in sorted(windows)]
