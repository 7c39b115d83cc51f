"""The Faust agents' wiring, with Faust's ``test_context()`` (no broker; sends are captured)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from prometheus_client import REGISTRY

from servewatch.models.windows.wire import windows_from_wire
from servewatch.pipeline.dev.simulator import Phase, Workload
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.worker import create_app
from servewatch.pipeline.worker.stage_one import StageOne
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.dead_letter import DeadLetter
from servewatch.schemas.incident_group import IncidentGroup, parse_anomaly_record
from servewatch.schemas.series import SeriesPoint


class Captured:
    """Stands in for ``Topic.send``: records what would have been produced."""

    def __init__(self) -> None:
        self.values: list[bytes] = []

    async def __call__(self, *, key: Any = None, value: bytes, partition: int | None = None) -> asyncio.Future[None]:
        self.values.append(value)
        # As ``Topic.send``: awaiting the send queues the record, awaiting its result waits for delivery.
        delivered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        delivered.set_result(None)
        return delivered


@pytest.fixture
def app_and_sinks(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, dict[str, Captured]]:
    # The requests topic read by a Faust agent (the batch reader needs a broker: test_batch_reader_kafka).
    app, topics = create_app(Settings(broker="127.0.0.1:9", topic_partitions=1, batch_reader=False))
    sinks = {name: Captured() for name in ("partials", "incidents", "anomalies", "deadletter", "series")}
    for name, sink in sinks.items():
        monkeypatch.setattr(getattr(topics, name), "send", sink)
    return app, sinks


async def test_bad_message_is_dead_lettered_and_the_agent_keeps_going(app_and_sinks: Any) -> None:
    app, sinks = app_and_sinks
    agent = app.agents["servewatch.pipeline.worker.app.aggregate_request_batches"]
    good = {"request_id": "ok", "timestamp": 1767225600, "model": "m", "prompt_tokens": 5, "completion_tokens": 1,
            "e2e_s": 0.5, "finish_reason": "stop", "ttft_s": 0.1, "instance": "10.0.0.1:8000"}  # fmt: skip
    async with agent.test_context() as running:
        await running.put(b"{not json")
        await running.put(orjson.dumps([good, {**good, "prompt_tokens": -1}]))
        await running.put(orjson.dumps({**good, "timestamp": 1767225700}))  # moves the watermark on
    letters = [DeadLetter.model_validate_json(v) for v in sinks["deadletter"].values]
    assert [(d.reason, d.record_index) for d in letters] == [("invalid_json", None), ("validation", 1)]
    bundles = [orjson.loads(v) for v in sinks["partials"].values]
    # The segment's partial, and its replica row (the same record, by instance: ``models.detect.replicas``).
    partials = [w for b in bundles for w in windows_from_wire(b["windows"])]
    assert [(w.key.startswith("~replica|"), w.requests) for w in partials] == [(False, 1), (True, 1)]
    assert any(b["watermarks"] for b in bundles)


async def test_partials_in_anomalies_out(app_and_sinks: Any) -> None:
    """Stage 2's agent turns a cache-off scenario's partials into a paging TTFT event."""
    app, sinks = app_and_sinks
    stage_one = StageOne(Settings(topic_partitions=1))
    messages: list[bytes] = []
    workload = Workload((Phase("normal", 300), Phase("cache_off", 120, prefix_caching=False)), seed=8)
    for offset, (_, batch) in enumerate(workload.seconds()):
        _, partials = stage_one.process(orjson.dumps(batch), MessageOrigin("t", 0, offset), now=0.0)
        messages += [bundle for _, bundle in stage_one.bundles(partials, 1)]
    agent = app.agents["servewatch.pipeline.worker.app.detect_anomalies"]
    async with agent.test_context() as running:
        await running.put(b"garbage that is not a bundle")  # logged and dropped, never fatal
        await running.put(b'{"partials": [{"key": 1}], "watermarks": {}}')
        await running.put(b'{"windows": [{"keys": ["k"], "sums": [[1, 2]]}], "watermarks": {}}')
        for message in messages:
            await running.put(message)
    incidents = [AnomalyEvent.model_validate_json(v) for v in sinks["incidents"].values]
    assert any(e.pages and e.signal.value == "ttft" for e in incidents)
    # The grouping agent: each incident event on, with its group, and the groups' own records.
    # A record it cannot read is dead-lettered and counted, and grouping goes on; one from a
    # newer minor version (a field this one does not know) is read.
    newer = orjson.dumps({**orjson.loads(sinks["incidents"].values[0]), "added_by_next_version": 1})
    unreadable = [b"{not json", orjson.dumps({"kind": "incident", "signal": "no such signal"}), b'{"kind": "group"}']
    letters_before = dead_letters("invalid_incident")
    async with app.agents["servewatch.pipeline.worker.app.group_incidents"].test_context() as running:
        for value in [*unreadable, newer, *sinks["incidents"].values[1:]]:
            await running.put(value)
    letters = [DeadLetter.model_validate_json(v) for v in sinks["deadletter"].values]
    assert [d.reason for d in letters] == ["invalid_incident"] * 3 and "signal" in letters[1].error
    assert dead_letters("invalid_incident") == letters_before + 3
    records = [parse_anomaly_record(v) for v in sinks["anomalies"].values]
    points = [SeriesPoint.model_validate_json(v) for v in sinks["series"].values]
    assert {p.segment["model"] for p in points} and all(p.signals for p in points)  # chart points go out too
    events = [r for r in records if isinstance(r, AnomalyEvent)]
    groups = [r for r in records if isinstance(r, IncidentGroup)]
    assert len(events) == len(incidents) and all(e.group for e in events)
    assert groups and groups[0].transition == "firing" and groups[0].cause == "prefix_cache_ineffective"


def dead_letters(reason: str) -> float:
    return REGISTRY.get_sample_value("servewatch_dead_letters_total", {"reason": reason}) or 0.0


def test_dead_letters_are_counted_by_reason() -> None:
    before = dead_letters("invalid_json"), dead_letters("too_large")
    stage = StageOne(Settings(max_message_bytes=1024))
    stage.process(b"{nope", MessageOrigin("t", 0, 0))
    stage.process(b"[" + b" " * 2000 + b"]", MessageOrigin("t", 0, 1))
    assert (dead_letters("invalid_json"), dead_letters("too_large")) == (before[0] + 1, before[1] + 1)
