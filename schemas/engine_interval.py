"""``EngineInterval``: what one serving instance's ``/metrics`` said about one model between two scrapes.

vLLM and SGLang name their metrics differently and change names between releases; an
``EngineInterval`` is the same figures under one set of names, computed from the *change*
between two scrapes (counters and histogram buckets are cumulative), so it reads like a
request-log window: how many requests, how fast, how much came from the prefix cache.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from servewatch.schemas.version import SCHEMA_VERSION


class LatencySummary(BaseModel):
    """One latency histogram over the interval, from bucket deltas."""

    model_config = ConfigDict(extra="forbid")

    count: float = Field(description="Observations in the interval.")
    mean_s: float | None = Field(default=None, description="Delta of _sum over delta of _count.")
    p50_s: float | None = None
    p90_s: float | None = None
    p99_s: float | None = Field(
        default=None, description="Interpolated within the bucket, as PromQL's histogram_quantile does."
    )


class EngineInterval(BaseModel):
    """One engine (instance and model) between two scrapes of its /metrics, in canonical figures."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    instance: str = Field(description="host:port of the scraped server.")
    model: str = Field(description="The served model name (label model_name).")
    engine: str = Field(description="'vllm' or 'sglang', from the metric prefix.")
    start: float = Field(description="Unix seconds of the earlier scrape.")
    end: float = Field(description="Unix seconds of the later scrape.")
    counter_reset: bool = Field(
        default=False, description="A counter went down (server restart): deltas start from zero."
    )
    latency: dict[str, LatencySummary] = Field(
        default_factory=dict, description="By canonical name: ttft, itl, e2e, queue_time, prefill_time, decode_time."
    )
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    prefix_cache_hit_rate: float | None = Field(
        default=None,
        description="Cached over looked-up prompt tokens in the interval (vLLM: prefix_cache_hits/queries; "
        "SGLang: cached_tokens/prompt_tokens), never an engine's own hit-rate gauge.",
    )
    kv_cache_usage: float | None = Field(default=None, description="0-1, the largest over the model's engines.")
    running: float | None = None
    waiting: float | None = None
    preemptions_per_s: float | None = None
    finished: dict[str, float] = Field(default_factory=dict, description="Requests finished, by finish reason.")
    finished_prompt_tokens: float | None = Field(
        default=None,
        description="Prompt tokens per request of the requests that finished in the interval (vLLM: "
        "request_prompt_tokens' delta of _sum over delta of _count): the requests the latency histograms "
        "observed, where the prompt_tokens counter counts prompts at their first token.",
    )
    finished_uncached_prompt_tokens: float | None = Field(
        default=None,
        description="Of those, the prompt tokens the prefix cache did not serve, per request (vLLM: "
        "request_prefill_kv_computed_tokens; SGLang: uncached_prompt_tokens_histogram).",
    )
    cache_config: dict[str, str] = Field(
        default_factory=dict, description="Labels of vllm:cache_config_info, e.g. enable_prefix_caching."
    )
