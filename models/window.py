"""``WindowStats``: everything a detector needs to know about one segment in one window.

Built per input partition from batches of request logs (stage 1), shipped as a compact
partial, merged per segment (stage 2), then read by the models once per window. Every
field adds up under ``merge``, so the order in which partials arrive does not matter.

When a window closes, every segment's partial exists at once, so a partial is kept small:
its histogram, finish-reason counts and evidence are numpy rows, usually views into the
table they were built in (``models.open_window``) or decoded into (``from_dicts``), not
copies; scalars are slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.segments import parse_key
from models.sketch import N_BUCKETS, LogHistogram
from schemas.request_log import FinishReason

#: Finish reasons in the order of a window's reason counts.
REASONS = tuple(reason.value for reason in FinishReason)

#: Fields of a request log kept as evidence: enough to find it in the user's log store,
#: never the prompt, never the answer text (excerpts are a separate, scrubbed feature).
EVIDENCE_FIELDS = (
    "request_id", "timestamp", "instance", "model", "route", "tenant", "prompt_tokens", "cached_tokens",
    "completion_tokens", "max_tokens", "ttft_s", "queue_s", "prefill_s", "decode_s", "e2e_s",
    "finish_reason", "status_code", "engine", "engine_version",
)  # fmt: skip

#: Counters that simply add up under ``merge`` (ints, then floats).
_INT_SUMS = (
    "requests", "prompt_tokens", "uncached_prompt_tokens", "cached_tokens", "cache_reported_prompt_tokens",
    "completion_tokens", "errors",
)  # fmt: skip
_FLOAT_SUMS = ("e2e_sum", "ttft_sum")


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


@dataclass(slots=True)
class WindowStats:
    """Sums, counts and a latency histogram of one segment over ``[start, start + length)``."""

    key: str
    start: float
    length: float
    requests: int = 0
    prompt_tokens: int = 0
    uncached_prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_reported_prompt_tokens: int = 0  # prompt tokens of requests that reported cached_tokens
    completion_tokens: int = 0
    e2e_sum: float = 0.0
    ttft: LogHistogram = field(default_factory=LogHistogram)
    ttft_sum: float = 0.0
    reason_counts: np.ndarray = field(default_factory=lambda: np.zeros(len(REASONS), dtype=np.int32))
    errors: int = 0
    evidence_k: int = 5
    # The slowest requests by reference, slowest first: their TTFT (-inf pads an empty slot)
    # and where each record is, (partition, offset, index). The records are read back only
    # when the window fires (``pipeline.evidence``).
    evidence_ttft: np.ndarray = field(default_factory=lambda: np.zeros(0))
    evidence_at: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    sources: list[tuple[int, int, int]] = field(default_factory=list)  # (partition, first, last offset)
    watermark: float = -math.inf  # the sending partition's watermark (transport metadata, not merged)

    # -- building (rows are folded in by ``models.open_window``) ----------------------
    def note_source(self, partition: int, offset: int) -> None:
        """Record that messages up to ``offset`` of ``partition`` are folded in (one range per partition)."""
        self.sources = _add_range(self.sources, (partition, offset, offset))

    def merge(self, other: WindowStats) -> None:
        if (other.key, other.start) != (self.key, self.start):
            raise ValueError("can only merge partials of the same segment and window")
        for name in _INT_SUMS + _FLOAT_SUMS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.ttft.merge(other.ttft)
        self.reason_counts = self.reason_counts + other.reason_counts
        self._merge_evidence(other)
        for source in other.sources:
            self.sources = _add_range(self.sources, source)

    def _merge_evidence(self, other: WindowStats) -> None:
        """Keep the ``evidence_k`` slowest, slowest first (ties: the one merged in first)."""
        times = np.concatenate((self.evidence_ttft, other.evidence_ttft))
        at = np.concatenate((self.evidence_at, other.evidence_at))
        best = np.argsort(-times, kind="stable")[: self.evidence_k]
        best = best[times[best] > -math.inf]
        self.evidence_ttft, self.evidence_at = times[best], at[best]

    # -- reading --------------------------------------------------------------------
    @property
    def end(self) -> float:
        return self.start + self.length

    @property
    def finish_reasons(self) -> dict[str, int]:
        """Requests per finish reason (only the reasons seen)."""
        return {REASONS[i]: count for i, count in enumerate(self.reason_counts.tolist()) if count}

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
        if self.cache_reported_prompt_tokens == 0:
            return math.nan
        return self.cached_tokens / self.cache_reported_prompt_tokens

    def load(self) -> dict[str, float]:
        """Load in requests and tokens per second; concurrency by Little's law."""
        per_s = 1.0 / self.length
        figures = {
            "requests": float(self.requests),
            "requests_per_s": self.requests * per_s,
            "prompt_tokens_per_s": self.prompt_tokens * per_s,
            "uncached_prompt_tokens_per_s": self.uncached_prompt_tokens * per_s,
            "output_tokens_per_s": self.completion_tokens * per_s,
            "concurrency": self.e2e_sum * per_s,
        }
        if not math.isnan(hit := self.cache_hit_rate):
            figures["cache_hit_rate"] = hit
        return figures

    @property
    def evidence(self) -> list[tuple[float, Location]]:
        """The kept requests, slowest first, as (TTFT, location)."""
        kept = zip(self.evidence_ttft.tolist(), self.evidence_at.tolist(), strict=True)
        return [(ttft, (p, o, i)) for ttft, (p, o, i) in kept if ttft > -math.inf]

    def evidence_records(self) -> list[dict[str, Any]]:
        """The slowest requests, slowest first, as pointers: their TTFT and ``location``
        (partition, offset, index). ``pipeline.evidence`` fills in the records themselves."""
        return [
            {"ttft_s": ttft, "location": {"partition": p, "offset": o, "index": i}} for ttft, (p, o, i) in self.evidence
        ]

    # -- wire format ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (string keys only): what stage 1 sends to stage 2."""
        data: dict[str, Any] = {name: getattr(self, name) for name in _INT_SUMS + _FLOAT_SUMS}
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
        """Many partials at once, their histograms and counts rows of shared tables."""
        hist = np.zeros((len(items), N_BUCKETS), dtype=np.int32)
        reasons = np.zeros((len(items), len(REASONS)), dtype=np.int32)
        out = []
        for row, data in enumerate(items):
            stats = cls(key=str(data["key"]), start=float(data["start"]), length=float(data["length"]))
            for name in _INT_SUMS:
                setattr(stats, name, int(data[name]))
            for name in _FLOAT_SUMS:
                setattr(stats, name, float(data[name]))
            stats.evidence_k = int(data["evidence_k"])
            for index, count in data["ttft"].items():
                i = int(index)
                if not 0 <= i < N_BUCKETS or int(count) < 0:
                    raise ValueError(f"bad histogram bucket {index}: {count}")
                hist[row, i] += int(count)
            stats.ttft = LogHistogram(hist[row])
            for reason, count in data["finish_reasons"].items():
                reasons[row, REASONS.index(str(reason))] += int(count)
            stats.reason_counts = reasons[row]
            evidence = data["evidence"]
            stats.evidence_ttft = np.array([float(item[0]) for item in evidence])
            stats.evidence_at = np.array([[int(v) for v in item[1:4]] for item in evidence], dtype=np.int64).reshape(
                -1, 3
            )
            stats.sources = [(int(p), int(a), int(b)) for p, a, b in data["sources"]]
            watermark = data.get("watermark")
            stats.watermark = -math.inf if watermark is None else float(watermark)
            out.append(stats)
        return out
