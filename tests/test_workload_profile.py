"""Workload profiles (pure): a profile of a known workload states its known rates,
burstiness, lengths, prefix sharing and finish reasons; the sampler draws what the profile
describes; the knee is the last level before latency bends."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servewatch.models.workload import StepSummary, WorkloadProfiler, WorkloadSampler, find_knee, summarise_step
from servewatch.models.workload.profile import arrival_stats, log_edges
from servewatch.schemas import EXPORTED
from servewatch.schemas.request_log import RequestLog
from servewatch.schemas.workload_profile import WorkloadProfile

DAY0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def record(arrival: float, **extra: Any) -> dict[str, Any]:
    base = {"model": "m", "e2e_s": 2.0, "prompt_tokens": 500, "completion_tokens": 50, "finish_reason": "stop"}
    return {**base, "timestamp": arrival + float(extra.get("e2e_s", 2.0)), **extra}


def poisson(rng: np.random.Generator, rate: float, start: float, end: float) -> np.ndarray:
    count = rng.poisson(rate * (end - start))
    return np.sort(rng.uniform(start, end, count))


def diurnal_arrivals(seed: int = 0, days: int = 2) -> np.ndarray:
    """Poisson arrivals whose rate changes every hour: 0.2 req/s at 00:00 UTC up to 2.5 at 23:00."""
    rng = np.random.default_rng(seed)
    hours = [poisson(rng, 0.2 + 0.1 * (h % 24), DAY0 + 3600 * h, DAY0 + 3600 * (h + 1)) for h in range(24 * days)]
    return np.concatenate(hours)


def test_hourly_rates_and_the_daily_swing_is_not_burstiness() -> None:
    arrivals = diurnal_arrivals()
    stats = arrival_stats(arrivals)
    expected = np.array([0.2 + 0.1 * h for h in range(24)])
    hourly = np.array(stats.hourly_rate, dtype=float)
    assert np.all(np.abs(hourly / expected - 1) < 0.25)  # ~ 2 h of Poisson arrivals per hour of day
    assert abs(np.mean(hourly / expected) - 1) < 0.05
    assert stats.hourly_seconds[5] == pytest.approx(7200, abs=1)  # two whole days, less the ends
    assert stats.mean_rate == pytest.approx(np.mean(expected), rel=0.05)
    # Within hours this is Poisson: a CV and dispersions of 1, although the rate swings 12x.
    assert stats.interarrival_cv == pytest.approx(1.0, abs=0.05)
    assert stats.dispersion_1s == pytest.approx(1.0, abs=0.1)
    assert stats.dispersion_10s == pytest.approx(1.0, abs=0.15)


def test_burstiness_tells_bursts_from_pacing() -> None:
    rng = np.random.default_rng(1)
    bursty = DAY0 + np.cumsum(rng.gamma(0.25, 1 / (0.25 * 5.0), 20_000))  # CV 2 at 5 req/s
    paced = DAY0 + np.arange(20_000) / 5.0 + rng.uniform(0, 0.02, 20_000)  # a client on a timer
    b, p = arrival_stats(bursty), arrival_stats(paced)
    assert b.interarrival_cv == pytest.approx(2.0, rel=0.1)
    assert b.dispersion_10s is not None and b.dispersion_10s > 2.5
    assert p.interarrival_cv is not None and p.interarrival_cv < 0.1
    assert p.dispersion_1s is not None and p.dispersion_1s < 0.2


def test_too_short_a_log_does_not_claim_burstiness() -> None:
    stats = arrival_stats(np.array([DAY0, DAY0 + 1.0, DAY0 + 2.5]))
    assert stats.interarrival_cv is None and stats.dispersion_1s is None and stats.dispersion_10s is None
    assert stats.mean_rate == pytest.approx(3 / 2.5)
    assert arrival_stats(np.array([DAY0])).mean_rate is None


def known_workload() -> list[dict[str, Any]]:
    """1,000 requests a second apart: lengths in two clusters, three shared prefixes, errors."""
    rows = []
    for i in range(1000):
        prefix: str | None
        if i < 300:
            prefix, cached = ("sys-a", 0 if i == 0 else 512)  # the first one filled the cache
        elif i < 450:
            prefix, cached = "sys-b", 256
        elif i < 500:
            prefix, cached = "sys-c", None  # a server that logs no cached_tokens
        elif i < 800:
            prefix, cached = f"unique-{i}", 0
        else:
            prefix, cached = None, None
        long = i % 2 == 1
        finish = "error" if i % 50 == 0 else "length" if i % 10 == 3 else "stop"
        rows.append(record(
            DAY0 + i, prompt_tokens=4000 if long else 700 + (i % 7), completion_tokens=0 if finish == "error" else
            (400 if long else 30), finish_reason=finish, status_code=500 if finish == "error" else 200,
            prefix_hash=prefix, cached_tokens=cached, route="rag" if long else "chat",
        ))  # fmt: skip
    return rows


def test_profile_of_a_known_workload() -> None:
    rows = known_workload()
    profile = WorkloadProfiler().learn_many(rows).profile("m")
    assert profile.requests == 1000 and profile.first == DAY0 and profile.last == DAY0 + 999
    assert profile.arrivals.mean_rate == pytest.approx(1000 / 999)
    assert profile.arrivals.interarrival_cv == pytest.approx(0.0, abs=1e-6)  # a metronome
    assert profile.finish_reasons == {"error": 0.02, "length": 0.1, "stop": 0.88}
    assert profile.routes == {"chat": 0.5, "rag": 0.5}

    lengths = profile.lengths
    counts = np.array(lengths.counts)
    assert counts.sum() == 980  # failed requests are left out
    edges_p, edges_o = np.array(lengths.prompt_edges), np.array(lengths.output_edges)
    cell_long = (np.searchsorted(edges_p, 4000, "right") - 1, np.searchsorted(edges_o, 400, "right") - 1)
    assert counts[cell_long] == 500  # every long prompt has a long answer: kept together
    assert counts.sum() - counts[cell_long] == 480 and np.count_nonzero(counts) <= 3
    assert lengths.prompt is not None and lengths.prompt.p50 in (706.0, 2353.0, 4000.0)
    assert lengths.output is not None and lengths.output.p10 == 30.0 and lengths.output.p90 == 400.0

    sharing = profile.prefixes
    assert sharing.hashed_share == 0.8 and sharing.shared_share == 0.5 and sharing.distinct_shared == 3
    assert [(p.requests, p.tokens, p.estimated_from) for p in sharing.top] == [
        (300, 512, "cached_tokens"),  # the miss (0) is not the shared length
        (150, 256, "cached_tokens"),
        (50, 700, "shortest_prompt"),  # no cached_tokens: bounded by the shortest prompt
    ]
    again = WorkloadProfile.model_validate_json(profile.model_dump_json())
    assert again == profile and again.kind == "workload_profile"


def test_request_logs_and_dicts_give_the_same_profile_and_models_are_apart() -> None:
    rows = known_workload()[:200]
    other = [{**row, "model": "other", "prompt_tokens": 9, "cached_tokens": None} for row in rows[:50]]
    from_dicts = WorkloadProfiler().learn_many(rows + other)
    from_logs = WorkloadProfiler().learn_many(RequestLog.model_validate({**r, "request_id": "r"}) for r in rows + other)
    assert from_dicts.models == ["m", "other"]
    assert from_dicts.profile("m") == from_logs.profile("m")
    assert from_dicts.profile("other").lengths.prompt.p99 == 9.0  # type: ignore[union-attr]
    with pytest.raises(KeyError):
        from_dicts.profile("absent")


def test_top_prefixes_are_capped_and_the_rest_summed() -> None:
    rows = [record(DAY0 + i, prefix_hash=f"p{i % 10}", cached_tokens=32 * (1 + i % 10)) for i in range(200)]
    sharing = WorkloadProfiler(top_prefixes=4).learn_many(rows).profile("m").prefixes
    assert len(sharing.top) == 4 and sharing.other_prefixes == 6 and sharing.other_requests == 120
    assert sharing.shared_share == 1.0 and sharing.distinct_shared == 10


def test_the_schema_is_exported() -> None:
    assert EXPORTED["WorkloadProfile"] is WorkloadProfile
    assert "schema_version" in WorkloadProfile.model_json_schema()["properties"]


# -- the sampler -------------------------------------------------------------------------------


def lognormal_profile(seed: int = 0, n: int = 20_000) -> WorkloadProfile:
    """Prompt and output lengths correlated in log space (rho 0.6), 40 % shared prefixes."""
    rng = np.random.default_rng(seed)
    z = rng.multivariate_normal([0, 0], [[1, 0.6], [0.6, 1]], n)
    prompt = np.maximum(np.exp(np.log(800) + 0.8 * z[:, 0]).astype(int), 1)
    output = np.maximum(np.exp(np.log(120) + 0.7 * z[:, 1]).astype(int), 1)
    arrivals = DAY0 + np.cumsum(rng.gamma(0.5, 1 / (0.5 * 3.0), n))  # CV 1.41
    prefix = rng.choice(["a", "b", "c"], n, p=[0.6, 0.3, 0.1])
    shared = rng.random(n) < 0.4
    cached = {"a": 1024, "b": 256, "c": 64}
    rows = [
        record(
            float(arrivals[i]),
            prompt_tokens=int(prompt[i]),
            completion_tokens=int(output[i]),
            finish_reason="length" if i % 4 == 0 else "stop",
            prefix_hash=str(prefix[i]) if shared[i] else None,
            cached_tokens=cached[prefix[i]] if shared[i] else 0,
        )
        for i in range(n)
    ]
    return WorkloadProfiler().learn_many(rows).profile("m")


def test_the_sampler_reproduces_the_profile() -> None:
    profile = lognormal_profile()
    specs = WorkloadSampler(profile, seed=1).requests(20_000)
    prompt = np.array([s.prompt_tokens for s in specs])
    output = np.array([s.output_tokens for s in specs])
    for drawn, stated in ((prompt, profile.lengths.prompt), (output, profile.lengths.output)):
        assert stated is not None
        for level, value in ((0.1, stated.p10), (0.5, stated.p50), (0.9, stated.p90)):
            assert np.quantile(drawn, level) == pytest.approx(value, rel=0.06)  # bins are 19 % wide
    assert np.corrcoef(np.log(prompt), np.log(output))[0, 1] == pytest.approx(0.6, abs=0.05)  # jointly drawn
    assert np.mean([s.prefix is not None for s in specs]) == pytest.approx(0.4, abs=0.02)
    by_prefix = np.bincount([s.prefix for s in specs if s.prefix is not None], minlength=3)
    assert by_prefix / by_prefix.sum() == pytest.approx([0.6, 0.3, 0.1], abs=0.02)  # most popular first
    assert all(s.shared_tokens == min(1024, s.prompt_tokens - 1) for s in specs if s.prefix == 0)
    assert np.mean([s.finish == "length" for s in specs]) == pytest.approx(0.25, abs=0.02)


def test_arrivals_have_the_rate_and_the_profiles_burstiness() -> None:
    sampler = WorkloadSampler(lognormal_profile(n=5000), seed=2)
    bursty = sampler.arrivals(rate=10.0, duration_s=2000.0)
    plain = sampler.arrivals(rate=10.0, duration_s=2000.0, bursty=False)
    assert len(bursty) / 2000 == pytest.approx(10.0, rel=0.05) and len(plain) / 2000 == pytest.approx(10.0, rel=0.03)
    gaps, plain_gaps = np.diff(bursty), np.diff(plain)
    assert gaps.std() / gaps.mean() == pytest.approx(math.sqrt(2), rel=0.1)
    assert plain_gaps.std() / plain_gaps.mean() == pytest.approx(1.0, rel=0.05)
    assert bursty.min() >= 0 and bursty.max() < 2000 and np.all(np.diff(bursty) >= 0)


def test_the_same_seed_draws_the_same_requests() -> None:
    profile = lognormal_profile(n=2000)
    one, two = WorkloadSampler(profile, seed=5), WorkloadSampler(profile, seed=5)
    assert one.requests(50) == two.requests(50)
    assert np.array_equal(one.arrivals(3.0, 60.0), two.arrivals(3.0, 60.0))


def test_a_profile_without_a_successful_request_cannot_be_sampled() -> None:
    rows = [record(DAY0 + i, finish_reason="error", status_code=503, completion_tokens=0) for i in range(5)]
    profile = WorkloadProfiler().learn_many(rows).profile("m")
    assert profile.lengths.prompt is None
    with pytest.raises(ValueError, match="no successful request"):
        WorkloadSampler(profile)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 10**6), st.integers(0, 10**6), st.integers(1, 8))
def test_log_edges_cover_their_range(low: int, span: int, per_doubling: int) -> None:
    edges = log_edges(low, low + span, per_doubling)
    assert edges == sorted(set(edges)) and len(edges) >= 2
    assert edges[0] <= low < edges[1] and edges[-2] <= low + span < edges[-1]
    assert set(edges) <= set(log_edges(1, 2 * 10**6, per_doubling))  # one grid for every profile


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50_000), st.integers(0, 5_000)), min_size=1, max_size=60), st.integers(0, 99))
def test_histogram_holds_every_request_and_draws_stay_in_its_cells(pairs: list[tuple[int, int]], seed: int) -> None:
    rows = [record(DAY0 + i, prompt_tokens=p, completion_tokens=o) for i, (p, o) in enumerate(pairs)]
    profile = WorkloadProfiler().learn_many(rows).profile("m")
    lengths = profile.lengths
    counts = np.array(lengths.counts)
    assert counts.sum() == len(pairs)
    for spec in WorkloadSampler(profile, seed=seed).requests(30):
        i = np.searchsorted(lengths.prompt_edges, spec.prompt_tokens, "right") - 1
        j = np.searchsorted(lengths.output_edges, spec.output_tokens, "right") - 1
        assert counts[i, j] > 0  # a drawn request lies in a cell real requests were in
        assert 0 <= spec.shared_tokens < max(spec.prompt_tokens, 1)


# -- the knee ----------------------------------------------------------------------------------


def step(concurrency: int, ttft_p95: float | None, itl: float | None = 0.02, errors: int = 0) -> StepSummary:
    return StepSummary(concurrency, 100, errors, 10.0, 50.0 * concurrency, ttft_p95, ttft_p95, itl)


def test_the_knee_is_the_last_level_before_latency_bends() -> None:
    steps = [step(1, 0.10), step(2, 0.11), step(4, 0.15), step(8, 0.25), step(16, 0.9)]
    assert find_knee(steps) == 4
    assert find_knee(steps, factor=3.0) == 8
    assert find_knee(list(reversed(steps))) == 4  # order of the list does not matter
    assert find_knee([step(1, 0.1), step(2, 0.1, errors=100)]) == 1  # nothing got through at 2
    assert find_knee([step(1, None), step(2, None)]) is None  # no latency measured: no claim
    assert find_knee([]) is None


def test_a_step_summary_of_nothing_is_empty_not_an_error() -> None:
    empty = summarise_step(8, 0.0, [], [], output_tokens=0, errors=3)
    assert empty.requests == 3 and empty.ttft_p95 is None and empty.output_tokens_per_s == 0.0
