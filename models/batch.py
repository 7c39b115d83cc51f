"""Columnar aggregation: one batch of validated rows -> one ``WindowStats`` per (segment, window).

This is the worker's hot path. Python touches each row only to pull a handful of fields
into numpy arrays; everything else (banding, grouping, sums, histograms, picking the worst
requests as evidence) is a few vectorised numpy calls per batch, so the cost per record is
a small fraction of what parsing it took.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from models.segments import Segmenter
from models.sketch import N_BUCKETS, LogHistogram, bucket_indices
from models.window import EVIDENCE_FIELDS, WindowStats
from schemas.request_log import FinishReason, RequestLogRow

_NAN = math.nan
_REASONS = tuple(reason.value for reason in FinishReason)
_ERROR_REASONS = {FinishReason.ERROR.value, FinishReason.ABORT.value}


def normalise_reason(raw: str) -> str:
    """Engines disagree on case and vocabulary; unknown reasons are kept as ``other``."""
    lowered = raw.strip().lower()
    return lowered if lowered in _REASONS else FinishReason.OTHER.value


def _column(rows: Sequence[RequestLogRow], name: str, dtype: type, missing: float) -> np.ndarray:
    return np.fromiter((missing if (v := row.get(name)) is None else v for row in rows), dtype=dtype, count=len(rows))


def evidence_from_row(row: RequestLogRow) -> dict[str, Any]:
    """What a person needs to find the request in their own log store; never prompt or answer text."""
    record = {name: row[name] for name in EVIDENCE_FIELDS if row.get(name) is not None}  # type: ignore[literal-required]
    record["finish_reason"] = normalise_reason(row["finish_reason"])
    return record


def aggregate_rows(
    rows: Sequence[RequestLogRow], segmenter: Segmenter, window_s: float, evidence_k: int = 5
) -> list[WindowStats]:
    """Partials of one batch, ordered by (window start, segment key)."""
    n = len(rows)
    if n == 0:
        return []
    timestamps = np.fromiter((row["timestamp"] for row in rows), dtype=np.float64, count=n)
    prompt = np.fromiter((row["prompt_tokens"] for row in rows), dtype=np.int64, count=n)
    completion = np.fromiter((row["completion_tokens"] for row in rows), dtype=np.int64, count=n)
    e2e = np.fromiter((row["e2e_s"] for row in rows), dtype=np.float64, count=n)
    ttft = _column(rows, "ttft_s", np.float64, _NAN)
    cached = _column(rows, "cached_tokens", np.int64, -1)
    status = _column(rows, "status_code", np.int64, 0)
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

    reported = cached >= 0
    cached_known = np.where(reported, cached, 0)
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
    codes = np.fromiter((reason_codes[distinct[raw]] for raw in reason_raw), dtype=np.int64, count=n)
    reason_counts = np.bincount(group * len(_REASONS) + codes, minlength=n_groups * len(_REASONS)).reshape(
        n_groups, len(_REASONS)
    )
    error_codes = np.array([reason_codes[r] for r in _ERROR_REASONS])
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

    partials = []
    for g, (window_id, segment_id) in enumerate(zip(group_windows.tolist(), group_segments.tolist(), strict=True)):
        stats = WindowStats(
            key=keys[segment_id], start=float(window_id * window_s), length=window_s, evidence_k=evidence_k
        )
        stats.requests = int(counts[g])
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens", "uncached_prompt_tokens",
                     "cache_reported_prompt_tokens"):  # fmt: skip
            setattr(stats, name, int(sums[name][g]))
        stats.e2e_sum = float(sums["e2e_sum"][g])
        stats.ttft_sum = float(sums["ttft_sum"][g])
        stats.errors = int(errors[g])
        stats.ttft = LogHistogram(hist[g].astype(np.int64))
        stats.finish_reasons = {_REASONS[c]: int(k) for c, k in enumerate(reason_counts[g]) if k}
        stats.evidence = [(float(ttft[i]), rows[i]["request_id"], evidence_from_row(rows[i])) for i in picks[g]]
        stats.trim_evidence()
        partials.append(stats)
    return partials
