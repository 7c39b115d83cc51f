"""Change verification end to end on the real embedded broker: a change marker posted to the shipper's
``POST /v1/changes`` lands on ``servewatch.changes``; a worker watching it compares the
requests after the change with those before (read back from Kafka), publishes interim and
final ``ChangeReport`` records, and, for a lower ``max_tokens``, pages the declared rollback
condition as a critical ``rollback_condition_met`` incident through the notifier's sinks
(real HTTP receivers on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from servewatch.pipeline import topics
from servewatch.pipeline.changes.store import parse_change_record, read_changes, write_marker
from servewatch.pipeline.dev.demo import start_worker, stop_worker
from servewatch.pipeline.dev.demo_sinks import DemoReceiver, start_receiver
from servewatch.pipeline.dev.receivers import read_log
from servewatch.pipeline.dev.simulator import EPOCH, Phase, Workload
from servewatch.pipeline.ingest.ship.http_endpoint import HttpSource
from servewatch.pipeline.kafka import ensure_topics, producer
from servewatch.schemas.anomaly import AnomalyEvent, Severity
from servewatch.schemas.change_marker import ChangeMarker
from servewatch.schemas.change_report import ChangeReport
from servewatch.schemas.incident_group import parse_anomaly_record
from tests.conftest import Broker, first_matching, own_broker

pytestmark = pytest.mark.integration
broker = own_broker  # event times of their own

MODEL = "chat-70b"
AT = EPOCH + 1800.0
# How long to wait for a record before calling it lost: a bound for hangs, not a speed
# test (two busy cores under the whole suite have taken more than 30 s to publish).
PATIENCE_S = 120.0
PARTITIONS = 4  # of each topic
CONFIG = """
before: 10m
after: 10m
check_every: 3m
resamples: 300
rollback:
  - {signal: truncation_share, worse_by: 1pt, scope: segment, min_requests: 200}
  - {signal: ttft_p95, worse_by: 20%, scope: segment, min_requests: 200}
"""


@pytest.fixture
def watching_worker(broker: Broker, tmp_path: Path) -> Iterator[tuple[str, DemoReceiver]]:
    asyncio.run(ensure_topics(broker.bootstrap, PARTITIONS))
    receiver = start_receiver(tmp_path)
    (tmp_path / "changes.yaml").write_text(CONFIG)
    process = start_worker(broker.bootstrap, {"SERVEWATCH_APP_ID": "servewatch-changes-test",
                                              "SERVEWATCH_LOG_LEVEL": "WARNING",
                                              "SERVEWATCH_NOTIFY_CONFIG": str(receiver.config),
                                              "SERVEWATCH_CHANGES_CONFIG": str(tmp_path / "changes.yaml")})  # fmt: skip
    try:
        yield broker.bootstrap, receiver
    finally:
        stop_worker(process)
        receiver.stop()


def records(phase: Phase, seed: int, start: float) -> list[dict[str, Any]]:
    workload = Workload(phases=(phase,), models=(MODEL,), base_rate=8.0, seed=seed, start=start)
    return [{**record, "request_id": f"{seed}-{record['request_id']}"} for record in workload.records()]


async def send(bootstrap: str, rows: list[dict[str, Any]]) -> None:
    """In batches of 400, dealt over the requests topic's partitions in turn: every partition's
    event time moves with the rows. (Left to the partitioner, a partition that drew none of
    the period after the change held its windows back until its event time crawled there with
    the wall clock, as an idle partition's does: minutes, about one run in ten.)"""
    client = producer(bootstrap)
    await client.start()
    try:
        for number, start in enumerate(range(0, len(rows), 400)):
            batch = orjson.dumps(rows[start : start + 400])
            await client.send(topics.REQUESTS, batch, partition=number % PARTITIONS)
        await client.flush()
    finally:
        await client.stop()


async def post_marker(bootstrap: str, body: Any) -> httpx.Response:
    async def publish(marker: ChangeMarker) -> None:
        await write_marker(bootstrap, marker)

    source = HttpSource(publish_marker=publish)
    await source.start()
    try:
        async with httpx.AsyncClient() as client:
            return await client.post(source.url.removesuffix("/requests") + "/changes", json=body)
    finally:
        await source.close()


def test_a_lower_max_tokens_is_verified_and_pages_its_rollback(watching_worker: tuple[str, DemoReceiver]) -> None:
    bootstrap, receiver = watching_worker
    before = records(Phase("wide", 700), 1, AT - 700)
    after = records(Phase("narrow", 700, max_tokens=400), 2, AT + 5)
    tail = [{**before[0], "request_id": "tick", "model": "other", "timestamp": AT + 900}]

    bad = asyncio.run(post_marker(bootstrap, {"model": MODEL}))
    assert bad.status_code == 422 and "description" in bad.text
    asyncio.run(send(bootstrap, before))
    answer = asyncio.run(post_marker(bootstrap, {"model": MODEL, "at": AT, "description": "max_tokens 4096 -> 400",
                                                 "labels": {"deploy": "d-17"}, "by": "ci"}))  # fmt: skip
    assert answer.status_code == 201, answer.text
    change = answer.json()["id"]

    def report_of(final: bool) -> Any:
        def match(raw: bytes) -> ChangeReport | None:
            parsed = parse_change_record(raw)
            ok = isinstance(parsed, ChangeReport) and parsed.change == change and parsed.final is final
            return parsed if ok else None  # type: ignore[return-value]

        return match

    half = len(after) // 2  # the first half of the period after: an interim report
    asyncio.run(send(bootstrap, after[:half]))
    interim = asyncio.run(first_matching(bootstrap, topics.CHANGES, report_of(False), timeout_s=PATIENCE_S))
    late = sum(row["timestamp"] >= AT for row in before)  # finished after the change: the period after's
    assert 0 < interim.after.requests <= half + late
    asyncio.run(send(bootstrap, after[half:] + tail))
    report = asyncio.run(first_matching(bootstrap, topics.CHANGES, report_of(True), timeout_s=PATIENCE_S))
    verdicts = {row.signal: row.verdict for row in report.signals}
    assert verdicts["truncation_share"] == "regressed" and verdicts["error_share"] == "no change"
    assert report.before.requests > 3000 and report.after.requests > 3000 and report.simultaneous
    holds = {check.condition.split()[0]: check.holds for check in report.rollback}
    assert holds == {"truncation_share": True, "ttft_p95": False}

    def rollback(raw: bytes) -> AnomalyEvent | None:
        record = parse_anomaly_record(raw)
        ok = isinstance(record, AnomalyEvent) and record.hints and record.hints[0].code == "rollback_condition_met"
        return record if ok else None  # type: ignore[return-value]

    event = asyncio.run(first_matching(bootstrap, topics.ANOMALIES, rollback, timeout_s=PATIENCE_S))
    assert event.severity is Severity.CRITICAL and event.change is not None and event.change.id == change
    assert event.segment["model"] == MODEL and all(row["finish_reason"] == "length" for row in event.evidence)

    # Through the notifier to the sinks: PagerDuty (critical only) was paged about it.
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        pages = [line for line in read_log(receiver.log) if line["kind"] == "pagerduty"]
        if any("rollback" in orjson.dumps(line["body"]).decode() for line in pages):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"no PagerDuty page about the rollback: {read_log(receiver.log)[-3:]}")

    # The detectors' own incident on the truncations names the change as its first suspect.
    def named(raw: bytes) -> AnomalyEvent | None:
        record = parse_anomaly_record(raw)
        ok = isinstance(record, AnomalyEvent) and record.change is not None and record.hints[0].code == "change_marker"
        return record if ok else None  # type: ignore[return-value]

    incident = asyncio.run(first_matching(bootstrap, topics.ANOMALIES, named, timeout_s=PATIENCE_S))
    assert incident.change is not None and incident.change.id == change and incident.segment["model"] == MODEL
    assert "after change" in incident.hints[0].message and incident.window_start >= AT

    markers, _ = asyncio.run(read_changes(bootstrap))
    (marker,) = [m for m in markers if m.id == change]
    assert marker.source == "http" and marker.labels == {"deploy": "d-17"} and marker.at == AT
