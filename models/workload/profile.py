"""A model's real request mix from its request logs: what ``servewatch profile`` writes.

A load test is only as telling as its traffic. Average lengths at a fixed rate miss what
makes serving hard: long prompts arriving in bursts, answers whose length goes with the
prompt's, and prefixes that the server's cache serves for free. So the profile keeps the
joint prompt/output distribution (a 2-D histogram on log-spaced bins, from which
``models.workload.sample`` draws), the daily arrival shape and burstiness *within* hours,
how many requests share a prefix and how long the shared part is, and the finish reasons.

Arrival times are ``timestamp - e2e_s`` (logs stamp the finish). Pure numpy, no I/O.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servewatch.schemas.request_log import RequestLog
from servewatch.schemas.workload_profile import (
    Arrivals,
    LengthHistogram,
    PrefixSharing,
    Quantiles,
    SharedPrefix,
    WorkloadProfile,
)

Record = Mapping[str, Any] | RequestLog

#: Bins per doubling of a token count: neighbouring edges ~19 % apart.
BINS_PER_DOUBLING = 4
#: Shared prefixes listed one by one; the rest are summed up.
TOP_PREFIXES = 64
#: Burstiness needs this many gaps, or windows, to be worth stating.
_MIN_SAMPLES = 10


def log_edges(low: int, high: int, per_doubling: int = BINS_PER_DOUBLING) -> list[int]:
    """Integer bin edges ``round(2 ** (k / per_doubling))`` from the bin holding ``low`` to the
    one holding ``high``: the same grid for every profile, so two profiles' bins line up.

    >>> log_edges(1, 10)
    [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]
    >>> log_edges(300, 500)
    [256, 304, 362, 431, 512]
    """
    top = math.ceil(per_doubling * math.log2(max(high, 1) + 1)) + 2
    grid = np.unique(np.round(2.0 ** (np.arange(top + 1) / per_doubling)).astype(np.int64))
    start = int(np.searchsorted(grid, max(low, 1), side="right")) - 1
    stop = int(np.searchsorted(grid, high, side="right"))
    return [int(edge) for edge in grid[start : stop + 1]]


def quantiles(values: np.ndarray) -> Quantiles | None:
    if len(values) == 0:
        return None
    p10, p50, p90, p99 = (float(q) for q in np.quantile(values, (0.1, 0.5, 0.9, 0.99)))
    return Quantiles(p10=p10, p50=p50, p90=p90, p99=p99, mean=float(np.mean(values)))


def _within_hours(starts: np.ndarray) -> np.ndarray:
    """Index of each clock hour (not hour of day) that ``starts`` fall in, from 0."""
    return np.unique(np.floor(starts / 3600.0), return_inverse=True)[1].ravel()


def _dispersion(t: np.ndarray, width: float) -> float | None:
    """Variance / mean of arrival counts per ``width`` seconds, each bin against its clock
    hour's mean (pooled within hours, so a daily swing is not counted as burstiness)."""
    bins = int((t[-1] - t[0]) // width)
    if bins < _MIN_SAMPLES:
        return None
    index = ((t - t[0]) // width).astype(np.int64)
    counts = np.bincount(index[index < bins], minlength=bins).astype(np.float64)
    hour = _within_hours(t[0] + width * np.arange(bins))
    means = np.bincount(hour, weights=counts) / np.bincount(hour)
    dof, mean = bins - int(hour.max()) - 1, counts.mean()
    if dof < 1 or mean <= 0:
        return None
    return float(np.sum((counts - means[hour]) ** 2) / dof / mean)


def arrival_stats(arrivals: np.ndarray) -> Arrivals:
    """Rates by hour of day (UTC) and burstiness of sorted-or-not arrival times (unix s)."""
    t = np.sort(np.asarray(arrivals, dtype=np.float64))
    first, last = float(t[0]), float(t[-1])
    hours = np.arange(math.floor(first / 3600), math.floor(last / 3600) + 1)
    overlap = np.minimum(last, (hours + 1) * 3600.0) - np.maximum(first, hours * 3600.0)
    seconds = np.bincount(hours % 24, weights=np.clip(overlap, 0.0, None), minlength=24)
    counts = np.bincount(np.floor(t / 3600.0).astype(np.int64) % 24, minlength=24)
    cv = None
    gaps = np.diff(t)
    if len(gaps) >= _MIN_SAMPLES:
        hour = _within_hours(t[1:])
        scaled = gaps / (np.bincount(hour, weights=gaps) / np.bincount(hour))[hour]
        cv = float(np.std(scaled) / np.mean(scaled)) if np.all(np.isfinite(scaled)) and np.mean(scaled) > 0 else None
    return Arrivals(
        mean_rate=len(t) / (last - first) if last > first else None,
        hourly_rate=[float(c / s) if s > 0 else None for c, s in zip(counts, seconds, strict=True)],
        hourly_seconds=[round(float(s), 3) for s in seconds],
        interarrival_cv=cv,
        dispersion_1s=_dispersion(t, 1.0),
        dispersion_10s=_dispersion(t, 10.0),
    )


def length_histogram(prompt: np.ndarray, output: np.ndarray, per_doubling: int = BINS_PER_DOUBLING) -> LengthHistogram:
    """The joint histogram of (prompt, output) tokens of successful requests."""
    prompt, output = np.maximum(prompt, 1), np.maximum(output, 1)
    if len(prompt) == 0:
        return LengthHistogram(bins_per_doubling=per_doubling, prompt_edges=[1, 2], output_edges=[1, 2],
                               counts=[[0]], prompt=None, output=None)  # fmt: skip
    p_edges = log_edges(int(prompt.min()), int(prompt.max()), per_doubling)
    o_edges = log_edges(int(output.min()), int(output.max()), per_doubling)
    counts, _, _ = np.histogram2d(prompt, output, bins=(np.array(p_edges), np.array(o_edges)))
    return LengthHistogram(
        bins_per_doubling=per_doubling, prompt_edges=p_edges, output_edges=o_edges,
        counts=counts.astype(np.int64).tolist(), prompt=quantiles(prompt), output=quantiles(output),
    )  # fmt: skip


def _shared_length(cached: list[int], prompts: list[int]) -> SharedPrefix:
    hits = [c for c in cached if c > 0]
    if hits:
        return SharedPrefix(requests=len(prompts), tokens=int(np.median(hits)), estimated_from="cached_tokens")
    return SharedPrefix(requests=len(prompts), tokens=min(prompts), estimated_from="shortest_prompt")


def prefix_sharing(prefixes: list[str | None], cached: np.ndarray, prompt: np.ndarray, top: int) -> PrefixSharing:
    """Which requests share a ``prefix_hash`` with another, and the shared part's length
    (``cached`` is -1 where a record has no ``cached_tokens``)."""
    popularity = Counter(p for p in prefixes if p is not None)
    members: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for i, prefix in enumerate(prefixes):
        if prefix is not None and popularity[prefix] > 1:
            members[prefix][0].append(int(cached[i]))
            members[prefix][1].append(int(prompt[i]))
    ranked = sorted(members, key=lambda p: (-popularity[p], p))
    shared = [_shared_length(*members[p]) for p in ranked]
    rest = shared[top:]
    n = len(prefixes)
    return PrefixSharing(
        hashed_share=sum(popularity.values()) / n,
        shared_share=sum(s.requests for s in shared) / n,
        distinct_shared=len(shared),
        top=shared[:top],
        other_prefixes=len(rest),
        other_requests=sum(s.requests for s in rest),
        other_tokens=int(np.median([s.tokens for s in rest])) if rest else 0,
    )


def _get(record: Record, name: str) -> Any:
    return getattr(record, name, None) if isinstance(record, RequestLog) else record.get(name)


@dataclass
class _Columns:
    """One model's requests, column by column (compact: a day of a busy model is millions)."""

    arrival: array[float] = field(default_factory=lambda: array("d"))
    prompt: array[int] = field(default_factory=lambda: array("q"))
    output: array[int] = field(default_factory=lambda: array("q"))
    cached: array[int] = field(default_factory=lambda: array("q"))
    failed: array[int] = field(default_factory=lambda: array("b"))
    prefix: list[str | None] = field(default_factory=list)
    finish: Counter[str] = field(default_factory=Counter)
    routes: Counter[str] = field(default_factory=Counter)


class WorkloadProfiler:
    """Builds a ``WorkloadProfile`` per model from request logs (``RequestLog`` or its dict).

    Examples
    --------
    >>> import random
    >>> rng = random.Random(3)
    >>> profiler, t = WorkloadProfiler(), 1_767_225_600.0
    >>> for i in range(4000):
    ...     t += rng.expovariate(2.0)                      # Poisson arrivals at 2 requests/s
    ...     profiler.learn_one({"model": "m", "timestamp": t + 1.5, "e2e_s": 1.5, "finish_reason":
    ...         "length" if i % 4 == 0 else "stop", "prompt_tokens": rng.choice([100, 1000]),
    ...         "completion_tokens": 50, "prefix_hash": "system-v1" if i % 2 else None, "cached_tokens": 64})
    >>> profile = profiler.profile("m")
    >>> round(profile.arrivals.mean_rate, 1), round(profile.arrivals.interarrival_cv, 1)
    (2.0, 1.0)
    >>> profile.prefixes.shared_share, profile.prefixes.top[0].tokens, profile.finish_reasons
    (0.5, 64, {'length': 0.25, 'stop': 0.75})
    >>> profile.lengths.prompt.p10, profile.lengths.prompt.p90, sum(map(sum, profile.lengths.counts))
    (100.0, 1000.0, 4000)
    """

    def __init__(self, bins_per_doubling: int = BINS_PER_DOUBLING, top_prefixes: int = TOP_PREFIXES) -> None:
        self.bins_per_doubling = bins_per_doubling
        self.top_prefixes = top_prefixes
        self._models: dict[str, _Columns] = defaultdict(_Columns)

    def learn_one(self, record: Record) -> None:
        columns = self._models[str(_get(record, "model"))]
        e2e, status, cached = _get(record, "e2e_s"), _get(record, "status_code"), _get(record, "cached_tokens")
        finish = str(_get(record, "finish_reason"))
        columns.arrival.append(float(_get(record, "timestamp")) - float(e2e or 0.0))
        columns.prompt.append(int(_get(record, "prompt_tokens")))
        columns.output.append(int(_get(record, "completion_tokens")))
        columns.cached.append(-1 if cached is None else int(cached))
        columns.failed.append(finish in ("error", "abort") or (status is not None and int(status) >= 500))
        columns.prefix.append(_get(record, "prefix_hash"))
        columns.finish[finish] += 1
        if (route := _get(record, "route")) is not None:
            columns.routes[str(route)] += 1

    def learn_many(self, records: Iterable[Record]) -> WorkloadProfiler:
        for record in records:
            self.learn_one(record)
        return self

    @property
    def models(self) -> list[str]:
        return sorted(self._models)

    def profile(self, model: str) -> WorkloadProfile:
        """``model``'s profile; ``KeyError`` if no request of it was seen."""
        if model not in self._models:
            raise KeyError(model)
        c = self._models[model]
        arrival = np.array(c.arrival, dtype=np.float64)
        prompt, output = np.array(c.prompt, dtype=np.int64), np.array(c.output, dtype=np.int64)
        ok = np.array(c.failed, dtype=bool) == 0
        n, routed = len(arrival), sum(c.routes.values())
        return WorkloadProfile(
            model=model,
            requests=n,
            first=float(arrival.min()),
            last=float(arrival.max()),
            arrivals=arrival_stats(arrival),
            lengths=length_histogram(prompt[ok], output[ok], self.bins_per_doubling),
            prefixes=prefix_sharing(c.prefix, np.array(c.cached, dtype=np.int64), prompt, self.top_prefixes),
            finish_reasons={reason: count / n for reason, count in sorted(c.finish.items())},
            routes={route: count / routed for route, count in sorted(c.routes.items())},
        )

    def profiles(self) -> dict[str, WorkloadProfile]:
        return {model: self.profile(model) for model in self.models}
