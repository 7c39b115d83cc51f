"""servewatch on a three-broker Apache Kafka cluster (KRaft, 3 replicas, min.insync.replicas 2)
while brokers fail under load: the leader of a requests partition killed (``kill -9``) in a
10x burst and started again, then another broker stopped cleanly, while request logs stream
in. Every record produced must be read and judged once (late or duplicate records are
counted, never dropped), and the worker must live through both, as it must when a
production broker is lost.

Apache Kafka only (``--kafka apache``): the embedded broker is one process, with no replica
to fail over to.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import orjson
import pytest
from aiokafka.errors import KafkaError

from servewatch.pipeline import topics
from servewatch.pipeline.dev.apache_kafka import KafkaCluster
from servewatch.pipeline.dev.broker import BrokerError, free_loopback_port
from servewatch.pipeline.dev.demo import start_worker, stop_worker
from servewatch.pipeline.kafka import ensure_topics, producer
from servewatch.pipeline.worker.metrics import served_value

pytestmark = [pytest.mark.apache_kafka, pytest.mark.timeout(900)]

PARTITIONS = 4
PER_S = 400  # records a second, in messages of 100
SECONDS = 40
KILL_AT, RESTART_AT, STOP_AT = 10, 17, 27  # seconds into the stream
BURST = range(KILL_AT, KILL_AT + 5)  # seconds at ten times PER_S: the leader dies in a 10x burst
SENT = PER_S * (SECONDS + 9 * len(BURST))


def _batch(start: int, count: int, now: float) -> bytes:
    return orjson.dumps([
        {"request_id": f"c{n}", "timestamp": now - 0.5 + (n - start) / count / 2, "model": ("m1", "m2")[n % 2],
         "route": "chat", "prompt_tokens": 600 + n % 500, "completion_tokens": 40 + n % 90,
         "e2e_s": 1.4, "ttft_s": 0.25, "finish_reason": "stop"}
        for n in range(start, start + count)
    ])  # fmt: skip


async def _produce(bootstrap: str, sent: list[int], at_second: list[int]) -> None:
    """SECONDS seconds at PER_S (ten times that in BURST), partitions in turn; ``sent[0]`` counts
    records the cluster acknowledged (``acks=all``: every in-sync replica has them)."""
    prod = producer(bootstrap)
    await prod.start()
    try:
        n = 0
        for second in range(SECONDS):
            at_second[0] = second
            started, now = time.monotonic(), time.time()
            for _ in range(PER_S // 100 * (10 if second in BURST else 1)):
                await prod.send_and_wait(topics.REQUESTS, _batch(n, 100, now), partition=(n // 100) % PARTITIONS)
                n += 100
                sent[0] = n
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    finally:
        await prod.stop()


def _leader(cluster: KafkaCluster) -> int | None:
    """The leader of requests partition 0, None while the metadata cannot say (a node just died)."""
    try:
        return cluster.leader_of(topics.REQUESTS, 0)
    except (KafkaError, BrokerError):
        return None


def test_the_worker_judges_every_record_while_brokers_fail_under_load() -> None:
    with KafkaCluster(size=3) as cluster:
        assert asyncio.run(ensure_topics(cluster.bootstrap, PARTITIONS)) == 3  # 3 replicas on 3 brokers
        port = free_loopback_port()
        worker = start_worker(cluster.bootstrap, {"SERVEWATCH_APP_ID": f"cluster-{uuid.uuid4().hex[:6]}",
                                                  "SERVEWATCH_BROKER_PROFILE": "kafka",
                                                  "SERVEWATCH_METRICS_PORT": str(port),
                                                  "SERVEWATCH_LATENESS_PRIOR_S": "2"})  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while served_value(port, "servewatch_live_segments") != 0:
                assert time.monotonic() < deadline, "worker did not come up"
                time.sleep(0.5)
            time.sleep(5)  # its partitions assigned
            sent, at_second = [0], [0]
            thread = threading.Thread(target=lambda: asyncio.run(_produce(cluster.bootstrap, sent, at_second)))
            thread.start()
            while at_second[0] < KILL_AT:
                time.sleep(0.2)
            leader = _leader(cluster)
            assert leader is not None and leader > 0, "partition 0 has a leader before the kill"
            victim = cluster.node(leader)
            victim.kill()
            deadline = time.monotonic() + 60
            while _leader(cluster) in (victim.node_id, None, -1):  # a follower takes over
                assert time.monotonic() < deadline, "no new leader for the killed one's partition"
                time.sleep(0.5)
            while at_second[0] < RESTART_AT:
                time.sleep(0.2)
            victim.start()  # the crashed broker back, recovering its log
            while at_second[0] < STOP_AT:
                time.sleep(0.2)
            other = next(n for n in cluster.nodes if n.running and n is not victim)
            other.stop()  # a clean shutdown: leadership moves before it goes
            thread.join(timeout=300)
            assert not thread.is_alive(), "the producer finished"
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                accepted = served_value(port, "servewatch_records_total")
                done = sum(served_value(port, f"servewatch_{k}_total")
                           for k in ("judged_records", "late_records", "duplicate_records"))  # fmt: skip
                if accepted >= sent[0] and done == accepted:
                    break
                time.sleep(1)
            alive = worker.poll() is None
        finally:
            stop_worker(worker)
    assert alive, "the worker lived through a broker's crash and another's shutdown"
    # More than sent: a message re-read after a rebalance, counted as duplicate records.
    assert accepted >= sent[0] == SENT, (accepted, sent[0])
    assert done == accepted, f"accepted {accepted:.0f}, judged + late + duplicates {done:.0f}"
