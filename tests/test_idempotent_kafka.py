"""servewatch's producer (``pipeline.kafka.producer``) is idempotent where the broker grants
producer ids: Apache Kafka does, the embedded Tansu refuses, and there the producer is a plain
acks=all one, as before. Either way it publishes, in order; and stopping it never waits for a
frozen broker (aiokafka retries an idempotent producer's batches for ever)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from servewatch.pipeline.dev.apache_kafka import ApacheKafka
from servewatch.pipeline.kafka import Producer, follow_topic, producer
from tests.conftest import Broker


async def new_topic(bootstrap: str) -> str:
    name = f"idempotence-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()
    return name


async def publish_and_read(client: Producer, bootstrap: str, topic: str, count: int) -> list[bytes]:
    """Publish ``count`` records with ``client`` (started), then everything ``topic`` holds."""
    for i in range(count):
        await client.send_and_wait(topic, str(i).encode(), partition=0)
    read = []
    async for record in follow_topic(bootstrap, topic, follow=False):
        if record.value is not None:
            read.append(record.value)
    return read


@pytest.mark.integration
async def test_the_default_producer_publishes_idempotently_where_the_broker_allows(broker: Broker) -> None:
    topic = await new_topic(broker.bootstrap)
    client = producer(broker.bootstrap)
    await client.start()
    try:
        # Tansu refuses a producer id (UNKNOWN_SERVER_ERROR): a plain producer, no failed start.
        assert client.idempotent == (broker.profile == "kafka")
        assert (client.producer_id is not None) == client.idempotent
        read = await asyncio.wait_for(publish_and_read(client, broker.bootstrap, topic, 20), 60)
    finally:
        await client.stop()
    assert read == [str(i).encode() for i in range(20)]


@pytest.mark.integration
async def test_idempotence_can_be_turned_off_or_required(broker: Broker) -> None:
    plain = producer(broker.bootstrap, idempotence=False)
    await plain.start()
    try:
        assert not plain.idempotent
    finally:
        await plain.stop()
    required = producer(broker.bootstrap, idempotence=True)
    try:
        if broker.profile == "tansu":
            with pytest.raises(KafkaError):
                await asyncio.wait_for(required.start(), 60)
        else:
            await required.start()
            assert required.idempotent and required.producer_id is not None
    finally:
        await required.stop()


@pytest.mark.apache_kafka
@pytest.mark.timeout(600)
async def test_on_apache_kafka_the_producer_gets_a_producer_id_and_stops_while_the_broker_is_frozen() -> None:
    kafka = ApacheKafka()
    await asyncio.to_thread(kafka.start)
    try:
        topic = await new_topic(kafka.bootstrap)
        client = producer(kafka.bootstrap)
        await client.start()
        try:
            assert client.idempotent and client.producer_id is not None and client.producer_id >= 0
            read = await asyncio.wait_for(publish_and_read(client, kafka.bootstrap, topic, 50), 120)
        finally:
            await client.stop()
        assert read == [str(i).encode() for i in range(50)]

        # A frozen broker: the idempotent producer's batch is retried, not expired, until stop()
        # gives it the plain producer's bound (request_timeout_ms) and fails it.
        frozen = Producer(bootstrap_servers=kafka.bootstrap, acks="all", linger_ms=0, request_timeout_ms=2000)
        await frozen.start()
        assert frozen.idempotent
        await frozen.send_and_wait(topic, b"before", partition=0)
        kafka.pause()
        try:
            pending = await frozen.send(topic, b"during", partition=0)
            await asyncio.wait_for(frozen.stop(), 120)  # a bound for a hang, not a speed
            # stop() returned with the broker frozen: the batch is settled, not left waiting.
            # Failed (expired) as a rule; delivered when the broker had answered before the
            # freeze took hold, which a busy machine allows.
            assert pending.done()
            assert pending.cancelled() or pending.exception() is None or isinstance(pending.exception(), KafkaError)
        finally:
            kafka.resume()
    finally:
        await asyncio.to_thread(kafka.stop)
