"""The event-time contract on the real embedded broker: hosts 5 s and 30 s behind
are judged, future-dated records are dead-lettered, every partition's committed offset
reaches its end, and the worker accounts for every record it accepted."""

from __future__ import annotations

import asyncio
import time
import uuid

import orjson
import pytest

from servewatch.pipeline import topics
from servewatch.pipeline.dev.broker import free_loopback_port
from servewatch.pipeline.dev.demo import start_worker, stop_worker
from servewatch.pipeline.kafka import ensure_topics, producer
from servewatch.pipeline.worker.metrics import served_value
from servewatch.schemas.dead_letter import DeadLetter
from tests.conftest import first_matching, lagging_partitions, new_broker

pytestmark = pytest.mark.integration

PARTITIONS = 4
SECONDS = 90
BEHIND = {"on-time": 0.0, "behind-5s": 5.0, "behind-30s": 30.0}


def _record(host: str, n: int, ts: float) -> dict[str, object]:
    return {"request_id": f"{host}-{n}", "timestamp": ts, "model": "m", "instance": host, "prompt_tokens": 800,
            "completion_tokens": 60, "e2e_s": 1.5, "ttft_s": 0.3, "finish_reason": "stop"}  # fmt: skip


async def _produce(bootstrap: str, start: float) -> int:
    """Every host writes to every partition, a message per partition per second of event
    time, each host's records stamped by its own (skewed) clock; then two future records."""
    prod = producer(bootstrap)
    await prod.start()
    sent = 0
    try:
        for second in range(SECONDS):
            for partition in range(PARTITIONS):
                rows = [_record(host, second * 100 + partition * 10 + i, start + second + i / 10 - behind)
                        for host, behind in BEHIND.items() for i in range(5)]  # fmt: skip
                await prod.send_and_wait(topics.REQUESTS, orjson.dumps(rows), partition=partition)
                sent += len(rows)
            if second == SECONDS // 2:
                future = [_record("bad-clock", 1, time.time() + 3600), _record("bad-clock", 2, 4_070_908_800.0)]
                await prod.send_and_wait(topics.REQUESTS, orjson.dumps(future), partition=1)
        # A request two minutes later on every partition closes the windows above at once
        # (silence would close them at the wall clock's pace, the lateness of the 30 s host
        # and a window after the end); it stays in its own open window, unjudged.
        for partition in range(PARTITIONS):
            later = [_record("later", partition, start + SECONDS + 120)]
            await prod.send_and_wait(topics.REQUESTS, orjson.dumps(later), partition=partition)
    finally:
        await prod.stop()
    return sent


def test_skewed_hosts_are_judged_future_records_dead_lettered_and_offsets_committed() -> None:
    with new_broker() as broker:
        asyncio.run(ensure_topics(broker.bootstrap, PARTITIONS))
        group, port = f"servewatch-et-{uuid.uuid4().hex[:8]}", free_loopback_port()
        worker = start_worker(broker.bootstrap, {"SERVEWATCH_APP_ID": group, "SERVEWATCH_METRICS_PORT": str(port)})
        try:
            sent = asyncio.run(_produce(broker.bootstrap, time.time() - SECONDS - 60))

            def metric(name: str) -> float:
                return served_value(port, name)

            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:  # until every accepted record is accounted for
                accepted = metric("servewatch_records_total")
                done = sum(metric(f"servewatch_{k}_total") for k in ("judged_records", "late_records",
                                                                      "duplicate_records"))  # fmt: skip
                if accepted == sent + PARTITIONS and done == sent:
                    break
                time.sleep(1)
            judged, late = metric("servewatch_judged_records_total"), metric("servewatch_late_records_total")
            assert accepted == sent + PARTITIONS and judged + late == sent, (accepted, judged, late, sent)
            assert late <= 0.05 * sent  # the lateness learned the 30 s host; at most its first seconds
            future = metric("servewatch_dead_letters_total")
            assert future == 2

            def is_future(raw: bytes) -> DeadLetter | None:
                letter = DeadLetter.model_validate_json(raw)
                return letter if letter.reason == "future_timestamp" else None

            letter = asyncio.run(first_matching(broker.bootstrap, topics.DEADLETTER, is_future, timeout_s=20))
            assert letter.source_partition == 1 and "bad-clock" in letter.raw

            deadline = time.monotonic() + 60
            lagging = asyncio.run(lagging_partitions(broker.bootstrap, group, spare=1))
            while lagging and time.monotonic() < deadline:
                time.sleep(1)
                lagging = asyncio.run(lagging_partitions(broker.bootstrap, group, spare=1))
            assert lagging == {}, f"partitions not committed to their end (but the later request): {lagging}"
        finally:
            stop_worker(worker)
