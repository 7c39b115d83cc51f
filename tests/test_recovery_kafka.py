"""Crash recovery on the real embedded broker: ``kill -9`` of one of two workers
while an incident fires. The survivor takes the dead worker's partitions over (its
RocksDB-backed state table restored from the changelog), no incident is lost or opened
twice, and every partition's committed offset reaches its end: each record was folded into
a window that was sent on. Recovery *times* are measured by ``bench/recovery.py``; tests
assert behaviour, never wall-clock times."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections import defaultdict

import orjson
import pytest

from servewatch.pipeline import topics
from servewatch.pipeline.dev.broker import free_loopback_port
from servewatch.pipeline.dev.demo import play, start_worker, stop_worker
from servewatch.pipeline.dev.simulator import Phase, Workload
from servewatch.pipeline.kafka import ensure_topics, producer, read_topic
from servewatch.pipeline.worker.metrics import served_value
from servewatch.schemas.anomaly import AnomalyEvent, Signal, Status
from servewatch.schemas.incident_group import parse_anomaly_record
from tests.conftest import lagging_partitions, new_broker

pytestmark = pytest.mark.integration

PARTITIONS = 4


async def _events_until_resolved(bootstrap: str, timeout_s: float) -> list[AnomalyEvent]:
    """Incident events of the anomaly topic, read until every TTFT incident that fired has
    resolved, and a few seconds more for stragglers (or ``timeout_s``)."""
    events: list[AnomalyEvent] = []

    def settled() -> bool:
        fired = {e.fingerprint for e in events if e.signal is Signal.TTFT and e.transition == "firing"}
        return bool(fired) and fired <= {e.fingerprint for e in events if e.status is Status.RESOLVED}

    async def collect() -> None:
        async for raw in read_topic(bootstrap, topics.ANOMALIES):
            record = parse_anomaly_record(raw)
            if isinstance(record, AnomalyEvent):
                events.append(record)

    task = asyncio.create_task(collect())
    deadline = time.monotonic() + timeout_s
    while not settled() and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    await asyncio.sleep(3.0)
    task.cancel()
    return events


def test_kill_9_of_one_of_two_workers_loses_and_doubles_no_incident() -> None:
    workload = Workload(
        (Phase("normal", 240), Phase("cache_off", 180, prefix_caching=False), Phase("normal", 150)), seed=41
    )
    with new_broker() as broker:
        asyncio.run(ensure_topics(broker.bootstrap, PARTITIONS))
        group = f"servewatch-crash-{uuid.uuid4().hex[:8]}"
        ports = [free_loopback_port(), free_loopback_port()]
        # Lateness learned from 2 s, not 10: in-order traffic, and the last windows close sooner.
        env = {"SERVEWATCH_APP_ID": group, "SERVEWATCH_STORE": "rocksdb://", "SERVEWATCH_LOG_LEVEL": "ERROR",
               "SERVEWATCH_LATENESS_PRIOR_S": "2"}  # fmt: skip
        workers = [start_worker(broker.bootstrap, {**env, "SERVEWATCH_METRICS_PORT": str(port)}) for port in ports]
        try:
            deadline = time.monotonic() + 60  # both workers in the group before the traffic starts
            while not all(served_value(port, "servewatch_live_segments") == 0 and _up(port) for port in ports):
                assert time.monotonic() < deadline, "workers did not come up"
                time.sleep(0.5)
            time.sleep(6)  # the group's first rebalance
            producer = threading.Thread(target=lambda: asyncio.run(play(broker.bootstrap, workload, speed=30.0)))
            producer.start()

            # Wait for the incident to fire, then kill the worker that judged more windows.
            deadline = time.monotonic() + 90
            while not any(served_value(port, "servewatch_anomaly_events_total") for port in ports):
                assert time.monotonic() < deadline, "no incident fired before the crash"
                time.sleep(0.5)
            victim = max((0, 1), key=lambda k: served_value(ports[k], "servewatch_windows_total"))
            os.kill(workers[victim].pid, signal.SIGKILL)
            workers[victim].wait()
            survivor = ports[1 - victim]
            producer.join(timeout=120)
            # The synthetic workload's last requests finish up to a minute after it ends; a
            # request a while later on every partition closes their windows now, rather
            # than at the wall clock's pace (a live stream does that by itself).
            asyncio.run(_later_request_on_every_partition(broker.bootstrap, workload.start + workload.duration_s + 120))

            deadline = time.monotonic() + 120
            lagging = asyncio.run(lagging_partitions(broker.bootstrap, group, spare=1))
            while lagging and time.monotonic() < deadline:
                time.sleep(1)
                lagging = asyncio.run(lagging_partitions(broker.bootstrap, group, spare=1))
            assert lagging == {}, f"the survivor did not take every partition to its end: {lagging}"
            events = asyncio.run(_events_until_resolved(broker.bootstrap, timeout_s=60))
            restored = served_value(survivor, "servewatch_restored_segments")
            assert workers[1 - victim].poll() is None, "the survivor exited (a crash: its log is above)"
        finally:
            for worker in workers:
                stop_worker(worker)

    assert restored > 0, "the survivor restored the dead worker's segments from the state table"
    # A consumer dedups on (fingerprint, status, window); an incident is one fingerprint.
    unique = {(e.fingerprint, e.status, e.window_start): e for e in events}.values()
    firing: dict[tuple[str, Signal], set[str]] = defaultdict(set)
    resolved: set[str] = set()
    for event in unique:
        if event.transition == "firing":
            firing[(str(sorted(event.segment.items())), event.signal)].add(event.fingerprint)
        if event.status is Status.RESOLVED:
            resolved.add(event.fingerprint)
    ttft = {key: fps for key, fps in firing.items() if key[1] is Signal.TTFT}
    assert ttft, "the cache-off incident paged"
    doubled = {key: fps for key, fps in firing.items() if len(fps) > 1}
    assert not doubled, f"incidents opened twice across the crash: {doubled}"
    lost = {fp for fps in ttft.values() for fp in fps} - resolved
    assert not lost, f"TTFT incidents never resolved after the fault ended: {lost}"


async def _later_request_on_every_partition(bootstrap: str, timestamp: float) -> None:
    prod = producer(bootstrap)
    await prod.start()
    try:
        for partition in range(PARTITIONS):
            record = {"request_id": f"later-{partition}", "timestamp": timestamp, "model": "m", "prompt_tokens": 10,
                      "completion_tokens": 5, "e2e_s": 0.5, "finish_reason": "stop"}  # fmt: skip
            await prod.send_and_wait(topics.REQUESTS, orjson.dumps([record]), partition=partition)
    finally:
        await prod.stop()


def _up(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1):
            return True
    except OSError:
        return False
