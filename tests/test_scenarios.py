"""The detection scenario suite: each injected case pages the right signals, and
only in the injected phase; traffic growth and daily cycles page nothing.

Runs ``pipeline.dev.scenarios`` through ``Replay`` (the worker's code without a broker).
``bench/detection.py`` prints the same suite as a table with detection delays.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from servewatch.pipeline.dev.scenarios import (
    BY_NAME,
    ERROR_BURST_COUNT,
    ERROR_BURST_S,
    FAMILIES,
    PAGER_FAULT_AT_S,
    PAGER_SCENARIOS,
    PAGER_WEEK,
    SCENARIOS,
    SHOWN_BY,
    ScenarioResult,
    run_scenario,
)
from servewatch.pipeline.dev.simulator import EPOCH, FAULT_SHOWS, Workload
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status

PAGER_BY_NAME = {s.name: s for s in PAGER_SCENARIOS}

_results: dict[str, ScenarioResult] = {}


def result(name: str) -> ScenarioResult:
    if name not in _results:
        _results[name] = run_scenario(BY_NAME[name])
    return _results[name]


@pytest.mark.parametrize(
    "name", [pytest.param(s.name, marks=pytest.mark.long) if s.name == "daily_cycle" else s.name for s in SCENARIOS]
)
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


def test_a_cut_answer_shows_a_lowered_max_tokens_only_once_it_has_decoded_that_many_tokens() -> None:
    """The truncation case's delay counts from the first answer cut: a leaked marker shows the
    same fault within seconds, but no request can be cut before it has decoded 1,000 tokens."""
    scenario = BY_NAME["truncation"]
    workload = scenario.build(7)
    firsts = workload.first_faulty_logs
    injected_at = workload.start + scenario.warmup_s
    records = [r for _, batch in workload.seconds() for r in batch]
    assert workload.first_faulty_logs == firsts  # noted while read, as from a fresh copy before
    cut = [r for r in records if r["finish_reason"] == "length" and r["timestamp"] - r["e2e_s"] >= injected_at]
    leaked = [r for r in records if "</think>" in r.get("content", "")]
    assert firsts["cut"] == min(r["timestamp"] for r in cut)
    assert firsts["leaked"] == min(r["timestamp"] for r in leaked)
    assert injected_at < firsts["leaked"] < firsts["cut"]
    assert firsts["cut"] - injected_at > 1000 * Workload.itl_s * 0.9  # decoded 1,000 tokens first
    assert workload.first_faulty_log_s == firsts["leaked"]
    assert set(firsts) <= set(FAULT_SHOWS) and set(SHOWN_BY.values()) <= set(FAULT_SHOWS)
    # Nothing injected: nothing shows.
    assert BY_NAME["daily_cycle"].build(7).first_faulty_logs == {}


def test_traffic_growth_is_reported_as_explained_by_load() -> None:
    r = result("traffic_tripled")
    ttft = [e for e in r.events if e.signal is Signal.TTFT and e.status is Status.FIRING]
    assert ttft and all(e.explained_by_load and e.severity is Severity.INFO for e in ttft)


def test_cache_off_says_why() -> None:
    r = result("cache_off")
    ttft = [e for e in r.pages if e.signal is Signal.TTFT]
    assert ttft[0].hints[0].code == "prefix_cache_ineffective"
    cache = [e for e in r.pages if e.signal is Signal.CACHE_HIT_RATE]
    assert all(e.observed < e.expected for e in cache)
    # The first window holds requests served before the switch too; the next ones none cached.
    assert min(e.observed for e in cache) < 0.1 < cache[0].expected


def test_only_long_prompt_segments_page_when_only_long_prompts_slow_down() -> None:
    r = result("long_prompts_slow")
    assert r.pages and all(e.segment["prompt_band"] != "<4k" for e in r.pages)


def test_rate_events_count_what_they_judge() -> None:
    r = result("truncation")
    event = next(e for e in r.pages if e.signal is Signal.LENGTH_TRUNCATION)
    assert event.hints[0].code == "output_truncated"
    assert 0.005 < event.observed < 0.2 and event.expected < 0.005
    assert " of " in event.summary  # "31 of 1,020 requests"


#: The likely cause a person reads first, per injected case and paging signal.
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
    """A truncation page holds truncated answers, a leak page answers with the
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
    """Besides the worst requests, a uniform pick of the anomalous window and of
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


#: Per injected latency case, the figure of a request that shows its fault, and
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


# -- the pager day family, counted as a pager receives it -----------------------------------


def _incident(fp: str, signal: Signal, hint: str, severity: Severity, end: float, status: str = "firing",
              transition: str = "firing") -> AnomalyEvent:  # fmt: skip
    return AnomalyEvent(
        id=f"{fp}{transition}{end}", fingerprint=fp, status=status, transition=transition, signal=signal,
        segment={"model": "m", "route": "chat"}, window_start=end - 10, window_end=end, observed=2.0, expected=1.0,
        score=6.0, severity=severity, load={}, explained_by_load=False, hints=[Hint(code=hint, message=hint)],
        summary=f"{signal.value} {severity.value}",
    )  # fmt: skip


def test_group_pages_count_a_group_once_when_it_first_pages() -> None:
    """One group opening as info and stepping up to warning, then critical, is one page (at the
    step to warning); a member joining a paging group is none; an info-only group is none; a
    group of the same cause opening again after the first resolved is a second page."""
    scenario = dataclasses.replace(PAGER_BY_NAME["pager_three_hours"], judged_from_s=0.0)
    info, warning, critical = Severity.INFO, Severity.WARNING, Severity.CRITICAL
    events = [
        _incident("a", Signal.TTFT, "queue_building", info, 20.0),
        _incident("a", Signal.TTFT, "queue_building", warning, 30.0, transition="update"),  # steps up: page 1
        _incident("b", Signal.QUEUE_TIME, "queue_building", critical, 40.0),  # joins, steps up: no page
        _incident("c", Signal.E2E, "queueing", info, 40.0),  # info only: no page
        _incident("a", Signal.TTFT, "queue_building", info, 80.0, "resolved", "resolved"),
        _incident("b", Signal.QUEUE_TIME, "queue_building", info, 80.0, "resolved", "resolved"),
        _incident("d", Signal.ERROR_RATE, "error_burst", warning, 100.0),  # page 2 (in the fault below)
        _incident("e", Signal.TTFT, "queue_building", warning, 200.0),  # the cause again, a new group: page 3
        _incident("f", Signal.TTFT, "capacity_lost", warning, 1e6),  # after the stream's end: the drain
    ]
    r = ScenarioResult(scenario, events, 90.0, 95.0, 10_000.0, 0, 1.0)
    assert [(p.record.cause, p.record.severity, p.event.fingerprint) for p in r.group_pages] == [
        ("queue_building", warning, "a"), ("error_burst", warning, "d"), ("queue_building", warning, "e"),
    ]  # fmt: skip
    assert not any(p.in_fault for p in r.group_pages)  # a run that must page nothing has no fault
    assert len(r.false_group_pages) == 3
    fault = dataclasses.replace(PAGER_BY_NAME["pager_error_burst"], judged_from_s=0.0)
    fault_run = ScenarioResult(fault, events, 90.0, 95.0, 10_000.0, 0, 1.0)
    assert [p.event.fingerprint for p in fault_run.false_group_pages] == ["a"]  # e is the fault's aftermath
    # Groups that started paging in the detector's history are not pages on-call counts.
    later = dataclasses.replace(scenario, judged_from_s=150.0)
    assert [p.event.fingerprint for p in ScenarioResult(later, events, 90.0, 95.0, 10_000.0, 0, 1.0).group_pages] == [
        "e"
    ]


def test_the_pager_day_family_is_in_the_bench_not_in_the_asserted_suite() -> None:
    """Its runs record false pages still to fix: the bench reports them; the suite
    whose every case must pass does not hold them."""
    assert "pager day" in FAMILIES
    names = {s.name for s in PAGER_SCENARIOS} | {PAGER_WEEK.name}
    assert not names & {s.name for s in SCENARIOS}
    assert all(s.family == "pager day" for s in (*PAGER_SCENARIOS, PAGER_WEEK))
    assert {s.name for s in PAGER_SCENARIOS if s.must_page} == {"pager_error_burst", "pager_capacity_halved"}


def test_the_pager_day_faults_share_the_normal_runs_traffic() -> None:
    """The fault runs are the three normal hours with one phase changed: the same requests
    arrive, and until the fault every one is served as in the normal run (after it, the
    failed requests' freed slots shift the others a little)."""
    start, end = PAGER_FAULT_AT_S, PAGER_FAULT_AT_S + ERROR_BURST_S

    def by_id(name: str) -> dict[str, dict[str, Any]]:
        records = PAGER_BY_NAME[name].build(3).records()
        return {r["request_id"]: r for r in records if r["timestamp"] < EPOCH + end + 1800}

    def arrival(r: dict[str, Any]) -> float:
        return float(r["timestamp"] - r["e2e_s"] - EPOCH)

    plain, burst = by_id("pager_three_hours"), by_id("pager_error_burst")
    assert plain.keys() == burst.keys()
    assert all(plain[k] == burst[k] for k in plain if arrival(plain[k]) < start - 60)
    assert all(plain[k]["prompt_tokens"] == burst[k]["prompt_tokens"] for k in plain)
    failed = [r for k, r in burst.items() if r["finish_reason"] == "error" != plain[k]["finish_reason"]]
    assert len(failed) == ERROR_BURST_COUNT
    for r in failed:
        assert start - 1e-3 <= arrival(r) < end
        assert 1000 <= r["prompt_tokens"] < 3000  # inside the <4k band, away from its edge


def test_a_group_page_carries_every_signal_of_its_first_paging_window() -> None:
    """Incidents of one window join a group one at a time: the page is the group as that window
    closed, whichever member happened to open it (the bench asks it for the fault's signal)."""
    scenario = dataclasses.replace(PAGER_BY_NAME["pager_three_hours"], judged_from_s=0.0)
    warning = Severity.WARNING
    events = [
        _incident("g", Signal.PREFILL_TIME, "prefill_bound", warning, 300.0),
        _incident("h", Signal.PREFILL_PER_TOKEN, "prefill_bound", warning, 300.0),  # the same window
        _incident("i", Signal.TTFT, "prefill_bound", warning, 310.0),  # joins a window later
    ]
    (page,) = ScenarioResult(scenario, events, 90.0, 95.0, 10_000.0, 0, 1.0).group_pages
    assert page.record.signals == [Signal.PREFILL_TIME]
    assert page.signals == {Signal.PREFILL_TIME, Signal.PREFILL_PER_TOKEN}
