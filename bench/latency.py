"""Detection latency: a window's last event produced -> its AnomalyEvent readable, in wall time.

    python -m bench.latency [--history 300] [--incident 40] [--rate 200]

Starts the embedded broker and one worker, replays ``--history`` seconds of normal traffic
(timestamps in the recent past, sent at once) so every segment has a baseline, then
produces in real time (records stamped with the wall clock as they finish) and switches
prefix caching off. For each paging event read from the anomaly topic it prints the time from the moment the
last request log of that event's window was produced to the event being readable (and,
for reference, the time since the window's end). The window length is not included; the
allowed lateness is (learned from the traffic; 10 s at first, see docs/operating.md, "Event time"), since a
window cannot close before it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
import uuid
from typing import Any

import orjson

from servewatch.pipeline import topics
from servewatch.pipeline.dev.broker import EmbeddedBroker
from servewatch.pipeline.dev.demo import start_worker, stop_worker
from servewatch.pipeline.dev.simulator import Phase, Workload
from servewatch.pipeline.kafka import ensure_topics, producer, read_topic
from servewatch.schemas.anomaly import AnomalyEvent

PARTITIONS = 4
FLUSH_S = 0.25  # how often the simulated shippers send what finished


def shifted(records: list[dict[str, Any]], offset: float) -> list[dict[str, Any]]:
    return [{**r, "timestamp": round(r["timestamp"] + offset, 4)} for r in records]


async def run(bootstrap: str, history_s: float, incident_s: float, rate: float) -> list[float]:
    now = time.time()
    normal = Workload((Phase("normal", history_s),), base_rate=rate, seed=3)
    broken = Workload((Phase("cache_off", incident_s + 15, prefix_caching=False),), base_rate=rate, seed=4)
    latencies: list[float] = []
    last_sent: dict[float, float] = {}  # window start -> wall time its last event was produced

    async def watch() -> None:
        async for raw in read_topic(bootstrap, topics.ANOMALIES):
            event = AnomalyEvent.model_validate_json(raw)
            if event.pages and event.window_start in last_sent:
                latencies.append(time.time() - last_sent[event.window_start])
                print(f"  {event.status.value} {event.signal.value} {'/'.join(event.segment.values())}: "
                      f"readable {latencies[-1]:.2f}s after its window's last event was produced "
                      f"({time.time() - event.window_end:.2f}s after the window's end)", flush=True)  # fmt: skip

    watcher = asyncio.create_task(watch())
    prod = producer(bootstrap)
    await prod.start()
    try:
        # History: the last `history_s` seconds, sent at once, ending just before now.
        batches = [batch for _, batch in normal.seconds() if batch]
        offset = (now - 1.0) - max(r["timestamp"] for r in batches[-1])
        for batch in batches:
            await prod.send(topics.REQUESTS, orjson.dumps(shifted(batch, offset)))
        await prod.flush()
        print(f"history sent ({history_s:.0f}s); now producing in real time with prefix caching off", flush=True)
        # Real time: finished requests stamped with the wall clock, shipped every FLUSH_S
        # (a shipper's flush interval) to every partition, as a fleet of shippers would.
        live_start = time.time()
        shift = live_start - broken.start
        for sim_now, batch in broken.seconds():
            rows = sorted(shifted(batch, shift), key=lambda r: r["timestamp"])
            second = sim_now - 1 + shift  # the records finished during [second, second + 1)
            for tick in range(int(1 / FLUSH_S)):
                until = second + (tick + 1) * FLUSH_S
                await asyncio.sleep(max(0.0, until - time.time()))
                due = [r for r in rows if second + tick * FLUSH_S <= r["timestamp"] < until]
                for partition in range(PARTITIONS):
                    part = due[partition::PARTITIONS]
                    if part:
                        await prod.send(topics.REQUESTS, orjson.dumps(part), partition=partition)
                        sent_at = time.time()
                        for row in part:
                            last_sent[row["timestamp"] // 10 * 10] = sent_at
            if sim_now - broken.start > incident_s:
                break
        await asyncio.sleep(3)
    finally:
        await prod.stop()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=float, default=300.0, help="seconds of baseline traffic")
    parser.add_argument("--incident", type=float, default=45.0, help="seconds of real-time traffic, cache off")
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s per model")
    args = parser.parse_args()
    with EmbeddedBroker() as broker:
        asyncio.run(ensure_topics(broker.bootstrap, PARTITIONS))
        app_id = f"latency-{uuid.uuid4().hex[:6]}"
        # The embedded broker's profile, whatever the environment names.
        worker = start_worker(broker.bootstrap, {"SERVEWATCH_APP_ID": app_id, "SERVEWATCH_BROKER_PROFILE": "tansu"})
        try:
            latencies = asyncio.run(run(broker.bootstrap, args.history, args.incident, args.rate))
        finally:
            stop_worker(worker)
    if not latencies:
        print("no paging event was read: nothing to measure")
        return
    print()
    lateness = Settings().windows.lateness_prior_s
    print(f"detection latency beyond the window: n={len(latencies)}, median {statistics.median(latencies):.2f}s, "
          f"max {max(latencies):.2f}s (the lateness, learned down from {lateness:.0f}s, is in it)")  # fmt: skip


if __name__ == "__main__":
    from servewatch.pipeline.settings import Settings

    main()
