"""The first incident class end to end through ``Replay`` (same code as the worker, no broker).

Scenario: normal traffic, a 3x surge, recovery, prefix caching off at flat traffic.
"""

from __future__ import annotations

import itertools
import math

import orjson
import pytest

from servewatch.pipeline.dev.simulator import EPOCH, Phase, Workload, demo_phases
from servewatch.pipeline.replay.request_logs import Replay
from servewatch.pipeline.settings import Settings
from servewatch.schemas.anomaly import AnomalyEvent, Severity, Signal, Status


def replay(workload: Workload, settings: Settings | None = None) -> list[AnomalyEvent]:
    engine = Replay(settings)
    return list(engine.run(orjson.dumps(batch) for _, batch in workload.seconds() if batch))


@pytest.fixture(scope="module")
def demo_events() -> tuple[Workload, list[AnomalyEvent]]:
    workload = Workload(demo_phases())
    return workload, replay(workload)


def phase(workload: Workload, event: AnomalyEvent) -> str:
    return workload.phase_at(event.window_start - EPOCH).name


def test_surge_is_explained_by_load_and_never_pages(demo_events: tuple[Workload, list[AnomalyEvent]]) -> None:
    workload, events = demo_events
    surge = [e for e in events if phase(workload, e) == "surge" and e.status is Status.FIRING]
    assert surge, "a 3x surge raises TTFT: it should be reported (as info)"
    assert all(e.explained_by_load and e.severity is Severity.INFO and not e.pages for e in surge)
    assert {Signal.TTFT, Signal.QUEUE_TIME} <= {e.signal for e in surge}
    # at its peak, the engines serve as much as they ever have: saturated, which is load too
    assert all(e.hints and e.hints[0].code in ("queueing", "capacity_saturated") for e in surge)
    assert all(e.load["demand_vs_usual"] > 1.5 for e in surge if e.signal is Signal.TTFT)  # 3x, as it arrives


def test_cache_off_pages_ttft_with_the_right_hint(demo_events: tuple[Workload, list[AnomalyEvent]]) -> None:
    workload, events = demo_events
    pages = [e for e in events if e.pages]
    assert pages and all(phase(workload, e) == "cache_off" for e in pages), "pages only in the cache-off phase"
    assert {Signal.TTFT, Signal.PREFILL_TIME, Signal.CACHE_HIT_RATE} <= {e.signal for e in pages}
    first = min((e for e in pages if e.signal is Signal.TTFT), key=lambda e: e.window_start)
    start = sum(p.duration_s for p in workload.phases[:-1]) + EPOCH
    assert first.window_start - start <= 40, "caught within a few windows"
    assert not first.explained_by_load
    assert first.hints[0].code == "prefix_cache_ineffective"
    # Judged beside the failing cache, TTFT pages as soon as it rises at all; the rise grows to
    # the several-fold a prompt computed again costs.
    assert first.observed > first.expected
    assert max(e.observed / e.expected for e in pages if e.signal is Signal.TTFT) > 3
    assert first.load["demand_vs_usual"] < 1.5
    assert "not explained by load" in first.summary


def test_events_carry_evidence_without_text(demo_events: tuple[Workload, list[AnomalyEvent]]) -> None:
    _, events = demo_events
    firing = [e for e in events if e.status is Status.FIRING and e.signal is Signal.TTFT]
    for event in firing:
        anomalous = [r for r in event.evidence if r["sample"] in ("slowest", "uniform")]
        assert 0 < len(anomalous) <= 5 and len(event.evidence) - len(anomalous) <= 3  # the default budget
        ttfts = [r["ttft_s"] for r in event.evidence if r["sample"] == "slowest"]
        assert ttfts and ttfts == sorted(ttfts, reverse=True), "worst first"
        for record in event.evidence:
            assert {"request_id", "timestamp", "model", "ttft_s", "finish_reason"} <= record.keys()
            assert "content" not in record and "prompt" not in record


def test_every_incident_resolves_or_is_still_firing_with_one_fingerprint(
    demo_events: tuple[Workload, list[AnomalyEvent]],
) -> None:
    _, events = demo_events
    by_fp: dict[str, list[AnomalyEvent]] = {}
    for e in events:
        by_fp.setdefault(e.fingerprint, []).append(e)
    for chain in by_fp.values():
        assert len({e.signal for e in chain}) == 1 and len({tuple(e.segment.items()) for e in chain}) == 1
        assert chain[0].status is Status.FIRING
        # An incident back soon after resolving is reopened under its fingerprint (flap
        # damping): a resolve is followed by nothing or by its firing again, of the same kind.
        for before, after in itertools.pairwise(chain):
            assert not (before.status is Status.RESOLVED and after.status is Status.RESOLVED)
        assert len({e.pages for e in chain if e.status is Status.FIRING}) == 1, "a page never reopens an info"


def test_replay_is_deterministic() -> None:
    workload_phases = (Phase("normal", 240), Phase("cache_off", 120, prefix_caching=False))
    first = [e.model_dump_json() for e in replay(Workload(workload_phases, seed=5))]
    second = [e.model_dump_json() for e in replay(Workload(workload_phases, seed=5))]
    assert first == second and first


@pytest.mark.long
def test_flat_traffic_stays_quiet_for_hours() -> None:
    """Three simulated hours of normal traffic: no page at all."""
    events = replay(Workload((Phase("normal", 3 * 3600),), base_rate=4.0, seed=11))
    assert not [e for e in events if e.pages]


def test_small_segments_do_not_page_on_noise() -> None:
    """A trickle of traffic: few requests per window, p95 is noisy; count-aware scoring keeps quiet."""
    events = replay(Workload((Phase("normal", 3600),), base_rate=1.0, seed=12))
    assert not [e for e in events if e.pages]


def test_scores_are_finite_and_not_saturated(demo_events: tuple[Workload, list[AnomalyEvent]]) -> None:
    _, events = demo_events
    scores = [e.score for e in events if e.status is Status.FIRING]
    assert all(math.isfinite(s) for s in scores)
    assert len(set(scores)) > len(scores) // 2, "scores do not tie at a maximum"
