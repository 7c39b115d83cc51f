"""End to end on the real embedded broker: shipper-style producer -> Faust worker -> anomaly topic.

The worker runs as its own process (``servewatch worker``), exactly as users run it.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import orjson
import pytest

from servewatch.pipeline import topics
from servewatch.pipeline.dev.demo import play, start_worker, stop_worker
from servewatch.pipeline.dev.demo_sinks import DemoReceiver
from servewatch.pipeline.dev.receivers import read_log
from servewatch.pipeline.dev.simulator import Phase, Workload
from servewatch.pipeline.kafka import ensure_topics, producer
from servewatch.pipeline.worker.metrics import served_value
from servewatch.schemas.anomaly import AnomalyEvent, Signal
from servewatch.schemas.dead_letter import DeadLetter
from servewatch.schemas.incident_group import parse_anomaly_record
from servewatch.schemas.series import SeriesPoint
from tests.conftest import Broker, first_matching, new_broker

pytestmark = pytest.mark.integration
T = TypeVar("T")


def test_cache_off_incident_reaches_the_anomaly_topic_and_bad_input_the_dead_letters(
    notifying_worker: tuple[str, DemoReceiver],
) -> None:
    bootstrap, receiver = notifying_worker
    workload = Workload((Phase("normal", 240), Phase("cache_off", 150, prefix_caching=False)), seed=21)

    async def scenario() -> tuple[AnomalyEvent, DeadLetter]:
        prod = producer(bootstrap)
        await prod.start()
        try:
            await prod.send_and_wait(topics.REQUESTS, b'{"request_id": "broken", "prompt_tokens": -5')
            await prod.send_and_wait(topics.REQUESTS, orjson.dumps([{"request_id": "no-fields"}]))
        finally:
            await prod.stop()
        await play(bootstrap, workload, speed=60.0)

        def paging_ttft(raw: bytes) -> AnomalyEvent | None:
            event = parse_anomaly_record(raw)
            if not isinstance(event, AnomalyEvent):
                return None  # an incident group's record
            return event if event.signal is Signal.TTFT and event.pages else None

        def banded_ttft(raw: bytes) -> SeriesPoint | None:
            point = SeriesPoint.model_validate_json(raw)
            return point if "ttft" in point.signals and point.signals["ttft"].low else None

        def broken(raw: bytes) -> DeadLetter | None:
            letter = DeadLetter.model_validate_json(raw)
            return letter if letter.reason == "invalid_json" else None

        event = await first_matching(bootstrap, topics.ANOMALIES, paging_ttft, timeout_s=90)
        # Every judged window goes out as a chart point, with the band the window was judged by.
        point = await first_matching(bootstrap, topics.SERIES, banded_ttft, timeout_s=30)
        assert point.signals["ttft"].low is not None and point.signals["ttft"].high is not None
        letter = await first_matching(bootstrap, topics.DEADLETTER, broken, timeout_s=30)
        return event, letter

    event, letter = asyncio.run(scenario())
    assert not event.explained_by_load
    assert event.hints[0].code == "prefix_cache_ineffective"
    assert event.evidence and event.evidence[0]["ttft_s"] >= event.observed * 0.5
    # Windows keep evidence by location; the worker read the records back from the requests topic.
    assert {"request_id", "model", "location"} <= event.evidence[0].keys() and "unavailable" not in event.evidence[0]
    assert letter.source_topic == topics.REQUESTS and letter.source_offset is not None
    assert "prompt_tokens" in letter.raw
    # The worker's notifier paged PagerDuty for the group, and told Slack, once the group's wait passed.
    pages = wait_for_log(receiver, lambda lines: [r["body"] for r in lines if r["kind"] == "pagerduty"])
    assert {page["payload"]["group"] for page in pages} == {"prefix_cache_ineffective"}
    models = {page["payload"]["component"] for page in pages}
    assert len({page["dedup_key"] for page in pages}) == len(models)  # per model, one cause: one page
    slack = wait_for_log(receiver, lambda lines: [r for r in lines if r["kind"] == "slack"])
    assert any("prefix_cache_ineffective" in orjson.dumps(r["body"]).decode() for r in slack)


def wait_for_log(receiver: DemoReceiver, pick: Callable[[list[dict]], list], timeout_s: float = 30.0) -> list:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout_s
    while not (found := pick(read_log(receiver.log))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert found, f"nothing in {receiver.log} after {timeout_s:.0f} s"
    return found


def test_validation_failures_are_dead_lettered_with_their_reason(worker: str) -> None:
    bootstrap = worker

    async def scenario() -> DeadLetter:
        prod = producer(bootstrap)
        await prod.start()
        try:
            await prod.send_and_wait(topics.REQUESTS, orjson.dumps([{"request_id": "no-fields-2"}]))
        finally:
            await prod.stop()

        def mine(raw: bytes) -> DeadLetter | None:
            letter = DeadLetter.model_validate_json(raw)
            return letter if "no-fields-2" in letter.raw else None

        return await first_matching(bootstrap, topics.DEADLETTER, mine, timeout_s=60)

    letter = asyncio.run(scenario())
    assert letter.reason == "validation" and letter.record_index == 0
    assert "model" in letter.error and "timestamp" in letter.error


def test_embedded_broker_starts_and_stops_cleanly() -> None:
    with new_broker() as second:
        assert second.running
    assert not second.running


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout_s} s")
        time.sleep(0.2)


def test_detector_state_survives_a_restart() -> None:
    """A worker stopped after learning and a new one in its place: the new one restores every
    segment's state from the changelog-backed table and judges the next incident with a
    grown-up baseline (cold, it would stay quiet for its grace windows and then say 'young').

    Its own broker: other tests' request logs share event times and segments with these.
    """
    with new_broker() as broker:
        restart_and_judge(broker)


def restart_and_judge(broker: Broker) -> None:
    from servewatch.pipeline.dev.broker import free_loopback_port
    from servewatch.pipeline.dev.simulator import EPOCH

    asyncio.run(ensure_topics(broker.bootstrap, 4))
    app_id = f"servewatch-restart-{uuid.uuid4().hex[:8]}"
    normal = Workload((Phase("normal", 420),), seed=31)
    broken = Workload((Phase("cache_off", 120, prefix_caching=False),), seed=32, start=EPOCH + 440)

    def run_worker(port: int) -> subprocess.Popen[bytes]:
        env = {"SERVEWATCH_APP_ID": app_id, "SERVEWATCH_METRICS_PORT": str(port), "SERVEWATCH_LOG_LEVEL": "WARNING"}
        return start_worker(broker.bootstrap, env)

    first_port = free_loopback_port()
    first = run_worker(first_port)
    try:
        asyncio.run(play(broker.bootstrap, normal, speed=100.0))
        wait_until(lambda: served_value(first_port, "servewatch_windows_total") >= 150, timeout_s=60)
    finally:
        stop_worker(first)

    second_port = free_loopback_port()
    second = run_worker(second_port)
    try:
        asyncio.run(play(broker.bootstrap, broken, speed=30.0))

        def paging_ttft(raw: bytes) -> AnomalyEvent | None:
            # A segment of the restored state: a sparse one has too few windows behind it
            # either way (young below 30), and may page first; the others must page at once.
            event = parse_anomaly_record(raw)
            if not isinstance(event, AnomalyEvent):
                return None  # an incident group's record
            mine = event.window_start >= EPOCH + 440 and event.signal is Signal.TTFT and event.pages
            return event if mine and not event.baseline_young else None

        event = asyncio.run(first_matching(broker.bootstrap, topics.ANOMALIES, paging_ttft, timeout_s=90))
        # Each segment's state is restored as its first window after the restart is judged: the
        # page may come from the first segment judged (a cache-off TTFT fires with the cache),
        # before the others had a window.
        wait_until(lambda: served_value(second_port, "servewatch_restored_segments") >= 4, timeout_s=60)
    finally:
        stop_worker(second)
    # Judged against the baseline learned before the restart, with no grace period after it.
    assert event.window_start - (EPOCH + 440) <= 40, "no grace period after the restart"


def test_engine_metrics_on_the_scrapes_topic_page_a_capacity_incident(worker: str) -> None:
    """EngineIntervals as ``servewatch scrape`` publishes them (keyed ``instance|model``):
    a KV cache that fills at the same load pages kv_cache_usage, with the engine's labels."""
    import random

    from tests.test_engine_stage import interval

    instance = f"gpu-{uuid.uuid4().hex[:6]}:8000"
    rng = random.Random(5)
    fault = {"kv_cache_usage": 0.99, "waiting": 40.0, "preemptions_per_s": 3.0}
    phases = [(60, {}), (6, fault)]
    values = [orjson.dumps(interval(i, rng, instance=instance, **f)) for i, f in
              enumerate(f for count, f in phases for _ in range(count))]  # fmt: skip

    async def send() -> None:
        async with producer(worker) as kafka:
            for value in values:
                await kafka.send(topics.SCRAPES, value, key=f"{instance}|qwen".encode())
            await kafka.send(topics.SCRAPES, b"{not json", key=f"{instance}|qwen".encode())

    asyncio.run(send())

    def capacity_page(raw: bytes) -> AnomalyEvent | None:
        event = parse_anomaly_record(raw)
        if not isinstance(event, AnomalyEvent):
            return None  # an incident group's record
        mine = event.segment.get("instance") == instance and event.signal is Signal.KV_CACHE_USAGE and event.pages
        return event if mine else None

    event = asyncio.run(first_matching(worker, topics.ANOMALIES, capacity_page, timeout_s=60))
    assert event.segment["model"] == "qwen" and event.hints[0].code == "kv_cache_pressure"

    def bad_scrape(raw: bytes) -> DeadLetter | None:
        letter = DeadLetter.model_validate_json(raw)
        return letter if letter.source_topic == topics.SCRAPES and letter.reason == "invalid_json" else None

    assert asyncio.run(first_matching(worker, topics.DEADLETTER, bad_scrape, timeout_s=30))


def test_a_truncation_page_carries_the_truncated_requests_read_back_from_the_topic(worker: str) -> None:
    """A rate event's evidence: the worker scans the window's own messages on the requests
    topic for the requests it counted, and quotes answers only as scrubbed excerpts."""
    from servewatch.pipeline.dev.simulator import EPOCH

    # Event times of its own: other tests' request logs on this topic share EPOCH and segments.
    phases = (Phase("normal", 240), Phase("truncation", 150, max_tokens=1000, leak_rate=0.03))
    workload = Workload(phases, seed=23, log_content=True, start=EPOCH + 86_400)
    asyncio.run(play(worker, workload, speed=60.0))

    def truncation_page(raw: bytes) -> AnomalyEvent | None:
        event = parse_anomaly_record(raw)
        if not isinstance(event, AnomalyEvent):
            return None  # an incident group's record
        mine = event.window_start >= EPOCH + 86_400 and event.signal is Signal.LENGTH_TRUNCATION
        return event if mine and event.pages else None

    event = asyncio.run(first_matching(worker, topics.ANOMALIES, truncation_page, timeout_s=90))
    assert event.hints[0].code == "output_truncated"
    cut = [r for r in event.evidence if r["sample"] == "faulty"]
    assert cut and all(r["finish_reason"] == "length" for r in cut)
    assert all("location" in r and "request_id" in r for r in event.evidence)
    assert all(len(r.get("content_excerpt", "")) <= 200 for r in event.evidence)
    # ... and a sample of the window and of the latest normal one before it, read back the same way.
    assert {r["sample"] for r in event.evidence} == {"faulty", "uniform", "baseline"}
    assert all(r["timestamp"] < event.window_start for r in event.evidence if r["sample"] == "baseline")
    assert event.facets is not None and event.facets.anomalous and event.facets.baseline
