"""Per-request figures behind the phase, throughput, completion and cache signals, as columns.

``models.windows.open_window`` folds the TTFT histogram, token counts and finish reasons; this
module adds, for one batch, everything else a window keeps (the columns of ``SUMS`` from
``content_reported`` on): whether an answer leaked a reasoning end marker or came back
empty while reasoning text was present, whether its prompt prefix had been seen before
(and if so, whether the cache still served none of it), and the log moments of each timed
phase. All of it adds up under ``merge``.

Work per record happens in numpy, except the two checks that need the text itself
(a substring test per logged answer) and the prefix lookup (a dict probe per hashed
prompt); records without those fields cost nothing there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from servewatch.models.windows.batch import RowBatch
from servewatch.models.windows.window import LOG_FLOOR_S, PHASES, RECENT_PHASES, SUMS, log_seconds

#: What reasoning models print between their reasoning and their answer. Seen in the
#: answer text, it means the engine's reasoning parser did not split the output.
DEFAULT_REASONING_MARKERS = ("</think>",)

#: The columns this module computes, in ``SUMS`` order.
COLUMNS = SUMS[SUMS.index("content_reported") :]


class PrefixMemory:
    """Prompt-prefix hashes seen recently, bounded: "has this prefix been seen before?".

    One per worker. When full, the oldest half is forgotten (dicts keep insertion order),
    so memory is bounded by ``capacity`` and a prefix in steady use is re-learned at once.

    >>> memory = PrefixMemory(capacity=4)
    >>> memory.seen_before(["a", "b", "a", None, "c"]).tolist()
    [False, False, True, False, False]
    >>> memory.seen_before(["c", "d", None]).tolist()
    [True, False, False]
    """

    __slots__ = ("_seen", "capacity")

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 2:
            raise ValueError("capacity must be at least 2")
        self.capacity = capacity
        self._seen: dict[str, None] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def seen_before(self, hashes: Sequence[str | None]) -> np.ndarray:
        """For each hash (None: not reported), whether it was seen before it, in order.

        Per batch, not per record: a batch holds few distinct prefixes, so the memory is
        probed once per distinct hash and the rest is numpy.
        """
        if not hashes:
            return np.zeros(0, dtype=bool)
        distinct = list(dict.fromkeys(hashes))  # in order of first appearance
        code_of = {value: code for code, value in enumerate(distinct)}
        codes = np.fromiter(map(code_of.__getitem__, hashes), dtype=np.intp, count=len(hashes))
        seen = self._seen
        known = np.array([value is not None and value in seen for value in distinct], dtype=bool)
        # Codes are numbered in order of first appearance, so a record is a hash's first in
        # the batch exactly when its code exceeds every code before it (no sort needed).
        running = np.maximum.accumulate(codes)
        later = np.ones(len(hashes), dtype=bool)
        later[0] = False
        later[1:] = codes[1:] <= running[:-1]
        seen.update(dict.fromkeys(value for value in distinct if value is not None))
        if len(seen) > self.capacity:
            for stale in list(seen)[: len(seen) - self.capacity // 2]:
                del seen[stale]
        none = code_of.get(None)
        reported = codes != none if none is not None else np.ones(len(hashes), dtype=bool)
        return reported & (known[codes] | later)


def leaked(content: str | None, markers: Sequence[str]) -> bool:
    """Whether an answer contains a reasoning end marker."""
    return content is not None and any(marker in content for marker in markers)


#: Uncached prompt tokens below this count as this many for prefill per token: a prompt
#: served almost whole from the cache still pays a fixed cost to start.
MIN_PREFILL_TOKENS = 256


def prefill_per_1k_tokens(prefill: np.ndarray, queue: np.ndarray, ttft: np.ndarray, uncached: np.ndarray) -> np.ndarray:
    """Seconds of prefill per 1,000 uncached prompt tokens, per request: logged prefill time,
    else TTFT less queue time, else TTFT (NaN where none is known).

    >>> prefill_per_1k_tokens(*map(np.array, ([0.5, np.nan, np.nan], [0.1, 0.2, np.nan], [0.6, 0.7, 0.4],
    ...                                      [2000.0, 1000.0, 100.0]))).round(2).tolist()
    [0.25, 0.5, 1.56]
    """
    seconds = np.where(np.isnan(prefill), np.where(np.isnan(queue), ttft, ttft - queue), prefill)
    return seconds / (np.maximum(uncached, MIN_PREFILL_TOKENS) / 1000.0)


def signal_columns(
    batch: RowBatch,
    completion: np.ndarray,
    uncached: np.ndarray,
    markers: Sequence[str] = DEFAULT_REASONING_MARKERS,
    prefixes: PrefixMemory | None = None,
    no_cache_hit: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The figures of ``COLUMNS`` per record of ``batch``, a column each; a column left out is
    all zeros (e.g. no answer text or prefix hash logged), so folding can skip it.
    ``no_cache_hit``: per record, whether it reported 0 cached tokens (None: none did)."""
    n = len(batch)
    out: dict[str, np.ndarray] = {}
    contents: list[Any] = batch.values("content")
    reasonings: list[Any] = batch.values("reasoning_content")
    # Most fleets log no answer text: then this is two C-level counts, not a loop.
    if contents.count(None) < n or reasonings.count(None) < n:
        reported, leaks, empty = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        for i, (content, reasoning) in enumerate(zip(contents, reasonings, strict=True)):
            if content is None and reasoning is None:
                continue
            reported[i] = True
            leaks[i] = leaked(content, markers)
            empty[i] = bool(reasoning and reasoning.strip()) and not (content and content.strip())
        out.update(content_reported=reported, reasoning_leaks=leaks, empty_answers=empty)
    hashes: list[Any] = batch.values("prefix_hash")
    missing = hashes.count(None)
    if missing < n:
        out["prefix_reported"] = (
            np.ones(n, dtype=bool) if missing == 0 else np.array([value is not None for value in hashes], dtype=bool)
        )
        if prefixes is not None:
            out["prefix_shared"] = shared = prefixes.seen_before(hashes)
            if no_cache_hit is not None:
                out["prefix_shared_missed"] = shared & no_cache_hit
    queue, prefill, decode = batch.column("queue_s"), batch.column("prefill_s"), batch.column("decode_s")
    decode_tokens = np.maximum(completion - 1.0, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        itl = decode / decode_tokens  # NaN or inf where there is no decode to speak of
    itl[decode_tokens <= 0] = np.nan
    per_1k = prefill_per_1k_tokens(prefill, queue, batch.column("ttft_s"), uncached)
    for phase, seconds in zip(PHASES, (queue, prefill, itl, batch.column("e2e_s"), per_1k), strict=True):
        known = ~np.isnan(seconds)
        if not known.any():
            continue
        logs = log_seconds(np.where(known, seconds, LOG_FLOOR_S))  # 0 where unknown
        out[f"{phase}_n"], out[f"{phase}_log"], out[f"{phase}_log2"] = known, logs, logs * logs
    timed_decode = ~np.isnan(decode) & (decode_tokens > 0)
    if timed_decode.any():
        out["decode_tokens"] = np.where(timed_decode, decode_tokens, 0.0)
        out["decode_s"] = np.where(timed_decode, decode, 0.0)
    timed_prefill = ~np.isnan(prefill)
    if timed_prefill.any():
        out["prefill_tokens"] = np.where(timed_prefill, uncached, 0.0)
        out["prefill_s"] = np.where(timed_prefill, prefill, 0.0)
    return out


def recent_columns(columns: dict[str, np.ndarray], into_window: np.ndarray, e2e: np.ndarray) -> dict[str, np.ndarray]:
    """The ``RECENT_PHASES``' sums weighed by how recent each request is: the share of its
    life (``e2e``) that falls in the window it finished in (``into_window``: seconds from that
    window's start to its finish; 1 where its life is not known), from ``signal_columns``'
    ``columns``.

    A request log is written when the request ends, its whole life averaged. A replica that
    slowed down a moment ago finishes requests slowed for part of their life: the longer a
    request ran before the change, the less of it the change shows. Weighed this way, the
    requests that ran mostly in the window speak for it, and the rest count for less.

    >>> columns = {"itl_n": np.array([True, True, False]), "itl_log": np.array([2.0, 4.0, 0.0])}
    >>> recent = recent_columns(columns, np.array([5.0, 5.0, 5.0]), np.array([2.0, 20.0, np.nan]))
    >>> recent["itl_recent_w"].tolist(), recent["itl_recent_log"].tolist(), recent["itl_recent_w2"].tolist()
    ([1.0, 0.25, 0.0], [2.0, 1.0, 0.0], [1.0, 0.0625, 0.0])
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(e2e > 0, np.minimum(into_window / e2e, 1.0), 1.0)
    out: dict[str, np.ndarray] = {}
    for phase in RECENT_PHASES:
        known = columns.get(f"{phase}_n")
        if known is None:
            continue
        weight = np.where(known, share, 0.0)
        out[f"{phase}_recent_w"] = weight
        out[f"{phase}_recent_log"] = weight * columns[f"{phase}_log"]
        out[f"{phase}_recent_w2"] = weight * weight
    return out
