"""Change verification holds the traffic fixed: two slices of one steady service at other
loads and prefix reuse give no verdict, real changes at equal load are still found, the cache
is judged on the requests that could hit it, and a rollback never fires on an inconclusive
comparison. Traffic from the trace-driven fleet simulation (real arrival traces)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest

from servewatch.models.compare import ChangeVerifier, strata
from servewatch.models.compare.rollback import RollbackCondition, check
from servewatch.models.compare.strata import TrafficLog
from servewatch.models.compare.watch import ChangeWatch
from servewatch.pipeline.dev.serving_sim import PAGER_CHAT_MODEL, PAGER_CODE_MODEL, ModelSpec, SimPhase, TraceWorkload
from servewatch.pipeline.dev.traffic_cycles import cycle_phases
from servewatch.schemas.change_marker import ChangeMarker
from servewatch.schemas.change_report import ChangeReport

HALF_HOUR = 1800.0
VERDICTS = ("regressed", "improved")


def slices(spec: ModelSpec, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Half an hour of ``spec`` at its usual load, then half an hour of the same service at 0.6x
    the arrivals from another stretch of its trace, with fewer prompts on a shared prefix."""
    before = list(TraceWorkload(phases=(SimPhase("busy", HALF_HOUR),), models=(replace(spec, system_prompt_share=0.8),),
                                seed=seed).records())  # fmt: skip
    quieter = (SimPhase("quiet", HALF_HOUR, traffic=0.6),)
    after = list(TraceWorkload(phases=quieter, models=(replace(spec, system_prompt_share=0.5),), seed=1000 + seed,
                               start=before[-1]["timestamp"] + 1.0).records())  # fmt: skip
    return before, after


def verdicts(report: ChangeReport) -> dict[str, str]:
    return {row.signal: row.verdict for row in report.signals}


def judged(report: ChangeReport) -> list[str]:
    return [f"{row.signal} {row.verdict}" for row in report.signals if row.verdict in VERDICTS]


def test_a_quieter_half_hour_with_less_prefix_reuse_is_no_change() -> None:
    """The issue's case: arrivals at 0.6x and fewer reused prefixes. Without the traffic held
    fixed the cache "regresses"; with it, nothing is judged changed."""
    before, after = slices(PAGER_CODE_MODEL, 3)
    (raw,) = ChangeVerifier(hold_traffic=False, seed=3).compare(before, after)
    assert verdicts(raw)["cache_hit_rate"] == "regressed"  # fewer prompts could hit: not the cache's doing
    (report,) = ChangeVerifier(seed=3).compare(before, after)
    assert not judged(report), judged(report)
    traffic = report.traffic
    assert traffic is not None and traffic.eligible_before is not None and traffic.eligible_after is not None
    assert traffic.eligible_before > traffic.eligible_after + 0.2  # the eligible share is reported as the mix
    assert traffic.rate_after is not None and traffic.rate_before is not None


@pytest.mark.long
def test_twenty_seeds_of_a_steady_service_give_at_most_one_verdict() -> None:
    """20 seeds of both pager models (40 reports, 9 signals each): at most one verdict in all."""
    found = []
    for seed in range(20):
        for spec in (PAGER_CODE_MODEL, PAGER_CHAT_MODEL):
            (report,) = ChangeVerifier(seed=seed).compare(*slices(spec, seed))
            found += [f"{spec.name} seed {seed}: {said}" for said in judged(report)]
    assert len(found) <= 1, found


def fault(spec: ModelSpec, seed: int, **condition: Any) -> ChangeReport:
    """Half an hour as usual, then half an hour with ``condition``: one trace, split at the change."""
    workload = TraceWorkload(phases=(SimPhase("as usual", HALF_HOUR), SimPhase("changed", HALF_HOUR, **condition)),
                             models=(spec,), seed=seed)  # fmt: skip
    rows = list(workload.records())
    change = workload.start + HALF_HOUR
    before = [row for row in rows if row["timestamp"] - row["e2e_s"] < change]
    after = [row for row in rows if row["timestamp"] - row["e2e_s"] >= change]
    (report,) = ChangeVerifier(seed=seed).compare(before, after)
    return report


@pytest.mark.parametrize(
    ("condition", "expected"),
    [
        ({"prefix_caching": False}, {"ttft_p50": "regressed", "cache_hit_rate": "regressed"}),
        ({"decode_slowdown": 2.0}, {"itl_p50": "regressed", "tokens_per_s_p50": "regressed"}),
        ({"ttft_factor": 1.3}, {"ttft_p95": "regressed"}),
    ],
    ids=["cache off", "decode 2x slower", "TTFT 1.3x"],
)
def test_a_real_change_at_equal_load_is_found(condition: dict[str, Any], expected: dict[str, str]) -> None:
    report = fault(PAGER_CHAT_MODEL, 1, **condition)
    assert report.traffic is not None and report.traffic.rate_before and report.traffic.rate_after
    assert 0.8 < report.traffic.rate_after / report.traffic.rate_before < 1.25  # the same load
    assert {signal: verdicts(report)[signal] for signal in expected} == expected
    assert not any(row.verdict == "improved" for row in report.signals)


def test_a_rollback_never_fires_on_an_inconclusive_comparison() -> None:
    """Twice the arrivals and nothing else changed: TTFT p95 is worse, but the load alone does
    that, so the condition is not judged and a live watch fires nothing; at the same load a
    1.5x slower prefill fires."""
    surge = (SimPhase("as usual", HALF_HOUR), SimPhase("twice the arrivals", HALF_HOUR, traffic=2.0))
    rows = list(TraceWorkload(phases=surge, models=(PAGER_CHAT_MODEL,), seed=2).records())
    at = rows[0]["timestamp"] - rows[0]["e2e_s"] + HALF_HOUR
    before = [row for row in rows if row["timestamp"] - row["e2e_s"] < at]
    after = [row for row in rows if row["timestamp"] - row["e2e_s"] >= at]
    condition = RollbackCondition("ttft_p95", 0.2)
    (unchecked,) = ChangeVerifier(hold_traffic=False, seed=2).compare(before, after)
    assert verdicts(unchecked)["ttft_p95"] == "regressed"  # what a comparison of the mix alone says
    result = check(condition, before, after, ChangeVerifier(seed=2), PAGER_CHAT_MODEL.name)
    assert not result.holds and result.detail.startswith("not judged: inconclusive"), result.detail
    assert "load differs" in result.detail

    marker = ChangeMarker(id="c2", at=at, model=PAGER_CHAT_MODEL.name, description="a config flip that did nothing")
    watch = ChangeWatch(marker, before_s=HALF_HOUR, after_s=HALF_HOUR, conditions=[condition],
                        verifier=ChangeVerifier(resamples=200, seed=2))  # fmt: skip
    watch.add(rows)
    watch.observe(at + HALF_HOUR + 1.0)
    report, events = watch.check()
    assert events == [] and report.final and report.traffic is not None
    assert verdicts(report)["ttft_p95"] == "inconclusive"

    slower = fault(PAGER_CHAT_MODEL, 2, ttft_factor=1.5)
    assert verdicts(slower)["ttft_p95"] == "regressed"


def test_a_live_watch_labels_each_prefix_as_the_comparison_of_the_whole_does() -> None:
    """Requests are logged as they finish; their prefixes reached the cache as they arrived.
    A short answer logged before a long one that arrived ahead of it with the same prefix
    still found that prefix cached. The live log labels every request as ``label`` does
    with the whole stream at hand, these included."""
    log = TrafficLog(lifetime_s=600.0)
    long_first = {"timestamp": 1060.0, "e2e_s": 60.0, "completion_tokens": 2000, "prefix_hash": "sys"}
    short_after = {"timestamp": 1020.0, "e2e_s": 10.0, "completion_tokens": 100, "prefix_hash": "sys"}
    logged = [log.add(row) for row in (short_after, long_first)]  # in the order they finished
    assert [log.labels()[at] for at in logged] == [strata.SEEN, strata.UNKNOWN]  # the first of "sys" is unknown

    before, after = slices(PAGER_CODE_MODEL, 3)
    rows = sorted(before + after, key=lambda row: row["timestamp"])
    log = TrafficLog()
    positions = [log.add(row) for row in rows]
    (whole,) = strata.label([rows])
    live = log.labels()
    assert [int(live[at]) for at in positions] == [row[strata.PREFIX] for row in whole]
    arrivals = [strata.arrival_of(row) for row in rows]
    overtaken = sum(later < earlier for earlier, later in itertools.pairwise(arrivals))
    assert overtaken > 100  # the case is in the traffic: many requests finish after one that arrived later


def _hours_of_a_day(cache_off_from_s: float | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Hour 2 and hour 3 of a simulated day of the Mooncake-trace model (its daily cycle, its
    own prompts: how much of each a cached prefix covers varies from hour to hour)."""
    phases, elapsed = [], 0.0
    for phase in cycle_phases(86_400.0):
        if elapsed >= 4 * 3600.0:
            break
        off = cache_off_from_s is not None and elapsed >= cache_off_from_s
        phases.append(replace(phase, prefix_caching=False) if off else phase)
        elapsed += phase.duration_s
    workload = TraceWorkload(phases=tuple(phases), models=(PAGER_CHAT_MODEL,), seed=1)
    first = workload.start + 2 * 3600.0
    rows = [row for row in workload.records() if first <= row["timestamp"] < first + 7200.0]
    return [row for row in rows if row["timestamp"] < first + 3600.0], [
        row for row in rows if row["timestamp"] >= first + 3600.0
    ]


def test_ttft_that_follows_what_the_prompts_offered_the_cache_is_no_regression() -> None:
    """Two adjacent hours of one unchanged service: the second hour's prompts share shorter
    cached prefixes, so more of each is prefilled and TTFT p50 reads 1.4x. The cache's hit
    rate did not move, so the uncached tokens are the traffic's, and at the first hour's
    sensitivity to them TTFT has no verdict left. With the cache switched off for the second
    hour the same tokens are the fault's doing: the cache regresses and so does TTFT."""
    (report,) = ChangeVerifier(seed=1).compare(*_hours_of_a_day())
    by_signal = {row.signal: row for row in report.signals}
    assert by_signal["cache_hit_rate"].verdict == "no change"
    ttft = by_signal["ttft_p50"]
    assert ttft.change is not None and ttft.change > 1.3 and ttft.verdict == "inconclusive", ttft
    assert ttft.reason is not None and "prefix cache did not serve" in ttft.reason
    assert not judged(report)

    (off,) = ChangeVerifier(seed=1).compare(*_hours_of_a_day(cache_off_from_s=3 * 3600.0))
    assert verdicts(off)["cache_hit_rate"] == "regressed" and verdicts(off)["ttft_p50"] == "regressed"
