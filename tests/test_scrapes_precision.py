"""A /metrics-only fleet judged on its engines' scrapes: a surge or a natural burst pages
no one, real engine faults do.

The simulated vLLM scrapes of ``pipeline.dev.sim_scrapes`` (slot-limited engines on the
Mooncake chat trace) go through ``servewatch replay --scrapes`` as a fleet without request
logs would. An engine's queue is load when it runs as many requests as it ever does and
more arrive than it serves (arrivals = finished + the change of running and waiting); the
same queue beside half the usual running requests is slots lost, and pages.
"""

from __future__ import annotations

from functools import cache

import pytest

from servewatch.pipeline.dev.serving_sim import CHAT_MODEL, SimPhase, TraceWorkload
from servewatch.pipeline.dev.sim_scrapes import ScrapeRun, run_scrape_scenario
from servewatch.schemas.anomaly import Signal

#: Hours of simulated scrapes: with the broker-backed set (``.ci/run``), not the README's default.
pytestmark = pytest.mark.long

#: Normal traffic before the phase under test: the engines' baselines and capacity grow up
#: (capacity is trusted after 30 scrapes, a baseline is young below 30 learned windows).
NORMAL_S = 1200.0


@cache
def scenario(phase: SimPhase, after_s: float = 0.0, seed: int = 7) -> tuple[TraceWorkload, ScrapeRun]:
    """The chat model's four engines (one model keeps the run short) through the phase."""
    phases = (SimPhase("normal", NORMAL_S), phase) + ((SimPhase("normal", after_s),) if after_s else ())
    workload = TraceWorkload(phases=phases, models=(CHAT_MODEL,), seed=seed)
    return workload, run_scrape_scenario(workload)


def test_a_surge_beyond_the_engines_slots_is_load_and_pages_no_one() -> None:
    workload, run = scenario(SimPhase("surge", 300.0, traffic=2.5), after_s=300.0)
    surge = [e for e in run.events if e.window_start >= workload.start + NORMAL_S]
    # It did overload the engines: their queues were reported, as load, with its figures.
    saturated = [e for e in surge if e.hints and e.hints[0].code == "capacity_saturated"]
    assert saturated and all(e.explained_by_load and not e.pages for e in saturated)
    assert "as many as it ever has" in saturated[0].hints[0].message
    assert not run.paging_groups, [g.title for g in run.paging_groups]
    assert not run.pages, [e.summary for e in run.pages]


def test_half_the_slots_lost_at_usual_demand_pages_capacity_lost_within_three_windows() -> None:
    workload, run = scenario(SimPhase("half_slots", 300.0, capacity_factor=0.5))
    fault = workload.start + NORMAL_S
    assert all(e.window_end > fault for e in run.pages), "quiet before the fault"
    first = min(run.pages, key=lambda e: e.window_end)
    assert first.window_end - fault <= 40.0  # within 3 windows of the first queued request
    # Every engine's queue pages, its first page naming the cause: half the slots stood idle.
    fired = [e for e in run.pages if e.transition == "firing"]
    assert {e.segment["instance"] for e in fired} == {f"10.0.0.{10 + i}:8000" for i in range(4)}
    queue = [e for e in fired if e.signal in (Signal.QUEUE_TIME, Signal.TTFT, Signal.WAITING_REQUESTS)]
    assert queue and all(e.hints[0].code == "capacity_lost" for e in queue)
    assert "slots busy" in queue[0].hints[0].message
    assert [g.cause for g in run.paging_groups] == ["capacity_lost"]


def test_prefix_caching_off_pages_the_engines_hit_rate() -> None:
    workload, run = scenario(SimPhase("cache_off", 300.0, prefix_caching=False))
    fault = workload.start + NORMAL_S
    assert all(e.window_end > fault for e in run.pages), "quiet before the fault"
    hit = [e for e in run.pages if e.signal is Signal.CACHE_HIT_RATE]
    assert hit and hit[0].hints[0].code == "prefix_cache_ineffective"
    assert min(e.window_end for e in hit) - fault <= 60.0


def test_decode_twice_as_slow_pages_the_engines_inter_token_latency_within_three_windows() -> None:
    # The engines' inter-token latency is judged at the batch they run: a slower decode holds
    # requests longer and fills the batch, which explains only a share of the rise.
    workload, run = scenario(SimPhase("decode_slow", 300.0, decode_slowdown=2.0))
    fault = workload.start + NORMAL_S
    assert all(e.window_end > fault for e in run.pages), "quiet before the fault"
    itl = sorted((e for e in run.pages if e.signal is Signal.ITL and e.transition == "firing"),
                 key=lambda e: e.window_end)  # fmt: skip
    assert itl and itl[0].window_end - fault <= 40.0
    assert itl[0].hints[0].code == "decode_slowdown"
