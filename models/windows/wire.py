"""The partials wire format: closed windows as columns, one group per window.

Stage 1 sends a window's partials to stage 2 in bundles. One JSON object per partial
(``WindowStats.to_dict``) cost ~2-3 KB of short-lived dicts per segment on each side when
a thousand segments closed at once, and that high-water mark stayed in the worker's RSS.
Here a bundle carries, per window, the segments' keys and their figures as columns:
sums, histograms and reason counts as (row, bucket, count) triples of the non-zero cells,
evidence as (row, TTFT, offset, partition-and-index) of the kept requests. Columns travel
as base64 of little-endian numpy arrays, so neither side builds a Python object per
number. Decoding builds one ``WindowBlock`` per group and a handle per segment.

>>> from servewatch.models.windows.window import WindowStats
>>> a = WindowStats("model=m", 0.0, 10.0, requests=2, prompt_tokens=30, sources=[(0, 5, 9)])
>>> a.block.hist[0, 40] = 2
>>> [b] = windows_from_wire(windows_to_wire([a]))
>>> (b.key, b.requests, b.prompt_tokens, b.ttft_count, b.sources)
('model=m', 2, 30, 2, [(0, 5, 9)])
"""

from __future__ import annotations

import base64
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from servewatch.models.stats.sketch import N_BUCKETS
from servewatch.models.windows.window import REASONS, RECENT_COLUMNS, SUMS, WindowBlock, WindowStats

#: Columns of ``SUMS`` a window had before the recent-weighted ones (its last columns) were
#: added: partials of that width are still read.
PREVIOUS_WIDTH = len(SUMS) - sum(len(columns) for columns in RECENT_COLUMNS.values())


def windows_to_wire(partials: Sequence[WindowStats]) -> list[dict[str, Any]]:
    """Partials grouped by window (and by the block they are rows of) as JSON-ready columns."""
    groups: dict[tuple[Any, ...], list[WindowStats]] = {}
    for partial in partials:
        identity = (id(partial.block), partial.start, partial.length, tuple(partial.sources), partial.watermark)
        groups.setdefault(identity, []).append(partial)
    return [_group_to_wire(members) for members in groups.values()]


def _pack(values: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype=dtype).tobytes()).decode("ascii")


def _unpack(text: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text, validate=True), dtype=dtype)


def _triples(table: np.ndarray) -> list[str]:
    rows, columns = np.nonzero(table)
    return [_pack(rows, "<i4"), _pack(columns, "<i4"), _pack(table[rows, columns], "<i8")]


def _group_to_wire(members: list[WindowStats]) -> dict[str, Any]:
    first, block = members[0], members[0].block
    rows = np.fromiter((m.row for m in members), dtype=np.intp, count=len(members))
    ttft = block.evidence_ttft[rows]
    kept_rows, kept_slots = np.nonzero(ttft > -np.inf)
    at = block.evidence_at[rows][kept_rows, kept_slots]
    return {
        "start": first.start,
        "length": first.length,
        "sources": [list(source) for source in first.sources],
        "watermark": first.watermark if math.isfinite(first.watermark) else None,
        "evidence_k": block.evidence_k,
        "keys": [m.key for m in members],
        "sums": _pack(block.sums[rows], "<f8"),
        "hist": _triples(block.hist[rows]),
        "reasons": _triples(block.reasons[rows]),
        # Kept slots are filled slowest first, so (row, order of appearance) keeps the ranking.
        "evidence": [
            _pack(kept_rows, "<i4"),
            _pack(ttft[kept_rows, kept_slots], "<f4"),
            _pack(at[:, 0], "<i8"),
            _pack(at[:, 1], "<i8"),
        ],
    }


def windows_from_wire(groups: Sequence[dict[str, Any]]) -> list[WindowStats]:
    """Handles on freshly built blocks; raises ``ValueError``/``KeyError``/``TypeError`` on bad input."""
    out: list[WindowStats] = []
    for group in groups:
        out.extend(_group_from_wire(group))
    return out


def _group_from_wire(group: dict[str, Any]) -> list[WindowStats]:
    keys = [sys.intern(str(key)) for key in group["keys"]]
    n = len(keys)
    block = WindowBlock(n, int(group["evidence_k"]))
    sums = _unpack(group["sums"], "<f8")
    if n and sums.size == n * PREVIOUS_WIDTH:
        # From a stage 1 not yet upgraded (a rolling upgrade): its windows' requests are
        # compared across replicas alike, with no weights for how recent they are.
        sums = np.hstack([sums.reshape(n, PREVIOUS_WIDTH), np.zeros((n, len(SUMS) - PREVIOUS_WIDTH))])
    sums = sums.reshape(n, len(SUMS))
    if n and (not np.isfinite(sums).all() or (sums < 0).any()):
        raise ValueError("partials with negative or non-finite sums")
    block.sums[:] = sums
    block.fit(int(sums[:, 0].max()) if n else 0)
    for table, width, name in ((block.hist, N_BUCKETS, "hist"), (block.reasons, len(REASONS), "reasons")):
        rows, columns, counts = (
            _unpack(part, dtype) for part, dtype in zip(group[name], ("<i4", "<i4", "<i8"), strict=True)
        )
        if not len(rows) == len(columns) == len(counts):
            raise ValueError(f"{name} columns of different lengths")
        if len(rows) and (rows.min() < 0 or rows.max() >= n or columns.min() < 0 or columns.max() >= width):
            raise ValueError(f"{name} cell out of range")
        if len(counts) and (counts.min() < 0 or counts.max() > np.iinfo(table.dtype).max):
            raise ValueError(f"{name} count out of range")
        table[rows, columns] = counts
    rows_e, ttft, offsets, packed = (
        _unpack(part, dtype) for part, dtype in zip(group["evidence"], ("<i4", "<f4", "<i8", "<i8"), strict=True)
    )
    if not len(rows_e) == len(ttft) == len(offsets) == len(packed):
        raise ValueError("evidence columns of different lengths")
    if len(rows_e) and (rows_e.min() < 0 or rows_e.max() >= n or (np.diff(rows_e) < 0).any()):
        raise ValueError("evidence rows out of range or out of order")
    # Position within its row: rows arrive grouped, each slowest first.
    slot = np.arange(len(rows_e)) - np.searchsorted(rows_e, rows_e, side="left")
    keep = slot < block.evidence_k
    rows_e, slot = rows_e[keep], slot[keep]
    block.evidence_ttft[rows_e, slot] = ttft[keep]
    block.evidence_at[rows_e, slot, 0], block.evidence_at[rows_e, slot, 1] = offsets[keep], packed[keep]
    sources = [(int(p), int(a), int(b)) for p, a, b in group["sources"]]
    watermark = -math.inf if group["watermark"] is None else float(group["watermark"])
    start, length = float(group["start"]), float(group["length"])
    return [
        WindowStats(key, start, length, block=block, row=row, sources=sources, watermark=watermark)
        for row, key in enumerate(keys)
    ]
