"""One engine's ``/metrics`` between two scrapes, as a window the segment detectors judge.

Request logs say how each request went; an engine's metrics say how close it is to its
limits: how full its KV cache is, how many requests wait for a slot, how many it had to
preempt. ``EngineWindow`` carries those figures for one (instance, model) interval
(``schemas.EngineInterval``) with the same surface as ``WindowStats`` where the detectors
read it (``start``/``end``/``length``, ``labels``, ``requests``, ``load()``), so the
capacity signals get the load conditioning, lifecycle, state and wording of every other
signal. Its load is the interval's finished requests and tokens per second: an engine
that fills its KV cache because it serves more is explained by load; one that fills it
at the same load (longer contexts piling up, a lower memory budget after a restart) is not.

>>> from schemas.engine_interval import EngineInterval, LatencySummary
>>> interval = EngineInterval(instance="gpu-1:8000", model="qwen", engine="vllm", start=0.0, end=10.0,
...     prompt_tokens_per_s=20_000.0, generation_tokens_per_s=3_000.0, kv_cache_usage=0.62,
...     running=24.0, waiting=0.0, preemptions_per_s=0.2, finished={"stop": 95.0, "length": 5.0})
>>> window = EngineWindow.from_interval(interval)
>>> window.key, window.requests, window.preempted, window.preemption_trials
('gpu-1:8000|qwen', 100.0, 2, 102)
>>> round(window.load()["model_requests_per_s"], 1)
10.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from servewatch.schemas.engine_interval import EngineInterval, LatencySummary


def engine_key(instance: str, model: str) -> str:
    """The detectors' key of one engine: the same bytes the scraper keys its messages with,
    so an engine's intervals and its stored state share a partition."""
    return f"{instance}|{model}"


@dataclass(frozen=True, slots=True)
class EngineWindow:
    key: str
    labels: dict[str, str]
    start: float
    end: float
    requests: float  # finished in the interval
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    running: float
    waiting: float | None
    kv_cache_usage: float | None
    cache_hit_rate: float  # NaN when the engine reports no prefix-cache counters
    preempted: int  # preemptions in the interval
    prefix_caching: str | None = None  # the engine's enable_prefix_caching (cache_config_info), as it says it
    # Latency histograms over the interval by canonical name (ttft, itl, queue_time,
    # prefill_time, ...): what the engine's own metrics say of its phases, from bucket deltas.
    latency: dict[str, LatencySummary] = field(default_factory=dict)

    @classmethod
    def from_interval(cls, interval: EngineInterval) -> EngineWindow | None:
        """None for an interval that says nothing about capacity (no length, or a server
        restart inside it: its deltas start from zero and its gauges from an empty engine)."""
        length = interval.end - interval.start
        if length <= 0 or interval.counter_reset:
            return None
        return cls(
            key=engine_key(interval.instance, interval.model),
            labels={"model": interval.model, "instance": interval.instance, "engine": interval.engine},
            start=interval.start,
            end=interval.end,
            requests=float(sum(interval.finished.values())),
            prompt_tokens_per_s=interval.prompt_tokens_per_s or 0.0,
            output_tokens_per_s=interval.generation_tokens_per_s or 0.0,
            running=interval.running or 0.0,
            waiting=interval.waiting,
            kv_cache_usage=interval.kv_cache_usage,
            cache_hit_rate=math.nan if interval.prefix_cache_hit_rate is None else interval.prefix_cache_hit_rate,
            preempted=round((interval.preemptions_per_s or 0.0) * length),
            prefix_caching=interval.cache_config.get("enable_prefix_caching"),
            latency=interval.latency,
        )

    @property
    def length(self) -> float:
        return self.end - self.start

    @property
    def preemption_trials(self) -> int:
        """Requests that could have been preempted: those finished plus those preempted."""
        return round(self.requests) + self.preempted

    # Metrics do not say which requests reuse a prefix (request logs' ``prefix_hash`` do).
    prefix_shared = 0
    prefix_reported = 0

    def load(self) -> dict[str, float]:
        """Requests and tokens per second, and concurrency (running requests); the engine is
        its own model-level load (``model_*``), as a window built on its own is."""
        requests_per_s = self.requests / self.length
        return {
            "requests": self.requests,
            "requests_per_s": requests_per_s,
            "prompt_tokens_per_s": self.prompt_tokens_per_s,
            "uncached_prompt_tokens_per_s": math.nan,  # scrapes give hit rates, not per-request tokens
            "output_tokens_per_s": self.output_tokens_per_s,
            "concurrency": self.running,
            "cache_hit_rate": self.cache_hit_rate,
            "model_requests_per_s": requests_per_s,
            "model_prompt_tokens_per_s": self.prompt_tokens_per_s,
            "model_output_tokens_per_s": self.output_tokens_per_s,
        }

    def evidence_records(self) -> list[Any]:
        """Metrics carry no requests: the evidence of a capacity event is its figures."""
        return []
