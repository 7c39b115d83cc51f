"""What a before/after comparison holds fixed besides the segment: the load each request met,
and whether its prompt prefix could have hit the cache.

Two slices of one unchanged service differ in their traffic. With more requests in flight
an engine batches more of them and each decodes slower; when fewer prompts reuse a prefix
seen shortly before, the cache has less to hit and TTFT rises. Neither is the service's
doing. So each request gets two labels:

* its **load**: the requests in flight when it arrived, each counted for its *usual*
  duration, the period before's median TTFT plus its output tokens at the period before's
  median inter-token latency, rather than for the time it really took. The real count is
  no good: a slower decode holds every request longer, so a regression raises it and
  stratifying on it would explain the regression away. The usual count moves with the
  arrivals and their token lengths (a minute of long answers loads the engine more than a
  minute of short ones) and not with the service's speed. Binned in half-octaves.
* its **prefix**: ``SEEN`` when a request with the same ``prefix_hash`` arrived within
  ``lifetime_s`` before it (the cache could hold that prefix), ``NEW`` when none did, and
  ``UNREPORTED`` without a hash.

A label the data cannot give is unknown and the request is left out: the load until the
longest usual duration has passed since the data starts, and ``NEW`` within the first
``lifetime_s`` (the prefix may have come just before the data starts).

>>> rows = [{"timestamp": 100.0 + 10 * i, "e2e_s": 1.0, "ttft_s": 0.5, "decode_s": 0.5, "completion_tokens": 11,
...          "prefix_hash": "sys" if i % 2 else None} for i in range(10)]
>>> (labelled,) = label([rows], lifetime_s=25.0)
>>> [row[LOAD] for row in labelled][:3], [row[PREFIX] for row in labelled][:4]
([None, 0.0, 0.0], [2, -1, 2, 1])
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Fields a labelled row carries (beyond its request log's).
LOAD, PREFIX = "usual_in_flight", "prefix_seen"
#: Where a live watch's sampled row sits in its ``TrafficLog`` (replaced by the labels).
POSITION = "traffic_position"
#: The prefix labels (``UNKNOWN`` rows are left out).
UNKNOWN, NEW, SEEN, UNREPORTED = -1, 0, 1, 2
#: How long a prefix plausibly stays in an engine's cache after it was last used: a prefix
#: seen longer ago than this counts as new. Engines evict least recently used blocks, so the
#: real lifetime depends on the KV cache's size and the traffic; minutes is typical.
PREFIX_LIFETIME_S = 600.0
#: Load bands per doubling of the requests in flight.
BANDS_PER_DOUBLING = 2


def arrival_of(row: Mapping[str, Any]) -> float:
    """When a request arrived: its log's timestamp (the finish) less its ``e2e_s``."""
    stamp, e2e = row.get("timestamp"), row.get("e2e_s")
    if not isinstance(stamp, int | float):
        return math.nan
    if isinstance(e2e, int | float) and e2e >= 0:
        return float(stamp) - float(e2e)
    return float(stamp)


def _output_tokens(row: Mapping[str, Any]) -> float:
    tokens = row.get("completion_tokens")
    return float(tokens) if isinstance(tokens, int | float) and tokens > 0 else 1.0


def load_band(in_flight: float | None) -> str:
    """The half-octave band of a load (``?`` when unknown).

    >>> [load_band(x) for x in (0.0, 0.7, 1.0, 1.5, 60.0, None)]
    ['idle', '-2', '0', '1', '11', '?']
    """
    if in_flight is None or not math.isfinite(in_flight):
        return "?"
    if in_flight <= 0:
        return "idle"
    return str(math.floor(math.log2(in_flight) * BANDS_PER_DOUBLING))


@dataclass(frozen=True)
class UsualPace:
    """How long a request usually takes, from the period before: ``ttft_s`` plus ``itl_s`` per
    output token after the first.

    >>> pace = UsualPace.of([{"ttft_s": 0.2, "decode_s": 1.0, "completion_tokens": 101}] * 3)
    >>> pace, pace.durations(np.array([1.0, 11.0])).tolist()
    (UsualPace(ttft_s=0.2, itl_s=0.01), [0.2, 0.30000000000000004])
    """

    ttft_s: float
    itl_s: float

    @classmethod
    def of(cls, before: Sequence[Mapping[str, Any]]) -> UsualPace:
        """The medians of ``before`` (TTFT, else end to end; 0 where a field is missing)."""
        ttft, itl = [], []
        for row in before:
            first = row.get("ttft_s", row.get("e2e_s"))
            if isinstance(first, int | float) and math.isfinite(first):
                ttft.append(float(first))
            decode, tokens = row.get("decode_s"), row.get("completion_tokens")
            if isinstance(decode, int | float) and isinstance(tokens, int) and tokens > 1:
                itl.append(float(decode) / (tokens - 1))
        return cls(float(np.median(ttft)) if ttft else 0.0, float(np.median(itl)) if itl else 0.0)

    def durations(self, output_tokens: np.ndarray) -> np.ndarray:
        return self.ttft_s + self.itl_s * np.maximum(output_tokens - 1.0, 0.0)


def in_flight(arrivals: np.ndarray, durations: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Per time of ``at``, how many requests arrived before it and would still run then."""
    started = np.searchsorted(np.sort(arrivals), at, side="left")
    ended = np.searchsorted(np.sort(arrivals + durations), at, side="right")
    return (started - ended).astype(np.float64)


def span_starts(arrivals: np.ndarray, period: np.ndarray, gap_s: float) -> np.ndarray:
    """Per request, where the stretch of data it lies in begins: each period covers its first
    to its last arrival, and periods less than ``gap_s`` apart are one stretch (the usual
    before and after of a change), so a request early in the period after is judged on the
    end of the period before, while one after a gap in the data is not judged on nothing.

    >>> span_starts(np.array([0.0, 50.0, 60.0, 100.0, 500.0, 550.0]), np.array([0, 0, 1, 1, 2, 2]), 30.0).tolist()
    [0.0, 0.0, 0.0, 0.0, 500.0, 500.0]
    """
    spans = sorted((float(arrivals[period == p].min()), float(arrivals[period == p].max())) for p in np.unique(period))
    merged: list[list[float]] = []
    for first, last in spans:
        if merged and first - merged[-1][1] < gap_s:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    starts = np.array([first for first, _ in merged])
    return starts[np.searchsorted(starts, arrivals, side="right") - 1]


def prefix_labels(arrivals: np.ndarray, prefixes: np.ndarray, lifetime_s: float, starts: np.ndarray) -> np.ndarray:
    """Per request, ``SEEN``/``NEW``/``UNREPORTED``/``UNKNOWN`` (see the module's docstring).

    ``prefixes``: each request's prompt prefix as an integer id (``prefix_ids``; below 0:
    no hash logged); ``starts``: where each request's stretch of data begins
    (``span_starts``). A request is ``SEEN`` when the request with its prefix that arrived
    last before it (in arrival order, whatever order they finished in) did so within
    ``lifetime_s``.
    """
    labels = np.full(len(arrivals), UNREPORTED, dtype=np.int8)
    reported = np.flatnonzero(prefixes >= 0)
    if not len(reported):
        return labels
    # By prefix, then arrival (stable: requests arriving together keep their order), so
    # each request's predecessor with its prefix is the one just before it.
    order = reported[np.lexsort((arrivals[reported], prefixes[reported]))]
    at, prefix = arrivals[order], prefixes[order]
    seen = np.zeros(len(order), dtype=bool)
    seen[1:] = (prefix[1:] == prefix[:-1]) & (at[1:] - at[:-1] <= lifetime_s)
    labels[order] = np.where(seen, SEEN, np.where(at - starts[order] >= lifetime_s, NEW, UNKNOWN))
    return labels


def prefix_ids(hashes: Sequence[Any]) -> np.ndarray:
    """Each row's ``prefix_hash`` as an integer id (-1 where it is not a string)."""
    ids: dict[str, int] = {}
    return np.fromiter(
        (ids.setdefault(digest, len(ids)) if isinstance(digest, str) else -1 for digest in hashes),
        dtype=np.int64,
        count=len(hashes),
    )


def _lookback(durations: np.ndarray) -> float:
    """How far back a request's load reaches: nearly every usual duration (the longest few
    would make the first minutes of any period unknown)."""
    return float(np.quantile(durations, 0.99)) if len(durations) else 0.0


def label(
    periods: Sequence[Sequence[Mapping[str, Any]]], lifetime_s: float = PREFIX_LIFETIME_S
) -> list[list[dict[str, Any]]]:
    """Copies of one model's ``periods`` of rows (any order within; the first is the period
    before, whose pace is the usual one) with ``LOAD`` (None when unknown) and ``PREFIX``: the
    exact labels, from every request. A live watch, which keeps a sample, labels its requests
    as they come instead (``TrafficLog``)."""
    rows = [row for period in periods for row in period]
    which = np.repeat(np.arange(len(periods)), [len(period) for period in periods])
    arrivals = np.fromiter((arrival_of(row) for row in rows), np.float64, len(rows))
    known = np.isfinite(arrivals)
    arrivals, which = arrivals[known], which[known]
    durations = UsualPace.of(periods[0] if periods else ()).durations(
        np.fromiter((_output_tokens(row) for row, ok in zip(rows, known, strict=True) if ok), np.float64)
    )
    lookback = _lookback(durations)
    starts = span_starts(arrivals, which, max(lookback, 1.0)) if len(arrivals) else arrivals
    loads = np.where(arrivals - lookback >= starts, in_flight(arrivals, durations, arrivals), np.nan)
    hashes = prefix_ids([row.get("prefix_hash") for row, ok in zip(rows, known, strict=True) if ok])
    prefixes = prefix_labels(arrivals, hashes, lifetime_s, starts)
    load_of, prefix_of = np.full(len(rows), np.nan), np.full(len(rows), UNKNOWN, dtype=np.int8)
    load_of[known], prefix_of[known] = loads, prefixes
    labelled = [
        {**row, LOAD: None if math.isnan(load) else load, PREFIX: prefix}
        for row, load, prefix in zip(rows, load_of.tolist(), prefix_of.tolist(), strict=True)
    ]
    bounds = np.cumsum([0, *(len(period) for period in periods)])
    return [labelled[low:high] for low, high in itertools.pairwise(bounds)]


def is_labelled(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether ``rows`` carry the labels already (all or none do)."""
    return bool(rows) and PREFIX in rows[0]


class TrafficLog:
    """The labels of a live stream's requests, taken from every request while a watch keeps
    only a sample of them: each request's arrival, output tokens and prompt prefix (16 bytes
    a request). ``add`` returns where a request sits in the log; the labels are worked out
    when a comparison asks for them (``labelled``), from every request counted by then, so
    a request logged before one that arrived ahead of it with its prefix (a long answer
    finishes late) is labelled as ``label`` would: requests come in finish order, their
    prefixes reached the cache in arrival order. At most ``max_prefixes`` distinct
    prefixes are told apart; beyond that the oldest half is forgotten (their next request
    counts as a new prefix).

    >>> log = TrafficLog(lifetime_s=30.0)
    >>> rows = [{"timestamp": t + 1.0, "e2e_s": 1.0, "completion_tokens": 1, "prefix_hash": "p"}
    ...         for t in (5.0, 12.0, 50.0, 90.0)]
    >>> [log.add(row) for row in rows]
    [0, 1, 2, 3]
    >>> log.labels().tolist(), log.loads(np.array([5.0, 12.5, 50.5]), UsualPace(ttft_s=1.0, itl_s=0.0)).tolist()
    ([-1, 1, 0, 0], [nan, 1.0, 1.0])
    """

    def __init__(self, lifetime_s: float = PREFIX_LIFETIME_S, max_prefixes: int = 200_000) -> None:
        self.lifetime_s, self.max_prefixes = lifetime_s, max_prefixes
        self._arrivals, self._outputs, self._prefixes = array("d"), array("f"), array("q")
        self._earliest = math.inf
        self._prefix_ids: dict[str, int] = {}
        self._next_id = 0

    def add(self, row: Mapping[str, Any]) -> int:
        """Count ``row``'s arrival; returns its position in the log (-1: its arrival is unknown)."""
        at = arrival_of(row)
        if not math.isfinite(at):
            return -1
        self._earliest = min(self._earliest, at)
        self._arrivals.append(at)
        self._outputs.append(_output_tokens(row))
        self._prefixes.append(self._prefix_id(row.get("prefix_hash")))
        return len(self._arrivals) - 1

    def _prefix_id(self, digest: Any) -> int:
        if not isinstance(digest, str):
            return -1
        known = self._prefix_ids.get(digest)
        if known is not None:
            return known
        if len(self._prefix_ids) >= self.max_prefixes:
            for stale in list(self._prefix_ids)[: self.max_prefixes // 2]:
                del self._prefix_ids[stale]
        self._prefix_ids[digest], self._next_id = self._next_id, self._next_id + 1
        return self._next_id - 1

    def labels(self) -> np.ndarray:
        """``PREFIX`` of every request counted, by position."""
        arrivals = np.frombuffer(self._arrivals, dtype=np.float64)
        starts = np.full(len(arrivals), self._earliest)
        return prefix_labels(arrivals, np.frombuffer(self._prefixes, dtype=np.int64), self.lifetime_s, starts)

    def loads(self, at: np.ndarray, pace: UsualPace) -> np.ndarray:
        """The load at each arrival time of ``at`` from every request counted (NaN: unknown)."""
        arrivals = np.frombuffer(self._arrivals, dtype=np.float64)
        durations = pace.durations(np.frombuffer(self._outputs, dtype=np.float32).astype(np.float64))
        loads = in_flight(arrivals, durations, at)
        return np.where(at - _lookback(durations) >= self._earliest, loads, np.nan)

    def labelled(
        self, before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Both periods' rows, each with ``POSITION`` (from ``add``) in place of its labels,
        with their ``PREFIX`` and their load at the pace of the period before."""
        rows = [*before, *after]
        loads = self.loads(np.array([arrival_of(row) for row in rows], dtype=np.float64), UsualPace.of(before))
        labels = self.labels().tolist()
        out = []
        for row, load in zip(rows, loads.tolist(), strict=True):
            labelled = {name: value for name, value in row.items() if name != POSITION}
            at = row.get(POSITION, -1)
            labelled[PREFIX] = labels[at] if at >= 0 else UNKNOWN
            labelled[LOAD] = None if math.isnan(load) else load
            out.append(labelled)
        return out[: len(before)], out[len(before) :]
