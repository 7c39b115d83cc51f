"""One cause, one group (``models.detect.grouping``), on the demo's workload and by rule."""

from __future__ import annotations

import orjson
import pytest

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.pipeline.dev.simulator import EPOCH, Workload, demo_phases
from servewatch.pipeline.replay.request_logs import Replay
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status
from servewatch.schemas.incident_group import IncidentGroup, parse_anomaly_record


@pytest.fixture(scope="module")
def demo_records() -> tuple[Workload, list[AnomalyEvent | IncidentGroup]]:
    """The demo's workload through the worker's code, then grouped as the grouping agent does."""
    workload = Workload(demo_phases())
    grouper, records = IncidentGrouper(), []
    for event in Replay().run(orjson.dumps(batch) for _, batch in workload.seconds() if batch):
        event, told = grouper.add(event)
        records += [event, *told]
    return workload, records


def test_prefix_caching_off_is_one_group_per_model_however_many_incidents(
    demo_records: tuple[Workload, list[AnomalyEvent | IncidentGroup]],
) -> None:
    workload, records = demo_records
    cache_off = [r for r in records if isinstance(r, AnomalyEvent) and r.pages
                 and workload.phase_at(r.window_start - EPOCH).name == "cache_off"]  # fmt: skip
    incidents = {e.fingerprint for e in cache_off}
    groups = {e.group for e in cache_off}
    models = {e.segment["model"] for e in cache_off}
    assert len(incidents) > 2 * len(models)  # many incidents (segments x signals) ...
    assert len(groups) <= len(models)  # ... told as one group per model
    told = [r for r in records if isinstance(r, IncidentGroup) and r.group in groups]
    firing = [g for g in told if g.transition == "firing"]
    assert len(firing) == len(groups) and all(g.cause == "prefix_cache_ineffective" for g in firing)
    last = {g.group: g for g in told}
    assert all(g.segments > 1 and Signal.TTFT in g.signals for g in last.values())
    # Each record round-trips as the topic's consumers read it.
    assert all(parse_anomaly_record(r.model_dump_json()) == r for r in told[:5])


def event(fp: str, route: str, *, status: Status = Status.FIRING, transition: str = "firing", end: float = 10.0,
          severity: Severity = Severity.WARNING, hint: str = "capacity_lost", demand: float = 1.0,
          explained: bool = False, signal: Signal = Signal.TTFT) -> AnomalyEvent:  # fmt: skip
    return AnomalyEvent(
        id=f"{fp}-{transition}-{end}", fingerprint=fp, status=status, transition=transition,  # type: ignore[arg-type]
        signal=signal, segment={"model": "m", "route": route}, window_start=end - 10, window_end=end,
        observed=2.0, expected=1.0, score=6.0, severity=severity,
        load={"demand_vs_usual": demand, "arrivals_vs_usual": demand},
        explained_by_load=explained, hints=[Hint(code=hint, message="")], summary="",
    )  # fmt: skip


def test_updates_of_members_move_nothing_a_step_up_does_and_the_last_resolve_ends_the_group() -> None:
    grouper = IncidentGrouper()
    _, told = grouper.add(event("a", "chat"))
    key = told[0].group
    assert grouper.add(event("a", "chat", transition="update", end=70.0))[1] == []
    _, told = grouper.add(event("a", "chat", transition="update", end=80.0, severity=Severity.CRITICAL))
    assert [(g.transition, g.severity) for g in told] == [("update", Severity.CRITICAL)]
    other, told = grouper.add(event("b", "chat", hint="error_burst", end=90.0))  # another cause: its own
    assert other.group != key and told[0].transition == "firing"
    _, told = grouper.add(event("a", "chat", status=Status.RESOLVED, transition="resolved", end=120.0))
    assert [g.transition for g in told] == ["resolved"] and len(grouper) == 1
    again, told = grouper.add(event("c", "rag", end=300.0))  # the cause again, later: a new group
    assert again.group not in (key, other.group) and told[0].transition == "firing"


def test_one_burst_is_one_group_explained_by_load_that_never_pages() -> None:
    """Incidents a burst of demand causes join one group whatever each one's hint, and the group
    is info throughout, even when a member's window crosses the paging or critical bound."""
    grouper = IncidentGrouper()
    first, told = grouper.add(event("a", "chat", hint="queue_building", demand=1.6))
    assert told[0].transition == "firing" and told[0].explained_by_load and not told[0].pages
    second, told = grouper.add(event("b", "rag", hint="latency_rise", demand=1.5, end=20.0))
    third, _ = grouper.add(event("c", "code", hint="capacity_lost", demand=2.4, end=30.0, severity=Severity.CRITICAL))
    fourth, told = grouper.add(event("d", "chat", hint="capacity_saturated", explained=True, severity=Severity.INFO,
                                     end=40.0))  # fmt: skip
    assert first.group == second.group == third.group == fourth.group
    assert told[0].cause == "capacity_saturated" and told[0].severity is Severity.INFO and not told[0].pages
    # A fault load cannot cause, during the same surge, is its own group and pages.
    cache, told = grouper.add(event("e", "chat", hint="prefix_cache_ineffective", demand=2.0, end=50.0,
                                    signal=Signal.CACHE_HIT_RATE))  # fmt: skip
    assert cache.group != first.group and told[0].pages


def test_a_queue_at_usual_demand_is_not_the_load_story_and_pages() -> None:
    _, told = IncidentGrouper().add(event("a", "chat", hint="capacity_lost", demand=1.0))
    assert told[0].pages and not told[0].explained_by_load and told[0].cause == "capacity_lost"


def test_a_groups_severity_steps_up_at_once_and_down_only_after_it_held_a_while() -> None:
    grouper = IncidentGrouper(step_down_after_s=60.0)
    grouper.add(event("a", "chat"))
    _, told = grouper.add(event("b", "rag", end=20.0, severity=Severity.CRITICAL))
    assert told[0].severity is Severity.CRITICAL
    # The critical member resolves: the group stays critical for a minute of event time ...
    grouper.add(event("b", "rag", status=Status.RESOLVED, transition="resolved", end=30.0))
    _, told = grouper.add(event("c", "code", end=60.0))
    assert told[0].severity is Severity.CRITICAL
    # ... then steps down with the next record after it.
    _, told = grouper.add(event("d", "agent", end=100.0))
    assert told[0].severity is Severity.WARNING


def test_a_queue_whose_demand_only_the_latency_index_reads_high_is_not_the_load_story() -> None:
    """A few long prompts lift one window's demand index; the arrivals were as usual."""
    lost = event("a", "chat", hint="capacity_lost").model_copy(
        update={"load": {"demand_vs_usual": 1.36, "arrivals_vs_usual": 1.05, "running_vs_most": 0.58, "queue_s": 9.3}}
    )
    _, told = IncidentGrouper().add(lost)
    assert told[0].pages and told[0].cause == "capacity_lost"


def test_a_slower_decode_on_engines_that_are_usually_full_is_not_the_load_story() -> None:
    """Engines near full at their usual demand, with the usual short wait for a slot: a slower
    decode (or prefill) there is a fault; the queue is no part of inter-token latency."""
    slow = event("a", "chat", hint="decode_slowdown", signal=Signal.ITL).model_copy(
        update={"load": {"demand_vs_usual": 1.1, "arrivals_vs_usual": 1.04, "running_vs_most": 0.95, "queue_s": 0.02}}
    )
    _, told = IncidentGrouper().add(slow)
    assert told[0].pages and told[0].cause == "decode_slowdown"


@pytest.mark.parametrize(("arrivals_per_s", "pages"), [(2.4, True), (24.0, False)], ids=["2.4/s", "24/s"])
def test_a_blip_of_arrivals_that_counting_luck_explains_is_not_the_load_story(
    arrivals_per_s: float, pages: bool
) -> None:
    """Prefill slower per token while arrivals read 1.4x usual: at 24 requests a window where
    17 are usual, one window in twenty does that by luck, and the slowdown pages as its own
    cause; at 240 where 171 are usual it is a surge, and the slowdown is part of its story."""
    slow = event("a", "chat", hint="prefill_bound", signal=Signal.PREFILL_PER_TOKEN).model_copy(
        update={"load": {"demand_vs_usual": 1.43, "arrivals_vs_usual": 1.4, "model_arrivals_per_s": arrivals_per_s}}
    )
    _, told = IncidentGrouper().add(slow)
    assert told[0].pages is pages and told[0].explained_by_load is not pages
