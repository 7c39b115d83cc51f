"""vLLM and SGLang ``/metrics`` text -> one canonical set of figures per (instance, model).

``parse`` reads one scrape with ``prometheus-client``'s text parser and keeps what the
detectors need under canonical names, whatever the engine or its release calls them
(``vllm:time_per_output_token_seconds`` before 0.11, ``vllm:gpu_cache_usage_perc`` before
0.9, SGLang's ``sglang:num_queue_reqs``...). ``interval`` turns two scrapes of the same
instance into ``EngineInterval``s: counters and histogram buckets are cumulative, so every
rate, hit rate and latency quantile comes from their *change*; a counter that went down
means the server restarted, and the later scrape is then the change.

Label order is not relied on, series of one model on several engines (data-parallel ranks)
are added up, and a series a release does not export is simply absent from the result.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from servewatch.schemas.engine_interval import EngineInterval, LatencySummary

#: Histograms: scraped family name -> (canonical name, preference; 0 wins over 1 when a
#: release exports an old and a new name side by side).
HISTOGRAMS: dict[str, tuple[str, int]] = {
    "vllm:time_to_first_token_seconds": ("ttft", 0),
    "sglang:time_to_first_token_seconds": ("ttft", 0),
    "vllm:inter_token_latency_seconds": ("itl", 0),
    "vllm:time_per_output_token_seconds": ("itl", 1),
    "sglang:inter_token_latency_seconds": ("itl", 0),
    "sglang:time_per_output_token_seconds": ("itl", 1),
    "vllm:e2e_request_latency_seconds": ("e2e", 0),
    "sglang:e2e_request_latency_seconds": ("e2e", 0),
    "vllm:request_queue_time_seconds": ("queue_time", 0),
    "sglang:queue_time_seconds": ("queue_time", 0),
    "vllm:request_prefill_time_seconds": ("prefill_time", 0),
    "vllm:request_decode_time_seconds": ("decode_time", 0),
}
#: Histograms of a size per finished request (not a latency): only their mean is kept. vLLM
#: observes them when a request finishes, as it does the latency histograms, so they describe
#: the same requests (the prompt_tokens counter counts a prompt at its first token instead).
SIZES: dict[str, tuple[str, int]] = {
    "vllm:request_prompt_tokens": ("prompt_length", 0),
    "sglang:prompt_tokens_histogram": ("prompt_length", 0),
    "vllm:request_prefill_kv_computed_tokens": ("uncached_prompt_length", 0),
    "sglang:uncached_prompt_tokens_histogram": ("uncached_prompt_length", 0),
}
#: Counters, by family name without ``_total``.
COUNTERS: dict[str, tuple[str, int]] = {
    "vllm:prompt_tokens": ("prompt_tokens", 0),
    "sglang:prompt_tokens": ("prompt_tokens", 0),
    "vllm:generation_tokens": ("generation_tokens", 0),
    "sglang:generation_tokens": ("generation_tokens", 0),
    "vllm:prefix_cache_queries": ("cache_queries", 0),
    "vllm:gpu_prefix_cache_queries": ("cache_queries", 1),
    "vllm:prefix_cache_hits": ("cache_hits", 0),
    "vllm:gpu_prefix_cache_hits": ("cache_hits", 1),
    "sglang:cached_tokens": ("cached_tokens", 0),
    "vllm:num_preemptions": ("preemptions", 0),
    "sglang:num_retracted_requests": ("preemptions", 0),
}
GAUGES: dict[str, tuple[str, int]] = {
    "vllm:kv_cache_usage_perc": ("kv_cache_usage", 0),
    "vllm:gpu_cache_usage_perc": ("kv_cache_usage", 1),
    "sglang:token_usage": ("kv_cache_usage", 0),
    "vllm:num_requests_running": ("running", 0),
    "sglang:num_running_reqs": ("running", 0),
    "vllm:num_requests_waiting": ("waiting", 0),
    "sglang:num_queue_reqs": ("waiting", 0),
}
#: Finished requests by reason (vLLM); SGLang only counts aborts.
FINISHED = "vllm:request_success"
SGLANG_ABORTS = "sglang:num_aborted_requests"
CACHE_CONFIG = "vllm:cache_config_info"
#: Labels that tell one engine (data-parallel rank) of a model from another: added up.
#: Other labels (tensor/pipeline ranks) repeat one engine's figures: the largest is kept.
ENGINE_LABELS = ("engine", "dp_rank")
QUANTILES = (("p50_s", 0.5), ("p90_s", 0.9), ("p99_s", 0.99))
_TABLES = {"histogram": HISTOGRAMS, "size": SIZES, "counter": COUNTERS, "gauge": GAUGES}


@dataclass
class Histogram:
    """Cumulative bucket counts by upper bound (``inf`` included), with ``_sum`` and ``_count``."""

    buckets: dict[float, float] = field(default_factory=dict)
    total: float = 0.0
    count: float = 0.0

    def add(self, sample: Sample) -> None:
        """One ``_bucket``, ``_sum`` or ``_count`` sample of the family (engines add up)."""
        if sample.name.endswith("_bucket"):
            le = float(sample.labels["le"])  # '+Inf' parses as inf
            self.buckets[le] = self.buckets.get(le, 0.0) + sample.value
        elif sample.name.endswith("_sum"):
            self.total += sample.value
        elif sample.name.endswith("_count"):
            self.count += sample.value

    def minus(self, earlier: Histogram) -> tuple[Histogram, bool]:
        """The change since ``earlier``; (self, True) when a count went down (a restart)."""
        delta = Histogram(
            {le: n - earlier.buckets.get(le, 0.0) for le, n in self.buckets.items()},
            self.total - earlier.total,
            self.count - earlier.count,
        )
        if delta.count < 0 or any(n < 0 for n in delta.buckets.values()):
            return self, True
        return delta, False

    def quantile(self, q: float) -> float | None:
        """``histogram_quantile``: linear within the bucket holding rank ``q``; None when empty."""
        bounds = sorted(self.buckets)
        total = self.buckets.get(math.inf, self.count)
        if total <= 0 or not bounds:
            return None
        rank, lower, below = q * total, 0.0, 0.0
        for upper in bounds:
            cumulative = self.buckets[upper]
            if cumulative >= rank:
                if math.isinf(upper):
                    return lower  # the open top bucket: its lower bound is all that is known
                inside = cumulative - below
                return lower + (upper - lower) * ((rank - below) / inside if inside > 0 else 1.0)
            lower, below = upper, cumulative
        return lower

    @property
    def mean(self) -> float | None:
        """``_sum`` over ``_count``; None when empty."""
        return self.total / self.count if self.count > 0 else None

    def summary(self) -> LatencySummary:
        quantiles = {name: self.quantile(q) for name, q in QUANTILES}
        return LatencySummary(count=self.count, mean_s=self.mean, **quantiles)


@dataclass
class ModelFigures:
    """One model's series in one scrape, under canonical names."""

    engine: str
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    sizes: dict[str, Histogram] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)


@dataclass
class Snapshot:
    """One scrape of one instance."""

    instance: str
    timestamp: float
    models: dict[str, ModelFigures] = field(default_factory=dict)
    cache_config: dict[str, str] = field(default_factory=dict)


def parse(text: str, instance: str, timestamp: float) -> Snapshot:
    """Read one exposition; raises ``ValueError`` on text the parser cannot read."""
    return read_families(text_string_to_metric_families(text), instance, timestamp)


def read_families(families: Iterable[Metric], instance: str, timestamp: float) -> Snapshot:
    """One scrape's metric families, as ``prometheus-client`` parses them (or as a collector
    holds them before rendering: the simulated engines' families skip the text round trip,
    which gives back the same names, labels and values)."""
    snapshot = Snapshot(instance, timestamp)
    chosen: dict[tuple[str, str], int] = {}  # (model, canonical) -> preference it came from
    gauge_parts: dict[tuple[str, str], dict[tuple[str, ...], float]] = {}
    for family in families:
        name = family.name.removesuffix("_total") if family.type in ("counter", "unknown") else family.name
        if name == CACHE_CONFIG:
            for sample in family.samples[:1]:
                snapshot.cache_config = {k: v for k, v in sample.labels.items() if k not in ENGINE_LABELS}
            continue
        kind = next((kind for kind, table in _TABLES.items() if name in table), "")
        if not kind and name not in (FINISHED, SGLANG_ABORTS):
            continue
        engine = name.split(":", 1)[0]
        for sample in family.samples:
            model = sample.labels.get("model_name") or "unknown"
            figures = snapshot.models.setdefault(model, ModelFigures(engine))
            if name == FINISHED:
                reason = sample.labels.get("finished_reason", "other")
                figures.finished[reason] = figures.finished.get(reason, 0.0) + sample.value
                continue
            if name == SGLANG_ABORTS:
                figures.finished["abort"] = figures.finished.get("abort", 0.0) + sample.value
                continue
            canonical, preference = _TABLES[kind][name]
            histograms = figures.sizes if kind == "size" else figures.histograms
            held = chosen.setdefault((model, canonical), preference)
            if preference > held:
                continue  # an older name of what a newer one already gave
            if preference < held:  # a newer name after an older one: start over
                chosen[(model, canonical)] = preference
                histograms.pop(canonical, None)
                figures.counters.pop(canonical, None)
                gauge_parts.pop((model, canonical), None)
            if kind in ("histogram", "size"):
                histograms.setdefault(canonical, Histogram()).add(sample)
            elif kind == "counter":
                figures.counters[canonical] = figures.counters.get(canonical, 0.0) + sample.value
            else:
                engine_key = tuple(sample.labels.get(label, "") for label in ENGINE_LABELS)
                parts = gauge_parts.setdefault((model, canonical), {})
                parts[engine_key] = max(parts.get(engine_key, -math.inf), sample.value)
    for (model, canonical), parts in gauge_parts.items():
        # KV usage: the fullest engine is the one that preempts; queues add up over engines.
        values = parts.values()
        snapshot.models[model].gauges[canonical] = max(values) if canonical == "kv_cache_usage" else sum(values)
    return snapshot


def interval(earlier: Snapshot, later: Snapshot) -> list[EngineInterval]:
    """Per model seen in both scrapes, what changed between them (empty if time did not move on)."""
    if later.timestamp <= earlier.timestamp:
        return []
    return [
        _model_interval(earlier, later, model, before, now)
        for model, now in sorted(later.models.items())
        if (before := earlier.models.get(model)) is not None
    ]


def _histogram_deltas(now: dict[str, Histogram], before: dict[str, Histogram]) -> tuple[dict[str, Histogram], bool]:
    """Each histogram's change; True when one restarted (``Histogram.minus``)."""
    out, reset = {}, False
    for name, histogram in now.items():
        out[name], restarted = histogram.minus(before.get(name, Histogram()))
        reset |= restarted
    return out, reset


def _deltas(now: dict[str, float], before: dict[str, float]) -> tuple[dict[str, float], bool]:
    """Counter changes; a counter that went down restarted, and counts from zero."""
    out, reset = {}, False
    for name, value in now.items():
        delta = value - before.get(name, 0.0)
        if delta < 0:
            delta, reset = value, True
        out[name] = delta
    return out, reset


def _model_interval(
    earlier: Snapshot, later: Snapshot, model: str, before: ModelFigures, now: ModelFigures
) -> EngineInterval:
    seconds = later.timestamp - earlier.timestamp
    counters, counters_reset = _deltas(now.counters, before.counters)
    finished, finished_reset = _deltas(now.finished, before.finished)
    latencies, latency_reset = _histogram_deltas(now.histograms, before.histograms)
    sizes, sizes_reset = _histogram_deltas(now.sizes, before.sizes)
    histograms_reset = latency_reset or sizes_reset
    latency = {name: change.summary() for name, change in latencies.items()}
    per_s = {name: value / seconds for name, value in counters.items()}
    return EngineInterval(
        instance=later.instance,
        model=model,
        engine=now.engine,
        start=earlier.timestamp,
        end=later.timestamp,
        counter_reset=counters_reset or finished_reset or histograms_reset,
        latency=latency,
        prompt_tokens_per_s=per_s.get("prompt_tokens"),
        generation_tokens_per_s=per_s.get("generation_tokens"),
        prefix_cache_hit_rate=_hit_rate(counters),
        kv_cache_usage=now.gauges.get("kv_cache_usage"),
        running=now.gauges.get("running"),
        waiting=now.gauges.get("waiting"),
        preemptions_per_s=per_s.get("preemptions"),
        finished=finished,
        finished_prompt_tokens=sizes.get("prompt_length", Histogram()).mean,
        finished_uncached_prompt_tokens=sizes.get("uncached_prompt_length", Histogram()).mean,
        cache_config=later.cache_config,
    )


def _hit_rate(counters: dict[str, float]) -> float | None:
    """Cached over looked-up prompt tokens; None when nothing was looked up."""
    if "cache_queries" in counters:
        hits, looked_up = counters.get("cache_hits", 0.0), counters["cache_queries"]
    elif "cached_tokens" in counters and "prompt_tokens" in counters:
        hits, looked_up = counters["cached_tokens"], counters["prompt_tokens"]  # SGLang
    else:
        return None
    return min(hits / looked_up, 1.0) if looked_up > 0 else None
