"""Real Apache Kafka (pipeline/dev/apache_kafka.py): one node serves an idempotent producer, and a
3-node cluster loses no record and duplicates none when a partition leader crashes mid-stream.

Slow (JVMs on loopback; the jars are fetched by Maven on the first run), hence the marker.
The broker control calls block, so the async tests run them with ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from servewatch.pipeline import topics
from servewatch.pipeline.dev.apache_kafka import ApacheKafka, KafkaCluster
from servewatch.pipeline.dev.broker import BrokerError, probe_kafka
from servewatch.pipeline.kafka import ensure_topics

pytestmark = [pytest.mark.apache_kafka, pytest.mark.timeout(900)]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def eventually(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``check`` (a blocking call, run on a thread) until it holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if await asyncio.to_thread(check):
                return
        except BrokerError:  # metadata from a node that is still catching up
            pass
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(1.0)


async def read_all(bootstrap: str, topic: str, partitions: int) -> list[int]:
    """Every record of ``topic`` from the beginning to the current end, as ints."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        values: list[int] = []
        deadline = time.monotonic() + 120
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            assert time.monotonic() < deadline, f"read {len(values)} of {sum(ends.values())} records"
            batches = await consumer.getmany(*tps, timeout_ms=1000)
            values += [int(record.value) for records in batches.values() for record in records if record.value]
        return values
    finally:
        await consumer.stop()


async def test_a_single_node_serves_an_idempotent_producer_and_stops_clean() -> None:
    kafka = ApacheKafka()
    await asyncio.to_thread(kafka.start)
    pid = kafka.pid
    try:
        assert kafka.running and pid is not None
        assert kafka.bootstrap == f"127.0.0.1:{kafka.port}" and kafka.url == f"kafka://{kafka.bootstrap}"
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap)
        await admin.start()
        try:  # topics are created, never auto-created (as in production)
            await admin.create_topics([NewTopic("single", num_partitions=1, replication_factor=1)])
        finally:
            await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all", enable_idempotence=True)
        await producer.start()
        try:
            for i in range(5):
                await producer.send_and_wait("single", str(i).encode(), partition=0)
        finally:
            await producer.stop()
        assert sorted(await read_all(kafka.bootstrap, "single", 1)) == list(range(5))
    finally:
        await asyncio.to_thread(kafka.stop)
    assert not kafka.running and kafka.pid is None
    assert gone(pid)


async def test_a_cluster_loses_and_duplicates_nothing_when_a_leader_crashes() -> None:
    topic, partitions = "crash", 3
    cluster = KafkaCluster(3)
    await asyncio.to_thread(cluster.start)
    try:
        assert all(node.running for node in cluster.nodes) and len(cluster.bootstrap.split(",")) == 3
        admin = AIOKafkaAdminClient(bootstrap_servers=cluster.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=3)])
        finally:
            await admin.close()

        def fully_replicated() -> bool:
            return all(len(cluster.partition(topic, p)["isr"]) == 3 for p in range(partitions))

        await eventually(fully_replicated, 120, f"{topic} led and in sync on 3 nodes")

        producer = AIOKafkaProducer(
            bootstrap_servers=cluster.bootstrap, acks="all", enable_idempotence=True, request_timeout_ms=60_000
        )
        await producer.start()
        try:
            sent = [await producer.send(topic, str(i).encode(), partition=i % partitions) for i in range(1000)]
            await asyncio.gather(*sent)

            leader = await asyncio.to_thread(cluster.leader_of, topic, 0)
            victim = cluster.node(leader)
            sent = []
            for i in range(1000, 2000):
                sent.append(await producer.send(topic, str(i).encode(), partition=i % partitions))
                if i == 1100:
                    await asyncio.to_thread(victim.kill)
                await asyncio.sleep(0.002)
            await asyncio.gather(*sent)  # acks=all from the 2 survivors (min.insync.replicas=2)
        finally:
            await producer.stop()
        assert not victim.running

        survivors = ",".join(node.bootstrap for node in cluster.nodes if node is not victim)
        values = await read_all(survivors, topic, partitions)
        assert len(values) == 2000  # nothing duplicated by the producer's retries
        assert set(values) == set(range(2000))  # nothing lost
        assert await asyncio.to_thread(cluster.leader_of, topic, 0) != leader

        await asyncio.to_thread(victim.start)  # the same log folder: it recovers and catches up
        assert victim.running
        await eventually(fully_replicated, 180, f"node {leader} back in the ISR of every partition")
    finally:
        await asyncio.to_thread(cluster.stop)
    assert not any(node.running for node in cluster.nodes)


def test_the_broker_command_runs_apache_kafka_until_sigterm() -> None:
    """``servewatch broker --apache``: a developer's Apache Kafka, told as the embedded one is."""
    command = [sys.executable, "-m", "servewatch", "broker", "--apache"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        line, deadline = "", time.monotonic() + 120
        while time.monotonic() < deadline and not line.startswith("broker ready"):
            line = proc.stdout.readline()
        match = re.search(r"broker ready: ([\d.]+:\d+) .*SERVEWATCH_BROKER_PROFILE=kafka", line)
        assert match, line
        asyncio.run(probe_kafka(match.group(1), timeout_s=30))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, 130)
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_ensure_topics_creates_what_the_compose_file_creates() -> None:
    """servewatch's topics on Apache Kafka, as ``ensure_topics`` makes them: every partition
    count and config the compose file's ``topics`` service gives (``test_deployment`` checks
    the file says the same), one replica on one broker."""
    kafka = ApacheKafka()
    await asyncio.to_thread(kafka.start)
    try:
        assert await ensure_topics(kafka.bootstrap, 4) == 1
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap)
        await admin.start()
        try:
            described = {t["topic"]: t for t in await admin.describe_topics(list(topics.ALL))}
            resources = [ConfigResource(ConfigResourceType.TOPIC, name) for name in topics.ALL]
            responses = await admin.describe_configs(resources)
        finally:
            await admin.close()
        assert {name: len(t["partitions"]) for name, t in described.items()} == dict.fromkeys(topics.ALL, 4)
        configs = {
            resource[3]: {entry[0]: entry[1] for entry in resource[4]}
            for response in responses for resource in response.resources
        }  # fmt: skip
        for name, wanted in topics.TOPIC_CONFIGS.items():
            assert {key: configs[name][key] for key in wanted} == wanted, name
    finally:
        await asyncio.to_thread(kafka.stop)
