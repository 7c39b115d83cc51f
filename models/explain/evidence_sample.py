"""Which messages a firing event reads back, and which of their requests it shows.

A window keeps its slowest requests by location (``models.windows.open_window``), and, for the
rest of its sample, only where its records are: the offset range of each partition that
fed it (``WindowStats.sources``). When an event fires, a few messages spread over those
ranges are read back (``pipeline.worker.evidence``), and the segment's requests of the window in
them are the sample: a uniform pick of them goes into the evidence, all of them into the
facets (``models.explain.facets``). The same is done for the segment's latest normal window, whose
ranges stage 2 remembers for a while (``RecentSources``). Nothing is kept per request
between events, so the hot path pays nothing for a sample.

>>> spread([(0, 100, 199), (1, 7, 8)], budget=5)
[(0, 100), (1, 7), (0, 149), (1, 8), (0, 199)]
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

#: Messages read back per sampled window: each holds hundreds of requests from every segment.
SAMPLE_MESSAGES = 16

MessageKey = tuple[int, int]  # (partition, offset)
T = TypeVar("T")


@dataclass(frozen=True)
class EvidenceBudget:
    """What a firing event shows: ``worst`` requests of the anomalous window by its signal
    (the slowest, or the ones showing its fault) and ``uniform`` random ones of it, then
    ``baseline`` random ones of the segment's latest normal window; answer excerpts of at
    most ``excerpt_chars`` (0: none), around the reasoning ``markers``."""

    worst: int = 3
    uniform: int = 2
    baseline: int = 3
    excerpt_chars: int = 0
    markers: tuple[str, ...] = ()


def spread(sources: Iterable[Sequence[int]], budget: int = SAMPLE_MESSAGES) -> list[MessageKey]:
    """Up to ``budget`` messages of the offset ranges ``sources`` ((partition, first, last)
    each): evenly spaced within each range, which shares the budget with the others, and
    taken in turn, so a reader stopping early still saw every partition and the whole window."""
    ranges = [(int(p), int(first), int(last)) for p, first, last in sources if last >= first]
    quotas = [0] * len(ranges)
    left = budget
    while left > 0 and any(q < last - first + 1 for q, (_, first, last) in zip(quotas, ranges, strict=True)):
        for i, (_, first, last) in enumerate(ranges):
            if left > 0 and quotas[i] < last - first + 1:
                quotas[i] += 1
                left -= 1
    picks = [_evenly(first, last, quota) for (_, first, last), quota in zip(ranges, quotas, strict=True)]
    keys: list[MessageKey] = []
    for step in range(max(quotas, default=0)):
        for (partition, _, _), offsets in zip(ranges, picks, strict=True):
            if step < len(offsets):
                keys.append((partition, offsets[step]))
    return keys


def _evenly(first: int, last: int, count: int) -> list[int]:
    """``count`` offsets from ``first`` to ``last``, both ends included when count > 1."""
    span = last - first
    if count <= 0:
        return []
    if count == 1:
        return [first + span // 2]
    return [first + (i * span) // (count - 1) for i in range(count)]


def uniform_pick(items: Sequence[T], keys: Sequence[str], k: int, seed: str) -> list[T]:
    """``k`` of ``items`` uniformly at random, reproducibly: the ``k`` smallest of a hash of
    ``seed`` and each item's key (its location), so a replay picks the same requests.

    >>> uniform_pick(["a", "b", "c", "d"], ["0:1:0", "0:1:1", "0:1:2", "0:1:3"], 2, seed="w")
    ['c', 'd']
    """
    if k <= 0 or not items:
        return []
    ranked = sorted(range(len(items)), key=lambda i: zlib.crc32(f"{seed}|{keys[i]}".encode()))
    return [items[i] for i in ranked[:k]]


class RecentSources:
    """The offset ranges of recently judged windows (all segments together), by window start:
    where a baseline window's requests are, after its partials are gone. A handful of
    numbers per window, kept for the last ``keep_windows`` windows.

    >>> recent = RecentSources(keep_windows=2)
    >>> recent.note(0.0, [(0, 5, 9)]); recent.note(0.0, [(0, 3, 6), (1, 2, 2)]); recent.note(10.0, [(0, 10, 12)])
    >>> recent.of(0.0)
    [[0, 3, 9], [1, 2, 2]]
    >>> recent.note(20.0, [(0, 13, 14)]); recent.of(0.0) is None
    True
    """

    def __init__(self, keep_windows: int = 360) -> None:
        self.keep_windows = keep_windows
        self._by_start: dict[float, dict[int, list[int]]] = {}

    def note(self, start: float, sources: Iterable[Sequence[int]]) -> None:
        ranges = self._by_start.get(start)
        if ranges is None:
            ranges = self._by_start[start] = {}
            while len(self._by_start) > self.keep_windows:
                del self._by_start[min(self._by_start)]
        for partition, first, last in sources:
            known = ranges.get(partition)
            if known is None:
                ranges[partition] = [first, last]
            else:
                known[0], known[1] = min(known[0], first), max(known[1], last)

    def of(self, start: float) -> list[list[int]] | None:
        ranges = self._by_start.get(start)
        if ranges is None:
            return None
        return [[partition, first, last] for partition, (first, last) in sorted(ranges.items())]

    def starts(self) -> list[float]:
        """The windows remembered, oldest first."""
        return sorted(self._by_start)

    def __len__(self) -> int:
        return len(self._by_start)


def location_key(location: dict[str, Any]) -> str:
    return f"{location['partition']}:{location['offset']}:{location['index']}"
