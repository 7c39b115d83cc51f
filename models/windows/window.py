"""``WindowStats``: everything a detector needs to know about one segment in one window.

Built by each worker from batches of request logs (stage 1), shipped as a compact
partial, merged per segment (stage 2), then read by the models once per window. Every
field adds up under ``merge``, so the order in which partials arrive does not matter.

When a window closes, every segment's partial exists at once, so a partial is kept small:
its histogram, finish-reason counts and evidence are numpy rows, usually views into the
table they were built in (``models.windows.open_window``) or decoded into (``from_dicts``), not
copies; scalars are slots.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any, NamedTuple

import numpy as np

from servewatch.models.stats.capacity import ARRIVAL_LAGS
from servewatch.models.stats.sketch import N_BUCKETS, LogHistogram
from servewatch.models.windows.segment_keys import parse_key
from servewatch.schemas.evidence_pointer import KeptRequest, RequestAt
from servewatch.schemas.request_log import FinishReason

#: Finish reasons in the order of a window's reason counts.
REASONS = tuple(reason.value for reason in FinishReason)

#: Fields of a request log kept as evidence: enough to find it in the user's log store,
#: never the prompt, never the answer text (excerpts are a separate, scrubbed feature).
EVIDENCE_FIELDS = (
    "request_id", "timestamp", "instance", "model", "route", "tenant", "prompt_tokens", "cached_tokens",
    "completion_tokens", "max_tokens", "ttft_s", "queue_s", "prefill_s", "decode_s", "e2e_s",
    "finish_reason", "status_code", "engine", "engine_version",
)  # fmt: skip

ARRIVAL_COLUMNS = tuple(
    f"{scope}arrived{what}_{lag}" for scope in ("", "model_") for what in ("", "_tokens") for lag in range(ARRIVAL_LAGS)
)

#: Timed phases replicas are compared on, whose requests a window also sums weighed by how
#: recent they are (the last columns of ``SUMS``).
RECENT_PHASES = ("prefill_token", "itl")

#: Figures that simply add up under ``merge``: the columns of ``WindowBlock.sums``.
#: Counts of requests and tokens; for each timed phase (queue, prefill, inter-token
#: latency, end-to-end) the number of requests that reported it and the sum and sum of
#: squares of its log (``log_seconds``), enough for a mean and a variance; seconds and
#: tokens of decode and prefill, for throughput as a ratio of sums.
SUMS = (
    "requests", "prompt_tokens", "completion_tokens", "cached_tokens", "uncached_prompt_tokens",
    "cache_reported_prompt_tokens", "errors", "e2e_sum", "ttft_sum",
    # completion signals: answers whose text was logged, leaked reasoning markers, empty
    # answers with reasoning text; requests that reported a prefix hash, of those the ones
    # whose prefix this worker had seen before, and of those the ones that got no cached token
    "content_reported", "reasoning_leaks", "empty_answers", "prefix_reported", "prefix_shared",
    "prefix_shared_missed",
    "queue_n", "queue_log", "queue_log2", "prefill_n", "prefill_log", "prefill_log2",
    "itl_n", "itl_log", "itl_log2", "e2e_n", "e2e_log", "e2e_log2",
    # prefill seconds per 1,000 uncached prompt tokens, per request (TTFT less queue time
    # where prefill is not logged): prefill time with the prompt's length taken out, so a
    # slowdown of the long prompts of a band shows wherever within the band they start
    "prefill_token_n", "prefill_token_log", "prefill_token_log2",
    "decode_tokens", "decode_s", "prefill_tokens", "prefill_s",
    # the load of the segment's whole model in the window (every segment of a model shares
    # its engines), set by stage 1 when the window closes and summed over stage-1 workers
    "model_requests", "model_prompt_tokens", "model_output_tokens",
    # arrivals: requests (and their prompt tokens) that finished here, by the window they
    # *started* in, 0 to ARRIVAL_LAGS - 1 windows back (``timestamp - e2e_s``); older starts
    # are not counted. The model's too. Demand is what arrived, not what finished: a
    # slowing server finishes fewer requests, and must not lower its own expectation.
    *ARRIVAL_COLUMNS,
    # seconds requests spent in service (end-to-end less queue time, where logged), and the
    # model's: over the window's length, the slots its engines kept busy (Little's law)
    "running_s", "model_running_s",
    # the phases replicas are compared on, each request weighed by the share of its life
    # (``timestamp - e2e_s`` to ``timestamp``) that falls in the window it finished in: the
    # weights, the weighted sum of logs and the squared weights (``RECENT_COLUMNS``)
    *(f"{phase}_recent{part}" for phase in RECENT_PHASES for part in ("_w", "_log", "_w2")),
)  # fmt: skip
INTEGER_SUMS = frozenset(name for name in SUMS if not name.endswith(("_sum", "_log", "_log2", "_s", "_w", "_w2")))
#: Timed phases whose log moments a window keeps (``WindowStats.phase``).
PHASES = ("queue", "prefill", "itl", "e2e", "prefill_token")
#: Phase times are kept as ``log(max(t, LOG_FLOOR_S) / LOG_FLOOR_S)``: never negative (the
#: wire format rejects negative sums), and 0.1 ms is far below any phase worth judging.
LOG_FLOOR_S = 1e-4


def log_seconds(values: Any) -> Any:
    """The log-moment scale of phase times (numpy arrays or floats)."""
    return np.log(np.maximum(values, LOG_FLOOR_S) / LOG_FLOOR_S)


class PhaseStats(NamedTuple):
    """One phase of one window: requests that reported it, mean and variance of log seconds."""

    n: int
    mean_log: float  # natural log of seconds
    var_log: float

    @property
    def geometric_mean(self) -> float:
        return math.exp(self.mean_log) if self.n else math.nan


COLUMN_OF = {name: column for column, name in enumerate(SUMS)}
#: Each phase's (count, sum of logs, sum of squared logs) columns.
PHASE_COLUMNS = {name: tuple(COLUMN_OF[f"{name}{part}"] for part in ("_n", "_log", "_log2")) for name in PHASES}
#: Each ``RECENT_PHASES`` phase's (weights, weighted sum of logs, squared weights) columns.
RECENT_COLUMNS = {
    name: tuple(COLUMN_OF[f"{name}_recent{part}"] for part in ("_w", "_log", "_w2")) for name in RECENT_PHASES
}


@functools.cache
def _count_max(dtype: np.dtype[Any]) -> int:
    """``np.iinfo(dtype).max``, remembered: ``WindowBlock.fit`` asks it at every merge."""
    return int(np.iinfo(dtype).max)


def _add_range(ranges: list[tuple[int, int, int]], new: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    """Offsets seen per partition as one (partition, first, last) range each.

    Within a partition offsets are consumed in order, so a partial holds every record of
    its (segment, window) from the messages in its range; a replayed partial overlaps it.
    """
    partition, first, last = new
    out, merged = [], False
    for p, a, b in ranges:
        if p == partition and not merged:
            out.append((p, min(a, first), max(b, last)))
            merged = True
        else:
            out.append((p, a, b))
    if not merged:
        out.append(new)
    return out


#: Where a request log is: (partition, message offset, position in the message) of the
#: requests topic, or (0, chunk number, position) of a replayed file.
Location = tuple[int, int, int]


def pack_location(partition: Any, offset: Any, index: Any) -> tuple[Any, Any]:
    """A ``Location`` in two int64s: (offset, partition and index in one); each may be an int64 array."""
    return offset, (partition << 32) | index


def unpack_location(offset: int, partition_index: int) -> Location:
    return partition_index >> 32, offset, partition_index & 0xFFFFFFFF


class WindowBlock:
    """Window figures of many segments as columns: a row per segment.

    Stage 1 folds records into a block's rows (``models.windows.open_window``); a decoded bundle of
    partials is one block (``WindowStats.from_dicts``). A ``WindowStats`` is a handle on one
    row, so the thousands of partials that exist when a window closes cost a small object
    each, not a histogram and a dict each.
    """

    __slots__ = ("evidence_at", "evidence_k", "evidence_ttft", "hist", "reasons", "sums")

    def __init__(self, rows: int, evidence_k: int = 5) -> None:
        self.evidence_k = evidence_k
        self.sums = np.zeros((rows, len(SUMS)))
        # Bucket and reason counts start at 8 bits and widen (``fit``) as a segment's
        # requests in the window grow: many segments means few requests each, and then a
        # live segment's histogram costs 130 bytes, not 520.
        self.hist = np.zeros((rows, N_BUCKETS), dtype=np.uint8)
        self.reasons = np.zeros((rows, len(REASONS)), dtype=np.uint8)
        # Per row, the slowest requests, slowest first: TTFT (-inf: empty slot; float32 is
        # plenty for seconds) and where each is, packed by ``pack_location``.
        self.evidence_ttft = np.full((rows, evidence_k), -math.inf, dtype=np.float32)
        self.evidence_at = np.zeros((rows, evidence_k, 2), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.sums)

    def fit(self, requests: int) -> None:
        """Widen the counts, if needed, so a row of ``requests`` requests cannot overflow them
        (no count in a row exceeds its requests). Call before adding those counts."""
        if requests > _count_max(self.hist.dtype):
            wider = next(t for t in (np.uint16, np.int32, np.int64) if requests <= _count_max(np.dtype(t)))
            self.hist, self.reasons = self.hist.astype(wider), self.reasons.astype(wider)

    def make_room(self, rows: int) -> None:
        """Hold at least ``rows`` rows, growing by a quarter at a time: tables live for a window
        and are sized from the previous one (see ``rows_hint``), so doubling would mostly
        leave rows empty (up to half the table, at any number of segments)."""
        if rows > len(self):
            self.grow(max(rows, len(self) + len(self) // 4 + 8))

    def grow(self, rows: int) -> None:
        """Make room for ``rows`` rows (new rows empty)."""
        if rows <= len(self):
            return

        def grown(table: np.ndarray, fill: float = 0) -> np.ndarray:
            out = np.full((rows, *table.shape[1:]), fill, dtype=table.dtype)
            out[: len(table)] = table
            return out

        self.sums, self.hist, self.reasons = grown(self.sums), grown(self.hist), grown(self.reasons)
        self.evidence_ttft, self.evidence_at = grown(self.evidence_ttft, -math.inf), grown(self.evidence_at)


class WindowStats:
    """Sums, counts and a latency histogram of one segment over ``[start, start + length)``.

    A handle on row ``row`` of a ``WindowBlock`` (its own one-row block when built alone):
    the figures are read from there, and ``merge`` adds into it.

    >>> a = WindowStats("model=m", 0.0, 10.0, requests=3, prompt_tokens=300)
    >>> a.merge(WindowStats("model=m", 0.0, 10.0, requests=1, prompt_tokens=50))
    >>> a.requests, a.prompt_tokens, a.load()["requests_per_s"]
    (4, 350, 0.4)
    """

    __slots__ = ("block", "key", "length", "row", "sources", "start", "watermark")

    def __init__(
        self,
        key: str,
        start: float,
        length: float,
        *,
        block: WindowBlock | None = None,
        row: int = 0,
        evidence_k: int = 5,
        sources: list[tuple[int, int, int]] | None = None,
        watermark: float = -math.inf,
        **figures: float,
    ) -> None:
        self.key, self.start, self.length = key, start, length
        self.block = block if block is not None else WindowBlock(1, evidence_k)
        self.row = row
        self.sources = sources if sources is not None else []  # (partition, first, last offset)
        self.watermark = watermark  # the sending partition's watermark (transport metadata, not merged)
        for name, value in figures.items():
            self.block.sums[row, COLUMN_OF[name]] = value

    def __getattr__(self, name: str) -> Any:
        # The summed figures (requests, prompt_tokens, ..., e2e_sum, ttft_sum), from the block.
        column = COLUMN_OF.get(name)
        if column is not None:
            value = self.block.sums.item(self.row, column)  # a Python float, in one call
            return int(value) if name in INTEGER_SUMS else value
        raise AttributeError(name)

    # -- building (rows are folded in by ``models.windows.open_window``) ----------------------
    def merge(self, other: WindowStats) -> None:
        if (other.key, other.start) != (self.key, self.start):
            raise ValueError("can only merge partials of the same segment and window")
        mine, theirs = self.block, other.block
        if not self.sources and mine.sums[self.row, 0] == 0 and mine.evidence_k == theirs.evidence_k:
            self._take(other)  # a fresh accumulator (stage 2's first partial of a window): a copy
            return
        mine.sums[self.row] += theirs.sums[other.row]
        mine.fit(int(mine.sums[self.row, 0]))
        # ``fit`` made room, so adding counts of a wider type cannot overflow: cast freely.
        np.add(mine.hist[self.row], theirs.hist[other.row], out=mine.hist[self.row], casting="unsafe")
        np.add(mine.reasons[self.row], theirs.reasons[other.row], out=mine.reasons[self.row], casting="unsafe")
        # Evidence: the slowest of both, slowest first (ties: the one merged in first).
        times = np.concatenate((mine.evidence_ttft[self.row], theirs.evidence_ttft[other.row]))
        at = np.concatenate((mine.evidence_at[self.row], theirs.evidence_at[other.row]))
        best = np.argsort(-times, kind="stable")[: mine.evidence_k]
        mine.evidence_ttft[self.row], mine.evidence_at[self.row] = times[best], at[best]
        if not self.sources:
            self.sources = other.sources  # shared, never mutated: a window's partials share one list
            return
        for source in other.sources:
            self.sources = _add_range(self.sources, source)

    def _take(self, other: WindowStats) -> None:
        """Become a copy of ``other``'s figures (this row is empty): no adding, no ranking."""
        mine, theirs = self.block, other.block
        mine.sums[self.row] = theirs.sums[other.row]
        mine.fit(int(mine.sums[self.row, 0]))
        mine.hist[self.row] = theirs.hist[other.row]
        mine.reasons[self.row] = theirs.reasons[other.row]
        mine.evidence_ttft[self.row], mine.evidence_at[self.row] = (
            theirs.evidence_ttft[other.row],
            theirs.evidence_at[other.row],
        )
        self.sources = other.sources  # shared, never mutated: a window's partials share one list

    # -- reading --------------------------------------------------------------------
    @property
    def end(self) -> float:
        return self.start + self.length

    @property
    def evidence_k(self) -> int:
        return self.block.evidence_k

    @property
    def ttft(self) -> LogHistogram:
        return LogHistogram(self.block.hist[self.row])

    @property
    def finish_reasons(self) -> dict[str, int]:
        """Requests per finish reason (only the reasons seen)."""
        return {REASONS[i]: count for i, count in enumerate(self.block.reasons[self.row].tolist()) if count}

    @property
    def labels(self) -> dict[str, str]:
        return parse_key(self.key)

    @property
    def ttft_count(self) -> int:
        return self.ttft.count

    def ttft_quantile(self, q: float) -> float:
        return self.ttft.quantile(q)

    @property
    def cache_hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache (NaN when nobody reported it)."""
        reported = self.cache_reported_prompt_tokens
        return math.nan if reported == 0 else self.cached_tokens / reported

    def phase(self, name: str) -> PhaseStats:
        """Log-moment summary of ``name`` (one of ``PHASES``) over the requests that reported it."""
        n, total, squares = (self.block.sums.item(self.row, column) for column in PHASE_COLUMNS[name])
        if n == 0:
            return PhaseStats(0, math.nan, math.nan)
        mean = total / n
        return PhaseStats(int(n), mean + math.log(LOG_FLOOR_S), max(squares / n - mean * mean, 0.0))

    def rate(self, numerator: str, denominator: str = "requests") -> tuple[int, int]:
        """A count and the count it is a share of, e.g. ``rate("reasoning_leaks", "content_reported")``."""
        return int(getattr(self, numerator)), int(getattr(self, denominator))

    @property
    def truncated(self) -> int:
        """Answers cut by the length limit (``finish_reason=length``)."""
        return int(self.block.reasons[self.row, REASONS.index("length")])

    def load(self) -> dict[str, float]:
        """Load in requests and tokens per second; concurrency by Little's law."""
        per_s = 1.0 / self.length
        requests, prompt, completion, _, uncached, _, _, e2e = self.block.sums[self.row, :8].tolist()
        figures = {
            "requests": requests,
            "requests_per_s": requests * per_s,
            "prompt_tokens_per_s": prompt * per_s,
            "uncached_prompt_tokens_per_s": uncached * per_s,
            "output_tokens_per_s": completion * per_s,
            "concurrency": e2e * per_s,
        }
        # The model's load, as stage 1 saw it; a window built on its own stands for itself.
        model = self.model_requests, self.model_prompt_tokens, self.model_output_tokens
        if model[0] <= 0:
            model = requests, prompt, completion
        figures["model_requests_per_s"] = model[0] * per_s
        figures["model_prompt_tokens_per_s"] = model[1] * per_s
        figures["model_output_tokens_per_s"] = model[2] * per_s
        if not math.isnan(hit := self.cache_hit_rate):
            figures["cache_hit_rate"] = hit
        if reused := self.prefix_shared:  # requests reusing a prefix seen before, and the cache's misses
            figures["reused_prefix_requests"] = reused
            figures["reused_prefix_missed"] = self.prefix_shared_missed
        queue = self.phase("queue")
        if queue.n:
            figures["queue_s"] = queue.geometric_mean
            # The share of the time to first token spent queueing, from sums of seconds: a
            # burst queues some requests for seconds and none of the rest, and a mean of logs
            # (``queue_s``) then reads the queue as a small part of TTFT when it is most of it.
            ttft_s = float(self.block.sums[self.row, COLUMN_OF["ttft_sum"]])
            if ttft_s > 0:
                queued_s = e2e - float(self.block.sums[self.row, COLUMN_OF["running_s"]])
                figures["queue_share"] = min(max(queued_s / ttft_s, 0.0), 1.0)
        running = self.model_running_s if self.model_requests > 0 else self.running_s
        figures["model_running"] = running * per_s  # slots busy on average (Little's law)
        # Engine throughput per request: tokens per second of prefill and of decode.
        if (prefill_s := self.prefill_s) > 0:
            figures["prefill_tokens_per_s_per_request"] = self.prefill_tokens / prefill_s
        if (decode_s := self.decode_s) > 0:
            figures["decode_tokens_per_s_per_request"] = self.decode_tokens / decode_s
        return figures

    def arrival_counts(self) -> list[tuple[float, float]]:
        """The model's requests (and their prompt tokens) that finished in this window, by
        the window they started in: this one first, then 1 to ``ARRIVAL_LAGS - 1`` back."""
        sums = self.block.sums[self.row]
        return [
            (float(sums[COLUMN_OF[f"model_arrived_{lag}"]]), float(sums[COLUMN_OF[f"model_arrived_tokens_{lag}"]]))
            for lag in range(ARRIVAL_LAGS)
        ]

    @property
    def evidence(self) -> list[tuple[float, Location]]:
        """The kept requests, slowest first, as (TTFT, location)."""
        kept = zip(self.block.evidence_ttft[self.row].tolist(), self.block.evidence_at[self.row].tolist(), strict=True)
        return [(round(ttft, 6), unpack_location(*at)) for ttft, at in kept if ttft > -math.inf]

    def kept_requests(self) -> tuple[KeptRequest, ...]:
        """The slowest requests, slowest first, as pointers: their TTFT and place (partition,
        offset, index). ``pipeline.worker.evidence`` reads the records themselves back."""
        return tuple(
            KeptRequest(ttft_s=ttft, location=RequestAt(partition=p, offset=o, index=i))
            for ttft, (p, o, i) in self.evidence
        )

    # -- wire format ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (string keys only): what stage 1 sends to stage 2."""
        sums = self.block.sums[self.row].tolist()
        data: dict[str, Any] = {
            name: int(value) if name in INTEGER_SUMS else value for name, value in zip(SUMS, sums, strict=True)
        }
        data.update(
            key=self.key,
            start=self.start,
            length=self.length,
            ttft={str(i): c for i, c in self.ttft.to_sparse().items()},
            finish_reasons=self.finish_reasons,
            evidence_k=self.evidence_k,
            evidence=[[ttft, *where] for ttft, where in self.evidence],
            sources=[list(s) for s in self.sources],
            watermark=self.watermark if math.isfinite(self.watermark) else None,
        )
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WindowStats:
        return cls.from_dicts([data])[0]

    @classmethod
    def from_dicts(cls, items: list[dict[str, Any]]) -> list[WindowStats]:
        """A bundle of partials, decoded into one block (a row each)."""
        block = WindowBlock(len(items), max((int(d["evidence_k"]) for d in items), default=5))
        block.fit(max((int(d["requests"]) for d in items), default=0))
        out = []
        for row, data in enumerate(items):
            watermark = data.get("watermark")
            stats = cls(
                sys.intern(str(data["key"])), float(data["start"]), float(data["length"]), block=block, row=row,
                sources=[(int(p), int(a), int(b)) for p, a, b in data["sources"]],
                watermark=-math.inf if watermark is None else float(watermark),
            )  # fmt: skip
            block.sums[row] = [float(data.get(name, 0.0)) for name in SUMS]  # older partials lack later figures
            block.hist[row] = LogHistogram.from_sparse(data["ttft"]).counts
            for reason, count in data["finish_reasons"].items():
                block.reasons[row, REASONS.index(str(reason))] += int(count)
            for slot, (ttft, *where) in enumerate(data["evidence"][: block.evidence_k]):
                block.evidence_ttft[row, slot] = float(ttft)
                block.evidence_at[row, slot] = pack_location(*(int(v) for v in where))
            out.append(stats)
        return out
