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
