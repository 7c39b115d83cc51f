"""The detection scenario suite (issue #4): each injected case pages the right signals, and
only in the injected phase; traffic growth and daily cycles page nothing.

Runs ``pipeline.dev.scenarios`` through ``Replay`` (the worker's code without a broker).
``bench/detection.py`` prints the same suite as a table with detection delays.
"""

from __future__ import annotations

from typing import Any

import pytest

from servewatch.pipeline.dev.scenarios import BY_NAME, SCENARIOS, ScenarioResult, run_scenario
from servewatch.schemas.anomaly import AnomalyEvent, Severity, Signal, Status

_results: dict[str, ScenarioResult] = {}


def result(name: str) -> ScenarioResult:
    if name not in _results:
        _results[name] = run_scenario(BY_NAME[name])
    return _results[name]


@pytest.mark.parametrize("name", [s.name for s in SCENARIOS])
def test_scenario_pages_what_it_must_and_nothing_before(name: str) -> None:
    r = result(name)
    assert not r.false_pages, [(e.signal, e.window_start) for e in r.false_pages]
    missing = r.scenario.must_page - r.paged_signals
    assert not missing, f"{name}: {sorted(s.value for s in missing)} did not page"
    if not r.scenario.must_page:
        assert not r.pages, f"{name} must not page: {sorted({e.signal.value for e in r.pages})}"


@pytest.mark.parametrize("name", [s.name for s in SCENARIOS if s.must_page and s.family == "synthetic"])
def test_injected_faults_are_caught_within_a_few_windows(name: str) -> None:
    r = result(name)
    for signal in r.scenario.must_page:
        delay = r.first_page_delay(signal)
        assert delay is not None and delay <= 60, f"{signal.value} paged {delay} s after the fault"


def test_traffic_growth_is_reported_as_explained_by_load() -> None:
    r = result("traffic_tripled")
    ttft = [e for e in r.events if e.signal is Signal.TTFT and e.status is Status.FIRING]
    assert ttft and all(e.explained_by_load and e.severity is Severity.INFO for e in ttft)


def test_cache_off_says_why() -> None:
    r = result("cache_off")
    ttft = [e for e in r.pages if e.signal is Signal.TTFT]
    assert ttft[0].hints[0].code == "prefix_cache_ineffective"
    cache = [e for e in r.pages if e.signal is Signal.CACHE_HIT_RATE]
    assert cache[0].observed < 0.1 < cache[0].expected


def test_only_long_prompt_segments_page_when_only_long_prompts_slow_down() -> None:
    r = result("long_prompts_slow")
    assert r.pages and all(e.segment["prompt_band"] != "<4k" for e in r.pages)


def test_rate_events_count_what_they_judge() -> None:
    r = result("truncation")
    event = next(e for e in r.pages if e.signal is Signal.LENGTH_TRUNCATION)
    assert event.hints[0].code == "output_truncated"
    assert 0.005 < event.observed < 0.2 and event.expected < 0.005
    assert " of " in event.summary  # "31 of 1,020 requests"


#: Issue #5: the likely cause a person reads first, per injected case and paging signal.
TOP_HINT = {
    ("cache_off", Signal.TTFT): "prefix_cache_ineffective",
    ("cache_off", Signal.PREFILL_TIME): "prefix_cache_ineffective",
    ("cache_off", Signal.CACHE_HIT_RATE): "prefix_cache_ineffective",
    ("truncation", Signal.LENGTH_TRUNCATION): "output_truncated",
    ("truncation", Signal.REASONING_LEAK): "reasoning_marker_in_content",
    ("decode_slow", Signal.ITL): "decode_slowdown",
    ("decode_slow", Signal.THROUGHPUT): "decode_slowdown",
    ("errors", Signal.ERROR_RATE): "error_burst",
    ("long_prompts_slow", Signal.PREFILL_TIME): "prefill_bound",
}


@pytest.mark.parametrize(("name", "signal"), sorted(TOP_HINT, key=lambda k: (k[0], k[1].value)))
def test_the_first_page_of_each_case_names_the_right_cause_first(name: str, signal: Signal) -> None:
    r = result(name)
    first = next(e for e in r.pages if e.signal is signal and e.window_end > r.injected_at)
    assert first.hints and first.hints[0].code == TOP_HINT[(name, signal)], [h.code for h in first.hints]
    assert len({h.code for h in first.hints}) == len(first.hints), "a cause is named once"


def _first_page(name: str, signal: Signal) -> AnomalyEvent:
    r = result(name)
    return next(e for e in r.pages if e.signal is signal and e.window_end > r.injected_at)


def _sampled(event: AnomalyEvent, sample: str) -> list[dict[str, Any]]:
    return [r for r in event.evidence if r["sample"] == sample]


def test_rate_events_carry_the_requests_they_counted_as_evidence() -> None:
    """Issue #5: a truncation page holds truncated answers, a leak page answers with the
    marker (scrubbed excerpt around it), an error page failed requests; all of its segment."""
    truncated = _first_page("truncation", Signal.LENGTH_TRUNCATION)
    cut = _sampled(truncated, "faulty")
    assert len(cut) == 3 and all(r["finish_reason"] == "length" for r in cut)
    assert "(max_tokens of the requests cut: 1,000)" in truncated.hints[0].message  # the phase's limit
    assert truncated.hints[0].message in truncated.summary
    leaks = _first_page("truncation", Signal.REASONING_LEAK)
    leaked = _sampled(leaks, "faulty")
    assert leaked and all("‹/think›" in r["content_excerpt"] for r in leaked)
    assert all(len(r.get("content_excerpt", "")) <= 200 for r in leaks.evidence)
    failed = _first_page("errors", Signal.ERROR_RATE)
    errors = _sampled(failed, "faulty")
    assert errors and all(r["finish_reason"] in ("error", "abort") or r.get("status_code", 0) >= 500 for r in errors)
    for event in (truncated, leaks, failed):
        assert {r["model"] for r in event.evidence} == {event.segment["model"]}
        assert all("location" in r and "request_id" in r for r in event.evidence)


@pytest.mark.parametrize(("name", "signal"), sorted(TOP_HINT, key=lambda k: (k[0], k[1].value)))
def test_each_first_page_compares_a_sample_of_its_window_with_the_latest_normal_one(name: str, signal: Signal) -> None:
    """Issue #5: besides the worst requests, a uniform pick of the anomalous window and of
    the segment's latest normal window (before it), and the facets of both."""
    event = _first_page(name, signal)
    uniform, baseline = _sampled(event, "uniform"), _sampled(event, "baseline")
    assert len(uniform) == 2 and len(baseline) == 3
    assert all(event.window_start <= r["timestamp"] < event.window_end for r in uniform)
    assert all(r["timestamp"] < event.window_start for r in baseline)
    assert len({r["request_id"] for r in event.evidence}) == len(event.evidence), "a request is shown once"
    assert event.facets is not None and event.facets.anomalous and event.facets.baseline
    assert event.facets.anomalous.requests_sampled >= 5 and event.facets.baseline.requests_sampled >= 5


def test_facets_say_what_changed_in_the_traffic() -> None:
    cache_off = _first_page("cache_off", Signal.TTFT)
    assert cache_off.facets is not None and cache_off.facets.changes
    now, before = cache_off.facets.anomalous, cache_off.facets.baseline
    assert now and before and now.cached_token_share is not None and before.cached_token_share
    assert now.cached_token_share < before.cached_token_share / 2
    assert cache_off.facets.changes[0].startswith("cached share of prompt tokens")  # the largest change first
    slowest, uniform = _sampled(cache_off, "slowest"), _sampled(cache_off, "uniform")
    assert len(slowest) == 3 and min(r["ttft_s"] for r in slowest) >= max(r["ttft_s"] for r in uniform)
    truncated = _first_page("truncation", Signal.LENGTH_TRUNCATION)
    assert truncated.facets is not None
    assert any(change.startswith("finish_reason=length in") for change in truncated.facets.changes)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _uncached_share(r: dict[str, Any]) -> float:
    return 1 - (r.get("cached_tokens") or 0) / r["prompt_tokens"]


def _per_output_token(r: dict[str, Any]) -> float:
    return r["decode_s"] / max(r["completion_tokens"] - 1, 1)


def _prefill_per_uncached_token(r: dict[str, Any]) -> float:
    return r["prefill_s"] / max(r["prompt_tokens"] - (r.get("cached_tokens") or 0), 1)


#: Issue #5: per injected latency case, the figure of a request that shows its fault, and
#: the factor by which the event's slowest requests must show more of it than the
#: segment's normal ones (its baseline sample).
SHOWS_FAULT = {
    ("cache_off", Signal.TTFT): (_uncached_share, 1.5),
    ("cache_off", Signal.PREFILL_TIME): (_uncached_share, 1.5),
    ("decode_slow", Signal.ITL): (_per_output_token, 1.5),
    ("decode_slow", Signal.THROUGHPUT): (_per_output_token, 1.5),
    ("long_prompts_slow", Signal.PREFILL_TIME): (_prefill_per_uncached_token, 1.5),
}


@pytest.mark.parametrize(("name", "signal"), sorted(SHOWS_FAULT, key=lambda k: (k[0], k[1].value)))
def test_the_slowest_requests_of_each_latency_case_show_its_fault_against_the_baseline(
    name: str, signal: Signal
) -> None:
    """The slowest requests are the worst by the event's own signal (per-token decode for
    itl, prefill seconds for prefill_time), and they show the injected cause."""
    event = _first_page(name, signal)
    figure, factor = SHOWS_FAULT[(name, signal)]
    slowest, baseline = _sampled(event, "slowest"), _sampled(event, "baseline")
    assert len(slowest) == 3 and len(baseline) == 3
    assert _median([figure(r) for r in slowest]) >= factor * _median([figure(r) for r in baseline])
