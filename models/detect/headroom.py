"""Spare capacity: requests wait on an engine whose KV cache stays mostly empty while its
prefix cache does most of the prefill work. Memory is not what holds them back: the
engine's concurrency limit (``max_num_seqs``) is, and it can likely go up without more GPUs.

A finding for a platform team rather than a fault, so it is an ``info`` event: it never
pages. It is reported once per stretch of ``windows`` such intervals in a row, and
resolved when the stretch ends, under one fingerprint.

>>> from servewatch.models.windows.engine_window import EngineWindow
>>> def scrape(i, usage):
...     return EngineWindow("gpu-1:8000|qwen", {"model": "qwen", "instance": "gpu-1:8000"}, 10.0 * i,
...                         10.0 * i + 10, 100.0, 20_000.0, 3_000.0, 8.0, 6.0, usage, 0.93, 0)
>>> watch = HeadroomWatch(windows=3)
>>> [watch.observe(scrape(i, 0.2)) is None for i in range(3)]
[True, True, False]
>>> event = watch.observe(scrape(3, 0.9))   # the cache fills up: the stretch ends
>>> event.status.value, event.severity.value, event.hints[0].code
('resolved', 'info', 'capacity_headroom')
"""

from __future__ import annotations

from dataclasses import dataclass, field

from servewatch.models.detect.events import incident_event
from servewatch.models.detect.lifecycle import Transition
from servewatch.models.windows.engine_window import EngineWindow
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status


@dataclass
class _Stretch:
    start: float
    intervals: int = 0
    reported: bool = False


@dataclass
class HeadroomWatch:
    """Per engine, the current stretch of intervals with spare capacity.

    min_hit_rate
        Share of prompt tokens the prefix cache must serve.
    max_kv_usage
        KV-cache usage at or below which the cache counts as mostly empty.
    min_waiting
        Requests waiting for a slot, at least.
    windows
        Intervals in a row before it is reported (6 scrapes of 10 s: a minute).
    """

    min_hit_rate: float = 0.8
    max_kv_usage: float = 0.5
    min_waiting: float = 1.0
    windows: int = 6
    stretches: dict[str, _Stretch] = field(default_factory=dict)

    def spare(self, window: EngineWindow) -> bool:
        usage, hit = window.kv_cache_usage, window.cache_hit_rate
        return (
            window.requests > 0
            and usage is not None
            and usage <= self.max_kv_usage
            and hit >= self.min_hit_rate  # False for NaN: no cache counters, no claim
            and (window.waiting or 0.0) >= self.min_waiting
            and window.preempted == 0
        )

    def observe(self, window: EngineWindow) -> AnomalyEvent | None:
        stretch = self.stretches.get(window.key)
        if not self.spare(window):
            if stretch is None:
                return None
            del self.stretches[window.key]
            return self._event(window, stretch, Status.RESOLVED) if stretch.reported else None
        if stretch is None:
            stretch = self.stretches[window.key] = _Stretch(window.start)
        stretch.intervals += 1
        if stretch.reported or stretch.intervals < self.windows:
            return None
        stretch.reported = True
        return self._event(window, stretch, Status.FIRING)

    def _event(self, window: EngineWindow, stretch: _Stretch, status: Status) -> AnomalyEvent:
        usage = window.kv_cache_usage if window.kv_cache_usage is not None else 0.0
        engine = f"model {window.labels.get('model', 'other')} on {window.labels.get('instance', '?')}"
        if status is Status.FIRING:
            message = (
                f"{window.waiting:,.0f} requests wait while the KV cache is {usage:.0%} full and the prefix cache "
                f"serves {window.cache_hit_rate:.0%} of prompt tokens, for {stretch.intervals} scrapes in a row: "
                "the concurrency limit (max_num_seqs), not memory, holds them back; it can likely go up"
            )
            summary = f"Spare capacity: {engine}; {message}."
        else:
            message = f"the KV cache is {usage:.0%} full, or nothing waits: the spare capacity is used or not needed"
            summary = f"Spare capacity used: {engine}; {message}."
        load = {k: round(v, 4) for k, v in window.load().items() if v == v}  # NaN: not measured
        return incident_event(
            key=window.key,
            signal=Signal.KV_CACHE_USAGE,
            incident_start=stretch.start,
            transition=Transition.FIRING if status is Status.FIRING else Transition.RESOLVED,
            labels=window.labels,
            window=(window.start, window.end),
            observed=usage,
            expected=self.max_kv_usage,
            score=0.0,
            severity=Severity.INFO,
            load=load,
            hints=[Hint(code="capacity_headroom", message=message)],
            incident_name="capacity_headroom",
            id_tag=status.value,
            summary=summary,
        )
