"""The terminal view of anomaly records (the demo's live view, ``replay --format text``, ``tail``)."""

from __future__ import annotations

from servewatch.models.explain.event_text import event_text
from servewatch.schemas.anomaly import Status
from tests.test_grouping import event


def test_each_step_reads_as_what_it_is_a_resolve_never_as_an_update() -> None:
    firing = event("a", "chat")
    update = event("a", "chat", transition="update")
    resolved = event("a", "chat", status=Status.RESOLVED, transition="resolved")
    assert "FIRING" in event_text(firing, "t+00:10")
    assert "UPDATE" in event_text(update, "t+00:20") and "UPDATE" in event_text(firing, "t+00:20", update=True)
    # Shown after the incident's earlier events (update=True), its resolve still says so.
    assert "RESOLVED" in event_text(resolved, "t+00:30", update=True) and "UPDATE" not in event_text(
        resolved, "t+00:30", update=True
    )


def test_the_triage_page_shows_each_value_with_its_unit() -> None:
    from servewatch.pipeline.web.render import value_text

    assert value_text("ttft", 0.85) == "850 ms" and value_text("ttft", 2.1) == "2.10 s"
    assert value_text("error_rate", 0.002) == "0.20%"
    assert value_text("throughput", 45.0) == "45.0 tokens/s"
    assert value_text("a_signal_of_a_newer_version", 1.5) == "1.5" and value_text("ttft", None) == "–"


def test_a_resolved_incidents_page_says_where_its_requests_are_not_just_none() -> None:
    from servewatch.pipeline.web.detail import evidence_table
    from servewatch.pipeline.web.links import LinkTemplates

    text = evidence_table([], {"model": "m"}, LinkTemplates())
    assert "see the incident's firing event" in text and "none kept" not in text


def test_the_demos_page_count_is_what_a_pager_received_groups_and_rollback_conditions() -> None:
    # Two incidents of one group page once; a rollback condition, which the change watcher
    # publishes beside the groups, is a page of its own (PagerDuty receives it as an incident);
    # resolves and info events page no one.
    from servewatch.models.detect.grouping import IncidentGrouper
    from servewatch.pipeline.dev.demo import DemoOutcome, summarise
    from servewatch.schemas.anomaly import Severity

    grouper, outcome = IncidentGrouper(), DemoOutcome()
    for record in (
        event("a", "chat", hint="prefix_cache_ineffective"),
        event("b", "rag", hint="prefix_cache_ineffective", end=20.0),
        event("a", "chat", status=Status.RESOLVED, transition="resolved", end=60.0),
        event("c", "chat", hint="capacity_saturated", explained=True, severity=Severity.INFO, end=30.0),
    ):
        record, told = grouper.add(record)
        outcome.events.append(record)
        outcome.groups.extend(told)
    outcome.events.append(event("r", "chat", hint="rollback_condition_met", severity=Severity.CRITICAL, end=40.0))
    assert summarise(outcome)[0].startswith("2 pages: 1 incident groups (one page each, from 2 incidents")
    assert summarise(outcome)[0].endswith("and 1 rollback conditions:")
