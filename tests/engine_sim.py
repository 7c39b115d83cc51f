"""A simulated vLLM V1 server's ``/metrics``, step by step: cumulative counters and histograms.

Built from vLLM's documented names, types and default buckets (``tests/test_exposition.py``
holds the single-scrape fixtures). Each ``step`` serves ``requests`` more requests of
~``prompt`` tokens; with prefix caching on, ``hit_rate`` of their prompt tokens come from
the cache and prefill is short; switched off (``caching=False``), no token hits, prefill
takes ten times longer, and ``vllm:cache_config_info`` says ``enable_prefix_caching="False"``.
Traffic stays flat either way: the brief's first incident, as the engine reports it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

from tests.test_exposition import TTFT_BUCKETS, counter, gauge

#: vLLM's request-phase buckets (queue, prefill, decode, e2e; its first ones) and ITL buckets.
PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)


@dataclass
class CumulativeHistogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)
        for i, le in enumerate((*self.buckets, math.inf)):
            if value <= le:
                self.counts[i] += 1
        self.total += value
        self.n += 1

    def text(self, name: str, labels: str) -> str:
        counts = self.counts or [0] * (len(self.buckets) + 1)
        lines = [f"# HELP {name} simulated", f"# TYPE {name} histogram"]
        for le, count in zip((*self.buckets, math.inf), counts, strict=True):
            le_text = "+Inf" if math.isinf(le) else repr(le)
            lines.append(f'{name}_bucket{{le="{le_text}",{labels}}} {float(count)}')
        lines.append(f"{name}_sum{{{labels}}} {self.total}")
        lines.append(f"{name}_count{{{labels}}} {float(self.n)}")
        return "\n".join(lines)


@dataclass
class SimulatedVllm:
    model: str = "llama-3.1-70b"
    prompt: float = 2000.0
    hit_rate: float = 0.9
    seed: int = 5
    caching: bool = True
    prompt_tokens: float = 0.0
    queries: float = 0.0
    hits: float = 0.0
    finished: float = 0.0
    histograms: dict[str, CumulativeHistogram] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.histograms = {
            "vllm:time_to_first_token_seconds": CumulativeHistogram(TTFT_BUCKETS),
            "vllm:request_queue_time_seconds": CumulativeHistogram(PHASE_BUCKETS),
            "vllm:request_prefill_time_seconds": CumulativeHistogram(PHASE_BUCKETS),
            "vllm:inter_token_latency_seconds": CumulativeHistogram(ITL_BUCKETS),
        }

    def step(self, requests: int = 100) -> None:
        """``requests`` more requests finish."""
        for _ in range(requests):
            prompt = self.prompt * self.rng.uniform(0.8, 1.2)
            cached = prompt * self.hit_rate if self.caching else 0.0
            queue = 0.02 * self.rng.lognormvariate(0, 0.3)
            prefill = (prompt - cached) * 1.2e-4 * self.rng.lognormvariate(0, 0.2)
            self.histograms["vllm:request_queue_time_seconds"].observe(queue)
            self.histograms["vllm:request_prefill_time_seconds"].observe(prefill)
            self.histograms["vllm:time_to_first_token_seconds"].observe(queue + prefill)
            self.histograms["vllm:inter_token_latency_seconds"].observe(0.02 * self.rng.lognormvariate(0, 0.1))
            self.prompt_tokens += prompt
            self.queries += prompt
            self.hits += cached
            self.finished += 1

    def text(self) -> str:
        labels = f'engine="0",model_name="{self.model}"'
        caching = "True" if self.caching else "False"
        return "\n".join([
            *(histogram.text(name, labels) for name, histogram in self.histograms.items()),
            counter("vllm:prompt_tokens", labels, self.prompt_tokens),
            counter("vllm:generation_tokens", labels, self.finished * 300),
            counter("vllm:prefix_cache_queries", labels, self.queries),
            counter("vllm:prefix_cache_hits", labels, self.hits),
            counter("vllm:num_preemptions", labels, 0.0),
            gauge("vllm:kv_cache_usage_perc", labels, 0.3 * self.rng.uniform(0.95, 1.05)),
            gauge("vllm:num_requests_running", labels, 12.0 * self.rng.uniform(0.9, 1.1)),
            gauge("vllm:num_requests_waiting", labels, float(self.rng.randint(0, 1))),
            "# TYPE vllm:request_success counter",
            f'vllm:request_success_total{{finished_reason="stop",{labels}}} {self.finished}',
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="16",enable_prefix_caching="{caching}",engine="0"}} 1.0',
        ]) + "\n"  # fmt: skip


class ExpositionHandler(BaseHTTPRequestHandler):
    """A loopback ``/metrics``: serves ``text()`` (a subclass's) on every GET, as an engine does."""

    def text(self) -> str:
        raise NotImplementedError

    def do_GET(self) -> None:
        data = self.text().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass
