"""The signals servewatch judges: what an incident is of."""

from __future__ import annotations

from enum import StrEnum


class Signal(StrEnum):
    TTFT = "ttft"
    ITL = "itl"
    THROUGHPUT = "throughput"
    QUEUE_TIME = "queue_time"
    PREFILL_TIME = "prefill_time"
    PREFILL_PER_TOKEN = "prefill_per_token"
    E2E = "e2e"
    LENGTH_TRUNCATION = "length_truncation"
    REASONING_LEAK = "reasoning_leak"
    EMPTY_RESPONSE = "empty_response"
    ERROR_RATE = "error_rate"
    CACHE_HIT_RATE = "cache_hit_rate"
    KV_CACHE_USAGE = "kv_cache_usage"
    PREEMPTIONS = "preemptions"
    WAITING_REQUESTS = "waiting_requests"
    TRAFFIC = "traffic"  # requests per window of a whole model (a drop pages ``traffic_drop``)
