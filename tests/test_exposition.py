"""Engine /metrics text -> canonical per-model intervals (vLLM V1, vLLM before V1 renames, SGLang)."""

from __future__ import annotations

import math

import pytest

from servewatch.pipeline.ingest.scrape.exposition import Histogram, interval, parse

# vLLM's default TTFT buckets (first few) and request-latency buckets, as the engine exports them.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


def histogram(name: str, labels: str, values: list[float], buckets: tuple[float, ...]) -> str:
    """Exposition lines of a histogram holding ``values`` (labels in an order the engines use)."""
    lines = [f"# HELP {name} test", f"# TYPE {name} histogram"]
    for le in (*buckets, math.inf):
        count = sum(v <= le for v in values)
        le_text = "+Inf" if math.isinf(le) else repr(le)
        lines.append(f'{name}_bucket{{le="{le_text}",{labels}}} {float(count)}')
    lines.append(f"{name}_sum{{{labels}}} {float(sum(values))}")
    lines.append(f"{name}_count{{{labels}}} {float(len(values))}")
    return "\n".join(lines)


def counter(name: str, labels: str, value: float) -> str:
    return f"# TYPE {name} counter\n{name}_total{{{labels}}} {value}"


def gauge(name: str, labels: str, value: float) -> str:
    return f"# TYPE {name} gauge\n{name}{{{labels}}} {value}"


def vllm_v1(ttft: list[float], prompt: float, hits: float, queries: float, stops: float, engine: str = "0") -> str:
    labels = f'engine="{engine}",model_name="llama"'
    return "\n".join([
        histogram("vllm:time_to_first_token_seconds", labels, ttft, TTFT_BUCKETS),
        counter("vllm:prompt_tokens", labels, prompt),
        counter("vllm:generation_tokens", labels, prompt / 10),
        counter("vllm:prefix_cache_queries", labels, queries),
        counter("vllm:prefix_cache_hits", labels, hits),
        counter("vllm:num_preemptions", labels, 4.0),
        gauge("vllm:kv_cache_usage_perc", labels, 0.25),
        gauge("vllm:num_requests_running", labels, 12.0),
        gauge("vllm:num_requests_waiting", labels, 3.0),
        "# TYPE vllm:request_success counter",
        f'vllm:request_success_total{{finished_reason="stop",{labels}}} {stops}',
        f'vllm:request_success_total{{finished_reason="length",{labels}}} 2.0',
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="16",enable_prefix_caching="False",engine="{engine}"}} 1.0',
    ]) + "\n"  # fmt: skip


def test_vllm_v1_interval_from_deltas() -> None:
    first = parse(vllm_v1([0.05] * 10, prompt=10_000, hits=100, queries=10_000, stops=10), "10.0.0.7:8000", 100.0)
    second = parse(
        vllm_v1([0.05] * 10 + [0.3] * 90, prompt=30_000, hits=200, queries=30_000, stops=100), "10.0.0.7:8000", 110.0
    )
    [got] = interval(first, second)
    assert (got.instance, got.model, got.engine, got.counter_reset) == ("10.0.0.7:8000", "llama", "vllm", False)
    assert got.prompt_tokens_per_s == pytest.approx(2_000.0) and got.generation_tokens_per_s == pytest.approx(200.0)
    assert got.prefix_cache_hit_rate == pytest.approx(100 / 20_000)  # only the interval's lookups count
    ttft = got.latency["ttft"]
    assert ttft.count == 90 and ttft.mean_s == pytest.approx(0.3)
    assert 0.25 < ttft.p50_s <= 0.5 and 0.25 < ttft.p99_s <= 0.5  # type: ignore[operator]  # the 0.25-0.5 bucket
    assert (got.kv_cache_usage, got.running, got.waiting, got.preemptions_per_s) == (0.25, 12.0, 3.0, 0.0)
    assert got.finished == {"stop": 90.0, "length": 0.0}
    assert got.cache_config == {"block_size": "16", "enable_prefix_caching": "False"}


def test_a_counter_reset_restarts_from_the_later_scrape() -> None:
    before = parse(vllm_v1([0.05] * 50, prompt=90_000, hits=0, queries=90_000, stops=50), "a:1", 0.0)
    after = parse(vllm_v1([0.05] * 5, prompt=1_000, hits=500, queries=1_000, stops=5), "a:1", 10.0)  # restarted
    [got] = interval(before, after)
    assert got.counter_reset
    assert got.prompt_tokens_per_s == pytest.approx(100.0) and got.prefix_cache_hit_rate == pytest.approx(0.5)
    assert got.latency["ttft"].count == 5 and got.finished["stop"] == 5.0


def test_old_vllm_names_are_read_and_new_ones_win_when_both_are_there() -> None:
    labels = 'model_name="llama"'
    old = "\n".join([
        histogram("vllm:time_per_output_token_seconds", labels, [0.02] * 4, (0.01, 0.025, 0.05)),
        counter("vllm:gpu_prefix_cache_queries", labels, 1000.0),
        counter("vllm:gpu_prefix_cache_hits", labels, 900.0),
        gauge("vllm:gpu_cache_usage_perc", labels, 0.5),
    ]) + "\n"  # fmt: skip
    both = old + histogram("vllm:inter_token_latency_seconds", labels, [0.04] * 4, (0.01, 0.025, 0.05)) + "\n"
    snapshot = parse(old, "a:1", 0.0).models["llama"]
    assert snapshot.gauges["kv_cache_usage"] == 0.5 and snapshot.counters["cache_hits"] == 900.0
    assert snapshot.histograms["itl"].total == pytest.approx(0.08)
    assert parse(both, "a:1", 0.0).models["llama"].histograms["itl"].total == pytest.approx(0.16)


def sglang(prompt: float, cached: float, running: float) -> str:
    labels = 'model_name="qwen",tp_rank="0"'
    return "\n".join([
        histogram("sglang:time_to_first_token_seconds", labels, [0.3] * 20, (0.1, 0.2, 0.4, 0.6)),
        histogram("sglang:inter_token_latency_seconds", labels, [0.01] * 20, (0.002, 0.01, 0.02)),
        counter("sglang:prompt_tokens", labels, prompt),
        counter("sglang:generation_tokens", labels, 500.0),
        f'# TYPE sglang:cached_tokens counter\nsglang:cached_tokens_total{{cache_source="device",{labels}}} {cached}',
        f'sglang:cached_tokens_total{{cache_source="host",{labels}}} {cached / 2}',
        gauge("sglang:cache_hit_rate", labels, 0.99),  # a sampled gauge: never used
        gauge("sglang:token_usage", labels, 0.1),
        gauge("sglang:num_running_reqs", labels, running),
        gauge("sglang:num_queue_reqs", labels, 7.0),
        counter("sglang:num_aborted_requests", labels, 1.0),
    ]) + "\n"  # fmt: skip


def test_sglang_hit_rate_comes_from_token_counters_not_its_gauge() -> None:
    [got] = interval(parse(sglang(1_000, 100, 4), "b:30000", 0.0), parse(sglang(3_000, 300, 5), "b:30000", 20.0))
    assert got.engine == "sglang" and got.model == "qwen"
    assert got.prefix_cache_hit_rate == pytest.approx(300 / 2_000)  # (200 device + 100 host) of 2,000 prompt tokens
    assert (got.kv_cache_usage, got.running, got.waiting) == (0.1, 5.0, 7.0)
    assert got.latency["ttft"].count == 0 and got.latency["ttft"].p50_s is None  # nothing new in the interval
    assert got.finished == {"abort": 0.0}


def test_data_parallel_engines_add_up_and_the_fullest_kv_cache_counts() -> None:
    two = vllm_v1([0.05] * 10, 10_000, 0, 10_000, 10, engine="0") + vllm_v1([0.05] * 10, 10_000, 0, 10_000, 10, "1")
    text = two.replace(
        'vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.25',
        'vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.75',
    )
    figures = parse(text, "a:1", 0.0).models["llama"]
    assert figures.counters["prompt_tokens"] == 20_000 and figures.histograms["ttft"].count == 20
    assert figures.gauges == {"kv_cache_usage": 0.75, "running": 24.0, "waiting": 6.0}


def test_missing_series_are_absent_not_zero_and_no_time_means_no_interval() -> None:
    text = gauge("vllm:num_requests_running", 'model_name="m"', 1.0) + "\n"
    [got] = interval(parse(text, "a:1", 0.0), parse(text, "a:1", 10.0))
    assert got.prefix_cache_hit_rate is None and got.prompt_tokens_per_s is None and got.latency == {}
    assert interval(parse(text, "a:1", 10.0), parse(text, "a:1", 10.0)) == []


def test_histogram_quantile_matches_promql_on_edges() -> None:
    h = Histogram({0.1: 0.0, 0.5: 10.0, 1.0: 10.0, math.inf: 20.0}, total=0.0, count=20.0)
    assert h.quantile(0.25) == pytest.approx(0.3)  # halfway through (0.1, 0.5]
    assert h.quantile(0.99) == 1.0  # in the open top bucket: its lower bound
    assert Histogram().quantile(0.5) is None


def test_prompt_lengths_of_the_finished_requests_come_from_their_histograms() -> None:
    """vLLM observes a finished request's prompt length and the tokens it computed in prefill
    (``request_prefill_kv_computed_tokens``) when it finishes, as it does its prefill time:
    their change over the interval describes the requests the latency histograms hold."""
    labels = 'engine="0",model_name="llama"'
    bounds = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))

    def scrape(prompts: list[float], cached: list[float]) -> str:
        computed = [p - c for p, c in zip(prompts, cached, strict=True)]
        return vllm_v1([0.05] * len(prompts), prompt=sum(prompts), hits=sum(cached), queries=sum(prompts),
                       stops=len(prompts)) + "\n".join([
            histogram("vllm:request_prompt_tokens", labels, prompts, bounds),
            histogram("vllm:request_prefill_kv_computed_tokens", labels, computed, bounds),
        ]) + "\n"  # fmt: skip

    first = parse(scrape([100.0] * 4, [0.0] * 4), "a:1", 0.0)
    second = parse(scrape([100.0] * 4 + [30_000.0, 200.0], [0.0] * 4 + [29_000.0, 0.0]), "a:1", 10.0)
    [got] = interval(first, second)
    assert got.finished_prompt_tokens == pytest.approx(15_100.0)
    assert got.finished_uncached_prompt_tokens == pytest.approx(600.0)
    [without] = interval(*(parse(vllm_v1([0.05], 10, 0, 10, n), "a:1", float(n)) for n in (1, 2)))
    assert without.finished_prompt_tokens is None and without.finished_uncached_prompt_tokens is None
