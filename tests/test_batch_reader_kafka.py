"""``BatchReader`` on a real broker: offsets commit only up to what was acknowledged; a
reader that takes over starts there; revoked partitions are handed over, then committed."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from servewatch.pipeline.kafka import ensure_topics, producer
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.streams.batch_reader import Ack, BatchReader, Messages, group_admin, group_consumer

pytestmark = pytest.mark.integration

PER_PARTITION = 30
FIELDS = {"model": "m", "prompt_tokens": 800, "completion_tokens": 60, "e2e_s": 1.5, "finish_reason": "stop"}


async def produce(bootstrap: str, topic: str) -> None:
    await ensure_topics(bootstrap, 2, names=(topic,))
    client = producer(bootstrap)
    await client.start()
    try:
        for partition in (0, 1):
            for n in range(PER_PARTITION):
                await client.send_and_wait(topic, f'{{"n": {n}}}'.encode(), partition=partition)
    finally:
        await client.stop()


class Reading:
    """A reader of ``topic`` in ``group`` that acknowledges what ``acks`` lets it."""

    def __init__(
        self, bootstrap: str, topic: str, group: str, acks: Callable[[int, int], bool], inherit_from: str | None = None
    ) -> None:
        self.seen: list[tuple[int, int]] = []
        self.handed_over: list[set[int]] = []
        self.acks = acks
        settings = Settings(broker=bootstrap, broker_profile="tansu")
        self.reader = BatchReader(
            lambda: group_consumer(settings, group), group, topic, self.handle, self.hand_over,
            inherit_from=inherit_from, admin=lambda: group_admin(settings),
        )  # fmt: skip
        self.task: asyncio.Task[None] | None = None

    async def handle(self, partition: int, messages: Messages, ack_of: Callable[[int], Ack]) -> None:
        for _, offset in messages:
            self.seen.append((partition, offset))
            if self.acks(partition, offset):
                ack_of(offset).ack()

    async def hand_over(self, partitions: set[int]) -> None:
        self.handed_over.append(partitions)

    def start(self) -> None:
        self.task = asyncio.create_task(self.reader.run())

    async def until(self, condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not condition():
                assert self.task is None or not self.task.done() or self.task.result() is None
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        await self.reader.stop()
        if self.task is not None:
            await asyncio.wait_for(self.task, 30)


async def test_only_acknowledged_offsets_are_committed_and_a_successor_starts_there(broker: Any) -> None:
    topic, group = f"reader-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    await produce(broker.bootstrap, topic)
    # The first reader acknowledges partition 0 up to offset 19 only, partition 1 whole.
    first = Reading(broker.bootstrap, topic, group, lambda partition, offset: partition == 1 or offset < 20)
    first.start()
    await first.until(lambda: len(first.seen) == 2 * PER_PARTITION)
    await first.stop()
    second = Reading(broker.bootstrap, topic, group, lambda partition, offset: True)
    second.start()
    await second.until(lambda: len(second.seen) >= PER_PARTITION - 20)
    await asyncio.sleep(1.0)  # anything else it would read arrives meanwhile
    await second.stop()
    assert sorted(second.seen) == [(0, offset) for offset in range(20, PER_PARTITION)]


async def test_revoked_partitions_are_handed_over_before_their_offsets_commit(broker: Any) -> None:
    topic, group = f"reader-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    await produce(broker.bootstrap, topic)
    first = Reading(broker.bootstrap, topic, group, lambda partition, offset: True)
    first.start()
    await first.until(lambda: len(first.seen) == 2 * PER_PARTITION)
    second = Reading(broker.bootstrap, topic, group, lambda partition, offset: True)
    second.start()  # joins: the group rebalances, the first hands its partitions over
    await first.until(lambda: bool(first.handed_over))
    await asyncio.sleep(2.0)
    await second.stop()
    await first.stop()
    assert first.handed_over[0] == {0, 1}
    assert second.seen == []  # everything the first read was committed at the hand-over


async def test_a_new_group_starts_where_the_group_it_inherits_from_left_off(broker: Any) -> None:
    topic, old, new = f"reader-{uuid.uuid4().hex[:8]}", f"old-{uuid.uuid4().hex[:8]}", f"new-{uuid.uuid4().hex[:8]}"
    await produce(broker.bootstrap, topic)
    committer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=old, enable_auto_commit=False)
    await committer.start()
    try:  # the old group had read partition 0 up to offset 25, partition 1 not at all
        committer.assign([TopicPartition(topic, 0), TopicPartition(topic, 1)])
        await committer.commit({TopicPartition(topic, 0): OffsetAndMetadata(25, "")})
    finally:
        await committer.stop()
    reading = Reading(broker.bootstrap, topic, new, lambda partition, offset: True, inherit_from=old)
    reading.start()
    await reading.until(lambda: len(reading.seen) >= PER_PARTITION + 5)
    await asyncio.sleep(1.0)
    await reading.stop()
    assert sorted(reading.seen) == [(0, n) for n in range(25, PER_PARTITION)] + [(1, n) for n in range(PER_PARTITION)]


@pytest.mark.parametrize("batch_reader", [True, False], ids=["batch reader", "faust agent"])
def test_a_worker_judges_one_record_messages_and_commits_them(batch_reader: bool) -> None:
    """One-record messages, every record accounted for (judged or late), dead letters for the
    bad one, every partition committed to its end but for the message that holds the last
    window open: read in batches (in the requests group), and with ``SERVEWATCH_BATCH_READER=false``
    by a Faust agent (in the app's group)."""
    from servewatch.pipeline import topics
    from servewatch.pipeline.dev.broker import free_loopback_port
    from servewatch.pipeline.dev.demo import start_worker, stop_worker
    from servewatch.pipeline.worker.metrics import served_value
    from tests.conftest import lagging_partitions, new_broker

    partitions, start = 4, time.time() - 600
    with new_broker() as broker:
        asyncio.run(ensure_topics(broker.bootstrap, partitions))
        group, port = f"servewatch-br-{uuid.uuid4().hex[:8]}", free_loopback_port()
        worker = start_worker(broker.bootstrap, {"SERVEWATCH_APP_ID": group, "SERVEWATCH_METRICS_PORT": str(port),
                                                 "SERVEWATCH_BATCH_READER": str(batch_reader).lower()})  # fmt: skip

        async def send() -> int:
            client = producer(broker.bootstrap)
            await client.start()
            sent = 0
            try:
                for n in range(1200):
                    record = {"request_id": f"r{n}", "timestamp": start + n / 10, **FIELDS}
                    await client.send_and_wait(topics.REQUESTS, orjson.dumps(record), partition=n % partitions)
                    sent += 1
                await client.send_and_wait(topics.REQUESTS, b"{not json", partition=0)
                for partition in range(partitions):  # closes every window above
                    later = {"request_id": f"later{partition}", "timestamp": start + 400, **FIELDS}
                    await client.send_and_wait(topics.REQUESTS, orjson.dumps(later), partition=partition)
            finally:
                await client.stop()
            return sent

        try:
            sent = asyncio.run(send())
            deadline = time.monotonic() + 90
            done = 0.0
            while time.monotonic() < deadline and done < sent:
                time.sleep(1)
                done = sum(served_value(port, f"servewatch_{k}_total") for k in ("judged_records", "late_records"))
            assert done == sent and served_value(port, "servewatch_records_total") == sent + partitions
            assert served_value(port, "servewatch_dead_letters_total") == 1
            deadline = time.monotonic() + 60
            lagging = asyncio.run(lagging_partitions(broker.bootstrap, group, spare=1, batch_reader=batch_reader))
            while lagging and time.monotonic() < deadline:
                time.sleep(1)
                lagging = asyncio.run(lagging_partitions(broker.bootstrap, group, spare=1, batch_reader=batch_reader))
            assert lagging == {}, f"partitions not committed to their end (but the later request): {lagging}"
        finally:
            stop_worker(worker)


async def test_a_partition_is_unread_while_the_broker_holds_records_past_its_position(broker: Any) -> None:
    """What ``StageOne.flush_idle`` is told: silence on a partition whose records have not
    been read is a slow read, not an idle partition."""
    topic, group = f"reader-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    await produce(broker.bootstrap, topic)
    reading = Reading(broker.bootstrap, topic, group, lambda partition, offset: True)
    reader = reading.reader
    await reader.start()  # in the group, fetching; nothing handed to the owner yet
    try:
        assert reader.consumer is not None
        consumer = reader.consumer
        async with asyncio.timeout(60):
            while len(consumer.assignment()) < 2:
                await asyncio.sleep(0.05)
        assert await reader.unread() == {0, 1}  # not fetched yet, or fetched and not read

        read = 0
        async with asyncio.timeout(60):
            while read < 2 * PER_PARTITION:
                read += sum(map(len, (await consumer.getmany(timeout_ms=200)).values()))
            while await reader.unread():  # the next fetch's end offsets come in the background
                await asyncio.sleep(0.05)

        client = producer(broker.bootstrap)
        await client.start()
        try:
            await client.send_and_wait(topic, b'{"n": 30}', partition=1)
        finally:
            await client.stop()
        async with asyncio.timeout(60):
            while await reader.unread() != {1}:
                await asyncio.sleep(0.05)
    finally:
        await reader.stop()
