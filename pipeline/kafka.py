"""Small aiokafka helpers for the CLI, the demo and tests: topics, producing, reading."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from servewatch.pipeline import topics

logger = logging.getLogger(__name__)


async def ensure_topics(bootstrap: str, partitions: int, names: tuple[str, ...] = topics.ALL) -> None:
    """Create servewatch's topics with ``partitions`` partitions where they do not exist yet.

    Done before anything produces, so that a broker's auto-creation (often 1 partition)
    never decides the layout.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [
            NewTopic(name, num_partitions=partitions, replication_factor=1) for name in names if name not in existing
        ]
        if missing:
            await admin.create_topics(missing)
            logger.info("created topics %s", [t.name for t in missing])
    finally:
        await admin.close()


def producer(bootstrap: str, max_request_size: int = 16 * 1024 * 1024) -> AIOKafkaProducer:
    # linger 0: Tansu under-reports end offsets of multi-record batches (see docs/notes).
    return AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=0, max_request_size=max_request_size)


async def read_topic(
    bootstrap: str, topic: str, *, from_beginning: bool = True, poll_ms: int = 200
) -> AsyncIterator[bytes]:
    """Every message value of ``topic`` (no consumer group), as it arrives. Runs until cancelled."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest" if from_beginning else "latest",
        enable_auto_commit=False,
        fetch_max_bytes=64 * 1024 * 1024,
        max_partition_fetch_bytes=16 * 1024 * 1024,
    )
    await consumer.start()
    try:
        while True:
            batches = await consumer.getmany(timeout_ms=poll_ms)
            for messages in batches.values():
                for message in messages:
                    if message.value is not None:
                        yield message.value
    finally:
        await consumer.stop()
