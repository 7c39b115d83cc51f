"""Live change verification without a broker: a ``ChangeWatch`` fed the requests
around a marker judges the change on the same mix, and a declared rollback condition fires
a critical ``rollback_condition_met`` incident only when the change crossed it (a lower
``max_tokens``), not for a shift of the request mix or a change that helped; conditions
are read from YAML with their units checked."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from servewatch.models.compare import ChangeVerifier
from servewatch.models.compare.rollback import RollbackCondition, check
from servewatch.models.compare.watch import DUPLICATE_HORIZON_S, ChangeWatch
from servewatch.models.explain.changes import ChangeBook, mention_change
from servewatch.pipeline.changes.config import parse_changes_config
from servewatch.pipeline.dev.simulator import DEFAULT_ROUTES, EPOCH, Phase, Route, Workload
from servewatch.pipeline.notify.config import ConfigError
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status
from servewatch.schemas.change_marker import ChangeMarker
from servewatch.schemas.change_report import ChangeReport

AT = EPOCH + 600.0  # the change, between the two periods
TRUNCATION = RollbackCondition("truncation_share", 1.0, scope="segment", min_requests=200)
TTFT = RollbackCondition("ttft_p95", 0.2, scope="segment", min_requests=200)
ERRORS = RollbackCondition("error_share", 0.5)


def period(phase: Phase, seed: int, start: float, routes: tuple[Route, ...] = DEFAULT_ROUTES,
           rate: float = 12.0, content: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    workload = Workload(phases=(phase,), models=("m",), routes=routes, base_rate=rate, seed=seed, start=start,
                        log_content=content)  # fmt: skip
    return list(workload.records())


def row_of(report: ChangeReport, signal: str) -> Any:
    return next(row for row in report.signals if row.signal == signal)


def watched(before: list[dict[str, Any]], after: list[dict[str, Any]], *conditions: RollbackCondition,
            description: str = "a change") -> ChangeWatch:  # fmt: skip
    marker = ChangeMarker(id="c1", at=AT, model="m", description=description)
    watch = ChangeWatch(marker, before_s=600.0, after_s=600.0, check_every_s=120.0, conditions=conditions,
                        verifier=ChangeVerifier(resamples=300))  # fmt: skip
    watch.add(before + after + [{"request_id": "tick", "timestamp": AT + 601.0, "model": "other"}])
    return watch


def test_a_lower_max_tokens_fires_the_rollback_condition_with_its_evidence() -> None:
    before = period(Phase("wide", 500), 5, AT - 520)
    after = period(Phase("narrow", 500, max_tokens=400), 6, AT + 10)
    watch = watched(before, after, TRUNCATION, TTFT, description="lower max_tokens to 400")
    assert watch.done and watch.due
    report, events = watch.check()
    assert report.final and report.change == "c1" and report.description == "lower max_tokens to 400"
    truncation = row_of(report, "truncation_share")
    assert truncation.verdict == "regressed" and truncation.ci_low > 1.0
    held: dict[str, Any] = {check.condition: check for check in report.rollback}
    assert held[TRUNCATION.text].holds and not held[TTFT.text].holds
    assert held[TRUNCATION.text].where is not None and "route=" in held[TRUNCATION.text].where

    (event,) = events
    assert (event.status, event.severity, event.signal) == (Status.FIRING, Severity.CRITICAL, Signal.LENGTH_TRUNCATION)
    assert event.hints[0].code == "rollback_condition_met" and event.change is not None and event.change.id == "c1"
    assert "lower max_tokens to 400" in event.summary and "roll back change c1" in event.summary.lower()
    assert event.segment["model"] == "m" and "route" in event.segment and event.pages
    assert event.evidence and all(row["finish_reason"] == "length" for row in event.evidence)
    assert all(row["sample"] == "faulty" and "prompt" not in row for row in event.evidence)

    # The next check does not fire again; a later change (the rollback) resolves it.
    assert watch.check(final=True)[1] == []
    later = ChangeMarker(id="c2", at=AT + 700, model="m", description="max_tokens back to 4096")
    (resolved,) = watch.supersede(later)
    assert resolved.status is Status.RESOLVED and resolved.fingerprint == event.fingerprint
    assert resolved.id != event.id and "c2" in resolved.summary


def test_a_shift_of_the_mix_towards_long_prompts_fires_nothing() -> None:
    chat, rag = DEFAULT_ROUTES
    more_rag = (Route(**{**chat.__dict__, "share": 0.4}), Route(**{**rag.__dict__, "share": 0.6}))
    before = period(Phase("flat", 500, prefix_caching=False), 1, AT - 520, rate=16.0)
    after = period(Phase("flat", 500, prefix_caching=False), 2, AT + 10, routes=more_rag, rate=16.0)
    pooled = [float(np.quantile([r["ttft_s"] for r in side], 0.95)) for side in (before, after)]
    assert pooled[1] > 1.1 * pooled[0]  # pooled, it would look like a regression
    report, events = watched(before, after, TTFT, RollbackCondition("e2e_p95", 0.2), ERRORS).check()
    assert events == [] and not any(check.holds for check in report.rollback)
    assert all("not crossed" in check.detail for check in report.rollback)


def test_caching_enabled_improves_and_fires_nothing() -> None:
    before = period(Phase("off", 500, prefix_caching=False), 3, AT - 520)
    after = period(Phase("on", 500), 4, AT + 10)
    report, events = watched(before, after, TTFT, TRUNCATION).check()
    verdicts = {row.signal: row.verdict for row in report.signals}
    assert verdicts["ttft_p95"] == "improved" and verdicts["cache_hit_rate"] == "improved" and events == []


def test_leaked_reasoning_markers_regress_the_leak_share() -> None:
    before = period(Phase("ok", 300), 7, AT - 320, content=True)
    after = period(Phase("parser bug", 300, leak_rate=0.05), 8, AT + 10, content=True)
    report, events = watched(before, after, RollbackCondition("leak_share", 1.0)).check()
    leak = row_of(report, "leak_share")
    assert leak.verdict == "regressed" and leak.before == 0.0 and 0.03 < leak.after < 0.07
    (event,) = events
    assert event.signal is Signal.REASONING_LEAK and all("</think>" in row["content"] for row in event.evidence)


def test_replayed_requests_count_once_and_memory_is_bounded() -> None:
    before = period(Phase("a", 300), 9, AT - 320)
    after = period(Phase("b", 300), 10, AT + 10)
    watch = watched(before, after)
    counts = sum(r["timestamp"] < AT for r in before + after), sum(r["timestamp"] >= AT for r in before + after)
    assert watch.requests == counts  # by finish time: a few of the first period finish after the change
    assert watch.add(after) == 0 and watch.requests == counts  # a replayed message counts once

    small = ChangeWatch(watch.marker, before_s=600.0, after_s=600.0, max_requests=100)
    small.add(before + after)
    assert small.requests == counts and len(small._after.rows) == 100
    assert all(row["timestamp"] >= AT for row in small._after.rows)  # a uniform sample of the period after

    # Repeats are looked for within DUPLICATE_HORIZON_S of event time: the ids kept are those
    # of the last few minutes, not of the whole span.
    longer = ChangeWatch(watch.marker, before_s=1800.0, after_s=1800.0)
    rows = period(Phase("a", 1200), 11, AT - 1220)
    longer.add(rows)
    newest = max(r["timestamp"] for r in rows)
    recent = sum(r["timestamp"] >= newest - DUPLICATE_HORIZON_S - 120 for r in rows)
    assert 0 < len(longer._seen) <= recent < len(rows) / 2


def test_a_check_is_due_every_check_every_seconds_of_event_time() -> None:
    marker = ChangeMarker(id="c1", at=AT, model="m", description="x")
    watch = ChangeWatch(marker, before_s=600.0, after_s=600.0, check_every_s=120.0)
    watch.add([{"request_id": "a", "timestamp": AT + 60, "model": "m"}])
    assert not watch.due
    watch.add([{"request_id": "b", "timestamp": AT + 130, "model": "m"}])
    assert watch.due
    report, _ = watch.check()
    assert not report.final and not watch.due
    watch.add([{"request_id": "c", "timestamp": AT + 250, "model": "m"}])
    assert watch.due


def test_segment_scope_widens_intervals_over_the_segments_tested() -> None:
    before = period(Phase("a", 400), 11, AT - 420)
    after = period(Phase("b", 400), 12, AT + 10)
    one = check(RollbackCondition("ttft_p95", 0.01, scope="model", min_requests=200), before, after)
    many = check(RollbackCondition("ttft_p95", 0.01, scope="segment", min_requests=200), before, after)
    # Three segments (chat and two prompt bands of rag) with 200 requests: 1 - 0.05 / 3.
    assert (
        "of 1 scope tested (95.0% intervals)" in one.detail and "of 3 segments tested (98.3% intervals)" in many.detail
    )
    few = check(RollbackCondition("ttft_p95", 0.2, scope="segment", min_requests=100_000), before, after)
    assert not few.holds and few.detail.startswith("not tested")


def test_a_higher_is_better_signal_crosses_downwards() -> None:
    before = period(Phase("on", 400), 13, AT - 420)
    after = period(Phase("off", 400, prefix_caching=False), 14, AT + 10)
    result = check(RollbackCondition("cache_hit_rate", 10.0), before, after, ChangeVerifier(resamples=200))
    assert result.holds and result.change is not None and result.change < -10
    assert RollbackCondition("cache_hit_rate", 10.0).text.startswith("cache_hit_rate -10 pt")


def test_reports_hold_their_intervals_together_over_the_signals() -> None:
    before = period(Phase("a", 300), 15, AT - 320)
    after = period(Phase("b", 300), 16, AT + 10)
    verifier = ChangeVerifier(resamples=400)
    (together,) = verifier.compare(before, after)
    (alone,) = replace(verifier, simultaneous=False).compare(before, after)
    assert together.simultaneous and not alone.simultaneous
    width = {r.signal: r.ci_high - r.ci_low for r in together.signals if r.ci_low is not None and r.ci_high is not None}
    for row in alone.signals:
        if row.ci_low is not None and row.ci_high is not None and row.signal.startswith("ttft"):
            assert width[row.signal] > row.ci_high - row.ci_low


def test_conditions_are_read_from_yaml_with_their_units_checked() -> None:
    config = parse_changes_config(
        """
before: 20m
after: 1h
check_every: 2m
rollback:
  - {signal: ttft_p95, worse_by: 20%, scope: segment, min_requests: 200}
  - {signal: error_share, worse_by: 0.1pt}
""",
        ".yaml",
    )
    assert (config.before, config.after, config.check_every) == (1200.0, 3600.0, 120.0)
    assert (config.prefix_lifetime, config.min_stratum_requests) == (600.0, 10)  # the defaults
    tuned = parse_changes_config("prefix_lifetime: 2m\nmin_stratum_requests: 25\n", ".yaml")
    assert (tuned.prefix_lifetime, tuned.min_stratum_requests) == (120.0, 25)
    first, second = config.conditions()
    assert first.text == "ttft_p95 +20 % on any segment with at least 200 requests"
    assert second == RollbackCondition("error_share", 0.1)
    for bad, why in (("{signal: ttft_p95, worse_by: 0.1pt}", "percentage"),
                     ("{signal: error_share, worse_by: 20%}", "points"),
                     ("{signal: ttft_p99, worse_by: 20%}", "unknown signal"),
                     ("{signal: ttft_p95, worse_by: -5%}", "positive")):  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            parse_changes_config(f"rollback:\n  - {bad}\n", ".yaml")


def test_an_incident_after_a_change_names_it_first_and_an_old_change_does_not() -> None:
    def event(start: float) -> AnomalyEvent:
        return AnomalyEvent(id="e", fingerprint="f", status=Status.FIRING, signal=Signal.TTFT,
                            segment={"model": "m", "instance": "gpu-2"}, window_start=start, window_end=start + 10,
                            observed=2.0, expected=1.0, score=4.0, severity=Severity.WARNING, load={},
                            explained_by_load=False, summary="TTFT up",
                            hints=[Hint(code="prefill_bound", message="")])  # fmt: skip

    book = ChangeBook()
    book.add(ChangeMarker(id="all", at=1000.0, model="m", description="engine upgrade"))
    book.add(ChangeMarker(id="other-gpu", at=1100.0, model="m", instance="gpu-1", description="gpu-1 only"))
    book.add(ChangeMarker(id="all", at=1000.0, model="m", description="engine upgrade"))  # read twice
    soon, late = event(1150.0), event(1000.0 + 10 * 31)
    soon = mention_change(soon, book, window_s=10.0, horizon_windows=30)
    late = mention_change(late, book, window_s=10.0, horizon_windows=30)
    assert soon.change is not None and soon.change.id == "all" and soon.change.windows_after == 15
    assert soon.hints[0].code == "change_marker" and len(book.of_model("m")) == 2
    assert late.change is None and late.hints[0].code == "prefill_bound"


def test_records_of_the_changes_topic_are_told_apart_by_kind_not_by_their_text() -> None:
    from servewatch.pipeline.changes.store import parse_change_record

    marker = ChangeMarker(id="c1", at=1.0, model="m", description='rename to "change_report')
    assert parse_change_record(marker.model_dump_json().encode()) == marker
    assert parse_change_record(b'{"kind": "other"}') is None and parse_change_record(b"{not json") is None
