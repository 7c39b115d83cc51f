"""The detection scenario suite (issue #4): each injected case pages the right signals, and
only in the injected phase; traffic growth and daily cycles page nothing.

Runs ``pipeline.scenarios`` through ``Replay`` (the worker's code without a broker).
``bench/detection.py`` prints the same suite as a table with detection delays.
"""

from __future__ import annotations

import pytest

from pipeline.scenarios import BY_NAME, SCENARIOS, ScenarioResult, run_scenario
from schemas.anomaly import AnomalyEvent, Severity, Signal, Status

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


@pytest.mark.parametrize("name", [s.name for s in SCENARIOS if s.must_page])
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


def test_rate_events_carry_the_requests_they_counted_as_evidence() -> None:
    """Issue #5: a truncation page holds truncated answers, a leak page answers with the
    marker (scrubbed excerpt around it), an error page failed requests; all of its segment."""
    truncated = _first_page("truncation", Signal.LENGTH_TRUNCATION)
    assert truncated.evidence and all(r["finish_reason"] == "length" for r in truncated.evidence)
    assert "(max_tokens of the requests cut: 1,000)" in truncated.hints[0].message  # the phase's limit
    assert truncated.hints[0].message in truncated.summary
    leaks = _first_page("truncation", Signal.REASONING_LEAK)
    assert leaks.evidence and all("‹/think›" in r["content_excerpt"] for r in leaks.evidence)
    assert all(len(r["content_excerpt"]) <= 200 for r in leaks.evidence)
    failed = _first_page("errors", Signal.ERROR_RATE)
    assert failed.evidence
    assert all(r["finish_reason"] in ("error", "abort") or r.get("status_code", 0) >= 500 for r in failed.evidence)
    for event in (truncated, leaks, failed):
        assert {r["model"] for r in event.evidence} == {event.segment["model"]}
        assert all("location" in r and "request_id" in r for r in event.evidence)
