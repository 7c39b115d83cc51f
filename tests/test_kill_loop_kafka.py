"""A kill loop on the real broker: one worker, killed with SIGKILL at random points (and once
right after its first incident fires) and restarted at once, at least ``KILLS`` times while a
workload with a fault plays. Every incident that ``servewatch replay`` reports firing on the
same records must reach the anomaly topic firing: at-least-once may publish an incident
twice, never lose one. The worker's state (RocksDB under a fixed data dir, and the table's
changelog) and its committed offsets are all that survive each kill, as in production."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from servewatch.pipeline import topics
from servewatch.pipeline.dev.broker import free_loopback_port
from servewatch.pipeline.dev.demo import play, start_worker, stop_worker
from servewatch.pipeline.dev.simulator import Phase, Workload
from servewatch.pipeline.kafka import ensure_topics, follow_topic
from servewatch.pipeline.worker.metrics import served_value
from servewatch.schemas.anomaly import AnomalyEvent, Signal
from servewatch.schemas.incident_group import parse_anomaly_record
from tests.conftest import lagging_partitions, new_broker
from tests.test_recovery_kafka import PARTITIONS, _later_request_on_every_partition, _up

pytestmark = pytest.mark.integration

#: Normal traffic, prefix caching off (a score of incidents fire together, some sparse
#: segments' later), normal again: six simulated minutes, about 11,000 request logs.
PHASES = (Phase("normal", 150), Phase("cache_off", 120, prefix_caching=False), Phase("normal", 90))
SEED = 41
#: Simulated seconds per wall second: the play lasts about a minute and a half, time for
#: ``KILLS`` restarts (a group join each) spread over all of it.
SPEED = 4.0
KILLS = 10
KILL_SEED = 20260101

Key = tuple[tuple[tuple[str, str], ...], Signal]  # an incident's segment and signal


def _key(event: AnomalyEvent) -> Key:
    return tuple(sorted(event.segment.items())), event.signal


def _replay(jsonl: Path, out: Path, env: dict[str, str]) -> list[AnomalyEvent]:
    """``servewatch replay`` of the played records, as a user runs it; its incident events."""
    done = subprocess.run(
        [sys.executable, "-m", "servewatch", "replay", "--in", str(jsonl), "--out", str(out)],
        env={**os.environ, **env}, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"servewatch replay failed: {done.stderr[-2000:]}"
    records = [parse_anomaly_record(line) for line in out.read_bytes().splitlines() if line.strip()]
    return [r for r in records if isinstance(r, AnomalyEvent)]


async def _behind(bootstrap: str, group: str, topic: str) -> dict[int, tuple[int, int]]:
    """Partitions of ``topic`` whose committed offset (``group``) is behind their end: (committed, end).
    (``lagging_partitions`` asks the same of the requests topic.)"""
    admin, consumer = AIOKafkaAdminClient(bootstrap_servers=bootstrap), AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await admin.start()
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        ends = await consumer.end_offsets(parts)
        committed = await admin.list_consumer_group_offsets(group, partitions=parts)
        done = {tp: committed[tp].offset if tp in committed else -1 for tp in parts}
        return {tp.partition: (done[tp], ends[tp]) for tp in parts if ends[tp] and done[tp] < ends[tp]}  # empty: done
    finally:
        await consumer.stop()
        await admin.close()


async def _drained(bootstrap: str, group: str) -> dict[str, dict[int, tuple[int, int]]]:
    """What the group has not committed yet: requests (but the closing request of each
    partition, whose window stays open), partials and incidents. With none left, the
    watermarks that complete the workload's windows were read, and a partials message is
    committed after the step that judges what it completes, an incident after its anomaly
    records are on the broker: every anomaly event the worker will publish is there."""
    lagging = {
        topics.REQUESTS: await lagging_partitions(bootstrap, group, spare=1, partitions=PARTITIONS),
        topics.PARTIALS: await _behind(bootstrap, group, topics.PARTIALS),
        topics.INCIDENTS: await _behind(bootstrap, group, topics.INCIDENTS),
    }
    return {topic: behind for topic, behind in lagging.items() if behind}


async def _anomaly_events(bootstrap: str) -> list[AnomalyEvent]:
    """The anomaly topic's incident events, read to its end."""
    events = []
    async for record in follow_topic(bootstrap, topics.ANOMALIES, follow=False):
        parsed = parse_anomaly_record(record.value) if record.value is not None else None
        if isinstance(parsed, AnomalyEvent):
            events.append(parsed)
    return events


def test_every_replayed_incident_is_published_by_a_worker_killed_again_and_again(tmp_path: Path) -> None:
    detector_env = {"SERVEWATCH_LATENESS_PRIOR_S": "2"}  # in-order traffic: its last windows close sooner
    jsonl = tmp_path / "requests.jsonl"
    with jsonl.open("wb") as out:  # what ``play`` sends: a twin workload of the same seed generates it
        for record in Workload(PHASES, seed=SEED).records():
            out.write(orjson.dumps(record) + b"\n")
    replayed = _replay(jsonl, tmp_path / "replayed.jsonl", detector_env)
    expected = {_key(e) for e in replayed if e.transition == "firing"}
    assert expected, "replay finds the cache-off incidents"
    with jsonl.open("rb") as lines:
        records = sum(1 for _ in lines)

    workload = Workload(PHASES, seed=SEED)
    rng = random.Random(KILL_SEED)
    group = f"servewatch-kill-loop-{uuid.uuid4().hex[:8]}"
    env = {**detector_env, "SERVEWATCH_APP_ID": group, "SERVEWATCH_STORE": "rocksdb://",
           "SERVEWATCH_DATA_DIR": str(tmp_path / "faust"), "SERVEWATCH_LOG_LEVEL": "ERROR"}  # fmt: skip
    kills: list[str] = []
    with new_broker() as broker:
        asyncio.run(ensure_topics(broker.bootstrap, PARTITIONS))

        def launch() -> tuple[subprocess.Popen[bytes], int]:
            port = free_loopback_port()
            return start_worker(broker.bootstrap, {**env, "SERVEWATCH_METRICS_PORT": str(port)}), port

        worker, port = launch()
        try:
            deadline = time.monotonic() + 60
            while not _up(port):
                assert time.monotonic() < deadline, "the worker did not come up"
                time.sleep(0.5)
            sent: list[int] = []
            producer = threading.Thread(
                target=lambda: sent.append(asyncio.run(play(broker.bootstrap, workload, speed=SPEED)))
            )
            started = time.monotonic()
            producer.start()

            # Kills at random points spread over the play (gaps of 0.4 to 1.6 times a KILLS-th
            # of it; some land while a worker starts or recovers), and one as soon as a worker
            # has judged its first incident (its counter counts before the event is published),
            # waited for past the play if no worker got that far during it.
            play_s = (workload.duration_s + 10) / SPEED
            next_kill, fired_kill = started + rng.uniform(0.4, 1.6) * play_s / KILLS, False
            deadline = time.monotonic() + 3 * play_s  # a failure bound, not an expectation
            while producer.is_alive() or len(kills) < KILLS or not fired_kill:
                assert time.monotonic() < deadline, f"no worker judged an incident between kills ({kills})"
                fired = not fired_kill and served_value(port, "servewatch_anomaly_events_total") > 0
                scheduled = (producer.is_alive() or len(kills) < KILLS) and time.monotonic() >= next_kill
                if fired or scheduled:
                    os.kill(worker.pid, signal.SIGKILL)
                    worker.wait()
                    kills.append(f"{time.monotonic() - started:.1f}s{' (first incident fired)' if fired else ''}")
                    fired_kill = fired_kill or fired
                    worker, port = launch()
                    if not fired:
                        next_kill = time.monotonic() + rng.uniform(0.4, 1.6) * play_s / KILLS
                time.sleep(0.2)
            producer.join()
            assert sent == [records], f"played {sent} records, the replayed file has {records}"
            # The last windows close at a later request on every partition (as in the recovery test).
            asyncio.run(_later_request_on_every_partition(broker.bootstrap, workload.start + workload.duration_s + 120))

            deadline = time.monotonic() + 120  # a failure bound, not an expectation
            lagging = asyncio.run(_drained(broker.bootstrap, group))
            while lagging and time.monotonic() < deadline:
                time.sleep(1)
                lagging = asyncio.run(_drained(broker.bootstrap, group))
            assert lagging == {}, f"the last worker did not take every partition to its end: {lagging}"
            events = asyncio.run(_anomaly_events(broker.bootstrap))
        finally:
            stop_worker(worker)

    # A consumer dedups on (fingerprint, status, window); an incident is one fingerprint.
    unique = {(e.fingerprint, e.status, e.window_start): e for e in events}.values()
    live: dict[Key, set[str]] = defaultdict(set)
    for event in unique:
        if event.transition == "firing":
            live[_key(event)].add(event.fingerprint)
    lost = sorted(expected - live.keys(), key=str)
    doubled = {key: fps for key, fps in live.items() if len(fps) > 1}
    repeated = sum(1 for e in events if e.transition == "firing") - sum(len(fps) for fps in live.values())
    same = {e.fingerprint for e in replayed if e.transition == "firing"} & {fp for fps in live.values() for fp in fps}
    print(
        f"\nkill loop: {len(kills)} SIGKILLs at {', '.join(kills)}; {records:,} records played and replayed; "
        f"replay fired {len(expected)} incidents (segment, signal), the live worker {len(live)} "
        f"({len(same)} under the replay's own fingerprint); lost {len(lost)}, opened twice {len(doubled)}, "
        f"firing events published more than once {repeated}, fired live only {len(live.keys() - expected)}",
        file=sys.stderr,
    )
    assert len(kills) >= KILLS
    assert not lost, (
        f"{len(lost)} of {len(expected)} incidents that replay fires were never published firing by the worker "
        f"killed {len(kills)} times ({len(doubled)} opened twice, {repeated} firing events repeated): "
        + "; ".join(f"{signal.value} of {dict(segment)}" for segment, signal in lost)
    )
