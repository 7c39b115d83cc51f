"""A 10x burst on the real broker: steady traffic, then ten times as many requests for a
few seconds, produced as fast as the client can, then steady again. The worker is frozen
(SIGSTOP) while the burst arrives, as a long pause or a starved host would hold it, so the
whole burst is lag whatever this machine's speed; resumed, it drains that lag to zero, its
resident memory stays bounded, and every record is accounted for."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from servewatch.pipeline import topics
from servewatch.pipeline.dev.broker import free_loopback_port
from servewatch.pipeline.dev.demo import start_worker, stop_worker
from servewatch.pipeline.kafka import ensure_topics, producer
from servewatch.pipeline.worker.metrics import served_value
from tests.conftest import lagging_partitions, new_broker

pytestmark = pytest.mark.integration

PARTITIONS = 4
BASE_PER_S = 400
#: Resident memory a worker may reach in this test: several times what it needs (~150 MiB),
#: far below what holding the burst's records would take if windows did not bound it.
RSS_BOUND_KIB = 600 * 1024


def _batch(start: int, count: int, now: float) -> bytes:
    return orjson.dumps([
        {"request_id": f"b{n}", "timestamp": now - 0.5 + (n - start) / count / 2, "model": ("m1", "m2")[n % 2],
         "route": ("chat", "rag")[(n // 2) % 2], "prompt_tokens": 600 + n % 500, "completion_tokens": 40 + n % 90,
         "e2e_s": 1.4, "ttft_s": 0.25, "finish_reason": "stop"}
        for n in range(start, start + count)
    ])  # fmt: skip


#: Seconds of steady traffic, burst, steady traffic.
SECONDS = [BASE_PER_S] * 3 + [10 * BASE_PER_S] * 3 + [BASE_PER_S] * 3
BURST = range(3, 6)


async def _produce(bootstrap: str, sent: list[int], on_second: Callable[[int], Awaitable[None]]) -> None:
    """3 s at BASE_PER_S, 3 s at ten times that (each second's records sent at once), 3 s at
    BASE_PER_S; ``on_second(k)`` before the ``k``-th second's records and after the last's."""
    prod = producer(bootstrap)
    await prod.start()
    try:
        n = 0
        for second, per_s in enumerate(SECONDS):
            await on_second(second)
            started, now = time.monotonic(), time.time()
            for _ in range(per_s // 200):  # messages of 200 records, partitions in turn
                await prod.send(topics.REQUESTS, _batch(n, 200, now), partition=(n // 200) % PARTITIONS)
                n += 200
                sent[1] += 1
            await prod.flush()
            sent[0] = n
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
        await on_second(len(SECONDS))
    finally:
        await prod.stop()


async def _end_offsets(bootstrap: str) -> int:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        ends = await consumer.end_offsets([TopicPartition(topics.REQUESTS, p) for p in range(PARTITIONS)])
        return sum(ends.values())
    finally:
        await consumer.stop()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_a_10x_burst_builds_lag_that_drains_with_bounded_memory() -> None:
    with new_broker() as broker:
        asyncio.run(ensure_topics(broker.bootstrap, PARTITIONS))
        port, app_id = free_loopback_port(), f"burst-{uuid.uuid4().hex[:6]}"
        worker = start_worker(broker.bootstrap, {"SERVEWATCH_APP_ID": app_id,
                                                 "SERVEWATCH_METRICS_PORT": str(port),
                                                 "SERVEWATCH_LATENESS_PRIOR_S": "2"})  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while served_value(port, "servewatch_live_segments") != 0 or served_value(
                port, "servewatch_messages_total"
            ):
                assert time.monotonic() < deadline, "worker did not come up"
                time.sleep(0.3)
            time.sleep(3)  # its partitions assigned
            sent = [0, 0]  # records, messages
            lags: list[int] = []  # the worker's unread messages as it resumed

            async def freeze_for_the_burst(second: int) -> None:
                if second == BURST.start:
                    os.kill(worker.pid, signal.SIGSTOP)
                elif second == BURST.stop:
                    # Committed offsets trail what was read by a commit interval: the lag is
                    # at least the burst's messages, all sent while the worker was frozen.
                    lagging = await lagging_partitions(broker.bootstrap, app_id, partitions=PARTITIONS)
                    lags.append(sum(end - max(done, 0) for done, end in lagging.values()))
                    os.kill(worker.pid, signal.SIGCONT)

            thread = threading.Thread(
                target=lambda: asyncio.run(_produce(broker.bootstrap, sent, freeze_for_the_burst))
            )
            thread.start()
            rss = []
            while thread.is_alive():
                rss.append(_rss_kib(worker.pid))
                time.sleep(0.25)
            thread.join()
            messages = asyncio.run(_end_offsets(broker.bootstrap))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                read = served_value(port, "servewatch_messages_total")
                accepted = served_value(port, "servewatch_records_total")
                done = sum(served_value(port, f"servewatch_{k}_total")
                           for k in ("judged_records", "late_records", "duplicate_records"))  # fmt: skip
                rss.append(_rss_kib(worker.pid))
                if read == messages and done == accepted:
                    break
                time.sleep(0.5)
        finally:
            if worker.poll() is None:  # should the producer have failed mid-burst
                os.kill(worker.pid, signal.SIGCONT)
            stop_worker(worker)
    burst_messages = len(BURST) * 10 * BASE_PER_S // 200
    assert lags and lags[0] >= burst_messages, f"the burst was lag when the worker resumed: {lags}"
    assert messages == sent[1] and read == messages, "the lag drained: every message read"
    assert accepted == sent[0] and done == accepted, (accepted, done, sent[0])
    assert max(rss) < RSS_BOUND_KIB, f"peak RSS {max(rss) / 1024:.0f} MiB"
