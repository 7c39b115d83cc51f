"""``servewatch tail`` (the notifier's reader for people): the anomaly topic, filtered, readable or JSON."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from servewatch.models.detect.events import incident_event
from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.models.detect.lifecycle import Transition
from servewatch.pipeline import topics
from servewatch.pipeline.cli.main import main
from servewatch.pipeline.cli.tail import RESET, Filters, render
from servewatch.pipeline.kafka import ensure_topics, producer
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal
from tests.conftest import new_broker

T0 = 1_767_225_600.0


def event(model: str, signal: Signal, severity: Severity, start: float = T0) -> AnomalyEvent:
    return incident_event(
        key=f"model={model}", signal=signal, incident_start=start, transition=Transition.FIRING,
        labels={"model": model, "route": "chat"}, window=(start, start + 10), observed=2.0, expected=0.5,
        score=9.0, severity=severity, summary=f"{signal.value} of {model} is up.",
        hints=[Hint(code="prefix_cache_ineffective", message="check enable_prefix_caching")],
    )  # fmt: skip


def test_filters_combine_on_events_and_groups() -> None:
    page = event("m1", Signal.TTFT, Severity.CRITICAL)
    note = event("m2", Signal.ERROR_RATE, Severity.INFO)
    _, (group,) = IncidentGrouper().add(page)
    assert Filters().keep(page) and Filters().keep(note) and Filters().keep(group)
    assert [Filters(model="m1").keep(r) for r in (page, note, group)] == [True, False, True]
    assert [Filters(signal="ttft").keep(r) for r in (page, note, group)] == [True, False, True]
    assert [Filters(severity="warning").keep(r) for r in (page, note, group)] == [True, False, True]
    assert Filters(paging_only=True).keep(note) is note.pages


def test_colour_marks_the_head_line_only_and_never_when_asked_not_to() -> None:
    page = event("m1", Signal.TTFT, Severity.CRITICAL)
    plain, coloured = render(page, colour=False), render(page, colour=True)
    assert "\033[" not in plain and plain.splitlines()[1:] == coloured.splitlines()[1:]
    assert coloured.startswith("\033[1;31m") and coloured.splitlines()[0].endswith(RESET)


@pytest.mark.integration
def test_tail_reads_the_topic_filtered(capsys: pytest.CaptureFixture[str]) -> None:
    records = [event("m2", Signal.ERROR_RATE, Severity.INFO), event("m1", Signal.TTFT, Severity.CRITICAL)]
    _, groups = IncidentGrouper().add(records[1])
    with new_broker() as broker:
        asyncio.run(ensure_topics(broker.bootstrap, 1, (topics.ANOMALIES,)))

        async def publish() -> None:
            prod = producer(broker.bootstrap)
            await prod.start()
            try:
                for record in [*records, *groups]:
                    await prod.send_and_wait(topics.ANOMALIES, record.model_dump_json().encode())
            finally:
                await prod.stop()

        asyncio.run(publish())
        argv = ["tail", "--broker", broker.bootstrap, "--from-beginning", "--model", "m1", "--count", "2"]
        assert main([*argv, "--format", "json"]) == 0
        shown = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [r.get("kind") for r in shown] == ["incident", "group"]
        assert main(argv) == 0
        text = capsys.readouterr().out
        assert "CRITICAL" not in text and "FIRING   critical ttft" in text and ">> group FIRING" in text
        assert "\033[" not in text  # captured, not a terminal: no colour
