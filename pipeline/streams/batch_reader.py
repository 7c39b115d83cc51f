"""Read a topic in batches, in a consumer group of its own, committing only what is done.

A Faust agent pays about 160 µs per message on this kind of machine, whatever the message
holds: a worker fed one request log per message (what most log shippers send) could not
read more than a few thousand records a second, a hundredth of what the Kafka client
itself reads. The requests topic needs none of Faust's per-message machinery (no table is
written per message; stage 1 keeps its windows in memory and hands them over on
revocation), so it is read here: ``getmany`` batches straight from aiokafka, handed to
the owner one partition's messages at a time.

Offsets commit only up to what the owner acknowledged: the owner asks for a message's
``Ack`` token, and acknowledging it marks it and every earlier message of its partition
done (the owner acknowledges in offset order). The done offsets are committed after each batch and
when partitions are revoked (after the owner handed over what they fed), so a crash
replays what was not yet sent on, never less.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import CommitFailedError, ConsumerStoppedError, IllegalStateError, KafkaError
from aiokafka.structs import OffsetAndMetadata

from servewatch.pipeline.kafka import KafkaAuth
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.streams import tansu_transport
from servewatch.pipeline.streams.faust_app import GROUP_TIMING

logger = logging.getLogger(__name__)

#: One partition's messages in offset order, as (value, offset).
Messages = Sequence[tuple[bytes | None, int]]
#: How long ``unread`` waits for a partition's position (one being reset has none yet).
POSITION_WAIT_S = 0.1


@dataclass(frozen=True, slots=True)
class Ack:
    """A message's acknowledgement: ``ack()`` marks it and every earlier one of its partition done."""

    reader: BatchReader
    partition: int
    offset: int
    generation: int  # of the partition's assignment it was read in

    def ack(self) -> None:
        self.reader.mark_done(self.partition, self.offset, self.generation)


class BatchReader:
    """A consumer of ``topic`` in its own group, feeding ``handle(partition, messages, ack_of)``
    (``ack_of(offset)``: the token of a message of the batch).

    ``hand_over(partitions)`` is awaited when partitions are revoked, before their done
    offsets are committed: the owner acknowledges there what it sends on for them.
    ``take_over(partitions)`` is called when partitions are assigned, before any is read.
    ``max_records``: messages per ``getmany`` (the owner yields to the event loop between
    partitions, so the batch bounds how long it holds it).
    """

    def __init__(
        self,
        new_consumer: Callable[[], AIOKafkaConsumer],
        group_id: str,
        topic: str,
        handle: Callable[[int, Messages, Callable[[int], Ack]], Awaitable[None]],
        hand_over: Callable[[set[int]], Awaitable[None]],
        take_over: Callable[[set[int]], None] | None = None,
        max_records: int = 5_000,
        poll_ms: int = 200,
        inherit_from: str | None = None,
        admin: Callable[[], AIOKafkaAdminClient] | None = None,
    ) -> None:
        self._new_consumer = new_consumer  # a consumer in group ``group_id``
        self.group_id = group_id
        self.consumer: AIOKafkaConsumer | None = None  # made on the event loop that starts it
        self.topic = topic
        self.handle = handle
        self.hand_over = hand_over
        self.take_over = take_over
        self.max_records = max_records
        self.poll_ms = poll_ms
        # A group whose commits stand for this one's where it has none (the app's Faust
        # group, for deployments whose workers read the requests topic there): a partition
        # this group never committed on starts where that one left it, not from the beginning.
        self.inherit_from = inherit_from
        self._admin = admin
        self._done: dict[int, int] = {}  # partition -> newest offset done
        self._committed: dict[int, int] = {}  # partition -> offset committed (the next to read)
        # partition -> its assignments so far: an acknowledgement of a message read before a
        # partition was revoked and assigned again says nothing about where it stands now.
        self._generation: dict[int, int] = {}
        self._stopping = False

    def mark_done(self, partition: int, offset: int, generation: int) -> None:
        if generation == self._generation.get(partition, 0) and offset > self._done.get(partition, -1):
            self._done[partition] = offset

    def assigned(self, partitions: set[int]) -> None:
        for partition in partitions:
            self._generation[partition] = self._generation.get(partition, 0) + 1
            self._done.pop(partition, None)
            self._committed.pop(partition, None)
        if self.take_over is not None and partitions:
            self.take_over(partitions)

    async def start(self) -> None:
        try:
            await self.inherit_offsets()
        except Exception as exc:  # the group's own start (its reset policy) stands
            logger.warning("could not read where group %s left %s: %r", self.inherit_from, self.topic, exc)
        self.consumer = self._new_consumer()
        self.consumer.subscribe([self.topic], listener=_Listener(self))
        await self.consumer.start()

    async def run(self) -> None:
        """Start, then read, hand each partition's messages to the owner and commit what is
        done, until stopped or cancelled."""
        await self.start()
        assert self.consumer is not None
        while not self._stopping:
            try:
                batches = await self.consumer.getmany(timeout_ms=self.poll_ms, max_records=self.max_records)
            except ConsumerStoppedError:
                return
            for tp, records in batches.items():
                await self.handle(tp.partition, [(record.value, record.offset) for record in records],
                                  self._acks(tp.partition))  # fmt: skip
                await asyncio.sleep(0)  # heartbeats and timers between partitions
            await self.commit()

    async def unread(self) -> set[int]:
        """Assigned partitions with records not yet read: the end offset of the latest fetch is
        past the position, or either is not known yet (assigned, not fetched). A partition
        silent because its records have not come is not idle (``StageOne.flush_idle``)."""
        consumer = self.consumer
        if consumer is None:
            return set()
        waiting = set()
        for tp in consumer.assignment():
            try:
                end = consumer.highwater(tp)
                position = await asyncio.wait_for(consumer.position(tp), POSITION_WAIT_S)
            except (TimeoutError, KafkaError, AssertionError, ConsumerStoppedError):  # being reset, revoked, stopped
                end = position = None
            if end is None or position is None or position < end:
                waiting.add(tp.partition)
        return waiting

    def _acks(self, partition: int) -> Callable[[int], Ack]:
        generation = self._generation.get(partition, 0)
        return lambda offset: Ack(self, partition, offset, generation)

    async def commit(self, partitions: set[int] | None = None) -> None:
        """Commit the done offsets that moved (of ``partitions`` only, when given). A commit
        refused during a rebalance is left to the next one: nothing is lost, at most replayed."""
        if self.consumer is None:
            return
        assigned = {tp.partition for tp in self.consumer.assignment()}
        due = {
            TopicPartition(self.topic, partition): OffsetAndMetadata(offset + 1, "")
            for partition, offset in self._done.items()
            if (partitions is None or partition in partitions)
            and partition in assigned
            and self._committed.get(partition) != offset + 1
        }
        if not due:
            return
        try:
            await self.consumer.commit(due)
        except (CommitFailedError, IllegalStateError, KafkaError) as exc:
            logger.info("commit of %s deferred: %r", self.topic, exc)
            return
        for tp, meta in due.items():
            self._committed[tp.partition] = meta.offset

    async def inherit_offsets(self) -> None:
        """Commit as this group's own the offsets ``inherit_from`` holds on partitions this
        group has none for. Before joining: aiokafka reads a partition's start from the
        group's commits as it is assigned, and a seek made then does not outlast that. While
        the group has members the broker refuses the commit, and their commits stand."""
        if self.inherit_from is None or self._admin is None:
            return
        admin = self._admin()
        await admin.start()
        try:
            described = await admin.describe_topics([self.topic])
            tps = [TopicPartition(self.topic, p["partition"]) for t in described for p in t.get("partitions", [])]
            if not tps:
                return
            # Partitions named: the embedded broker drops the connection on a fetch of all.
            ours = await admin.list_consumer_group_offsets(self.group_id, partitions=tps)
            theirs = await admin.list_consumer_group_offsets(self.inherit_from, partitions=tps)
        finally:
            await admin.close()
        starts = {
            tp: meta.offset
            for tp, meta in theirs.items()
            if tp.topic == self.topic and meta.offset >= 0 and (tp not in ours or ours[tp].offset < 0)
        }
        if not starts:
            return
        committer = self._new_consumer()
        await committer.start()
        try:
            committer.assign(list(starts))
            await committer.commit({tp: OffsetAndMetadata(offset, "") for tp, offset in starts.items()})
        finally:
            await committer.stop()
        logger.info("%s starts where group %s left it: %s", self.topic, self.inherit_from,
                    {tp.partition: offset for tp, offset in sorted(starts.items())})  # fmt: skip

    async def revoked(self, partitions: set[int]) -> None:
        await self.hand_over(partitions)
        await self.commit(partitions)
        for partition in partitions:  # whoever reads them next starts from the commit
            self._done.pop(partition, None)
            self._committed.pop(partition, None)

    async def stop(self) -> None:
        """Commit what is done and leave the group (its partitions go to the other workers)."""
        self._stopping = True
        if self.consumer is None:
            return
        try:
            await self.commit()
        finally:
            await self.consumer.stop()


def group_consumer(settings: Settings, group_id: str) -> AIOKafkaConsumer:
    """A consumer for a ``BatchReader``: the group timing of the worker's Faust app for the
    configured broker kind (``faust_app.GROUP_TIMING``), no automatic commits, and on the
    embedded broker the same short fetch waits as its Faust transport."""
    assert settings.kafka.bootstrap is not None
    timing = GROUP_TIMING[settings.kafka.broker_profile]
    fetch_bytes = max(settings.kafka.max_message_bytes, 1_048_576) + 65_536
    return AIOKafkaConsumer(
        bootstrap_servers=settings.kafka.bootstrap,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=int(timing["broker_session_timeout"] * 1000),
        heartbeat_interval_ms=int(timing["broker_heartbeat_interval"] * 1000),
        rebalance_timeout_ms=int(timing["broker_rebalance_timeout"] * 1000),
        fetch_max_wait_ms=tansu_transport.FETCH_MAX_WAIT_MS if settings.kafka.broker_profile == "tansu" else 500,
        max_partition_fetch_bytes=fetch_bytes,
        fetch_max_bytes=max(fetch_bytes, 64 * 1024 * 1024),
        **KafkaAuth.from_settings(settings).client_options(),
    )


def group_admin(settings: Settings) -> AIOKafkaAdminClient:
    """An admin client for reading another group's offsets (``BatchReader.inherit_from``)."""
    assert settings.kafka.bootstrap is not None
    return AIOKafkaAdminClient(
        bootstrap_servers=settings.kafka.bootstrap, **KafkaAuth.from_settings(settings).client_options()
    )


class _Listener(ConsumerRebalanceListener):
    def __init__(self, reader: BatchReader) -> None:
        self.reader = reader

    async def on_partitions_revoked(self, revoked: Any) -> None:
        partitions = {tp.partition for tp in revoked if tp.topic == self.reader.topic}
        if partitions:
            try:
                await self.reader.revoked(partitions)
            except Exception:  # a failed hand-over replays, it never stops the rebalance
                logger.exception("hand-over of revoked %s partitions %s failed", self.reader.topic, partitions)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        partitions = {tp.partition for tp in assigned if tp.topic == self.reader.topic}
        self.reader.assigned(partitions)
        logger.info("reading %s partitions %s", self.reader.topic, sorted(tp.partition for tp in assigned))
