"""Faust's resume after a rebalance, without a broker (pipeline/seek_guard.py).

Faust's own consumer loop and flow control run over an in-memory partition whose seek
takes a round trip, in the order Faust's recovery uses when a table is recovered: resume
the stream partitions, seek them to the committed offsets, resume the agents' flow (which
empties their queues). Records fetched during the seek must still reach the agent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

import faust
import pytest
from faust.transport.consumer import Consumer
from faust.types import TP
from faust.types.tuples import ConsumerMessage, Message
from mode import Service
from mode.utils.queues import FlowControlQueue

from servewatch.pipeline.streams.seek_guard import hold_flow_while_seeking

PARTITION = TP("anomalies", 0)
RECORDS = 10
SEEK_S = 0.02
HANG_S = 30.0  # a bound for hangs only: the records arrive in milliseconds or never


class LogConsumer(Consumer):
    """A Faust consumer over one in-memory partition of ``RECORDS`` records, none committed.

    A fetch returns everything from the fetch position; a seek to the committed offsets
    takes a round trip (as it asks the broker). Delivering a record to the agent's queue
    yields to the loop, as Faust's conductor does.
    """

    def __init__(self, app: faust.App, queue: FlowControlQueue[Message]) -> None:
        self.queue = queue
        self.fetch_position = 0
        self.committed = 0
        super().__init__(app.transport, callback=self._deliver, on_partitions_revoked=_nothing,
                         on_partitions_assigned=_nothing)  # fmt: skip

    async def _deliver(self, message: Message) -> None:
        await asyncio.sleep(SEEK_S / 4)  # a busy agent: a fetched batch takes longer than a seek
        self.queue.put_nowait(message)

    async def _getmany(self, active_partitions: set[TP] | None, timeout: float) -> Mapping[TP, list[int]]:
        if active_partitions and PARTITION in active_partitions and self.fetch_position < RECORDS:
            batch = list(range(self.fetch_position, RECORDS))
            self.fetch_position = RECORDS
            return {PARTITION: batch}
        await asyncio.sleep(0.01)  # a fetch with nothing to return waits a little
        return {}

    async def seek_to_committed(self) -> Mapping[TP, int | None]:
        await asyncio.sleep(SEEK_S)  # the broker's answer
        if self.committed > 0:  # as aiokafka: no seek for a partition without a committed offset
            self.fetch_position = self.committed
        return {PARTITION: self.committed or None}

    async def _seek(self, partition: TP, offset: int) -> None:
        self.fetch_position = offset

    def _to_message(self, tp: TP, record: Any) -> ConsumerMessage:
        return ConsumerMessage(tp.topic, tp.partition, record, 0.0, 0, None, None, b"", None, tp=tp,
                               generation_id=self.app.consumer_generation_id)  # fmt: skip

    def _new_topicpartition(self, topic: str, partition: int) -> TP:
        return TP(topic, partition)

    def assignment(self) -> set[TP]:
        return {PARTITION}

    def highwater(self, tp: TP) -> int:
        return RECORDS

    async def highwaters(self, *partitions: TP) -> Mapping[TP, int]:
        return dict.fromkeys(partitions, RECORDS)

    async def earliest_offsets(self, *partitions: TP) -> Mapping[TP, int]:
        return dict.fromkeys(partitions, 0)

    async def position(self, tp: TP) -> int | None:
        return self.fetch_position

    def topic_partitions(self, topic: str) -> int | None:
        return 1

    def key_partition(self, topic: str, key: bytes | None, partition: int | None = None) -> int | None:
        return 0

    async def create_topic(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def subscribe(self, topics: Iterable[str]) -> None:
        return None

    async def seek_wait(self, partitions: Mapping[TP, int]) -> None:
        return None

    async def _commit(self, offsets: Mapping[TP, int]) -> bool:
        return True


async def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


async def delivered_after_resume(guarded: bool, fetched_first: bool = False) -> set[int]:
    """Offsets the agent gets when Faust resumes a recovered worker (``Recovery.on_recovery_completed``);
    ``fetched_first``: the consumer fetches (and the agent's queue takes) the records before the seek."""
    app = faust.App("seek-guard-test", broker="kafka://127.0.0.1:9")
    queue: FlowControlQueue[Message] = FlowControlQueue(flow_control=app.flow_control, clear_on_resume=True)
    consumer = LogConsumer(app, queue)
    if guarded:
        hold_flow_while_seeking(consumer)
    # During recovery the flow is on (changelogs are read) and stream partitions are paused.
    app.flow_control.resume()
    consumer.resume_flow()
    consumer.pause_partitions({PARTITION})
    fetcher = Service()
    draining = asyncio.create_task(consumer._drain_messages(fetcher))
    try:
        consumer.resume_partitions({PARTITION})
        if fetched_first:
            while consumer.fetch_position < RECORDS or queue.qsize() < RECORDS:
                await asyncio.sleep(SEEK_S / 4)
        await consumer.perform_seek()
        app.flow_control.resume()
        consumer.resume_flow()
        offsets: set[int] = set()
        while len(offsets) < RECORDS:
            # A lost record never comes: the bound turns that hang into a failure.
            offsets.add((await asyncio.wait_for(queue.get(), HANG_S)).offset)
        return offsets
    finally:
        draining.cancel()
        await asyncio.gather(draining, return_exceptions=True)


async def test_records_fetched_while_seeking_reach_the_agent_when_the_flow_is_held() -> None:
    assert await delivered_after_resume(guarded=True) == set(range(RECORDS))


async def test_records_fetched_before_the_seek_of_a_partition_never_committed_are_fetched_again() -> None:
    """aiokafka does not seek a partition without a committed offset: the queue the resume
    empties held its only copy of those records, unless the guard seeks it to its beginning."""
    assert await delivered_after_resume(guarded=True, fetched_first=True) == set(range(RECORDS))


class StubConsumer:
    def __init__(self, fails: bool = False) -> None:
        self.flow_active = True
        self.fails = fails
        self.seen: list[bool] = []  # flow_active while each seek ran

    def stop_flow(self) -> None:
        self.flow_active = False

    def resume_flow(self) -> None:
        self.flow_active = True

    async def perform_seek(self) -> None:
        self.seen.append(self.flow_active)
        if self.fails:
            raise TimeoutError("no answer from the broker")

    async def seek_to_committed(self) -> Mapping[TP, int | None]:
        return {}

    async def seek(self, partition: TP, offset: int) -> None:
        return None


async def test_the_flow_is_stopped_during_the_seek_and_left_for_the_caller_to_resume() -> None:
    consumer = StubConsumer()
    hold_flow_while_seeking(consumer)
    hold_flow_while_seeking(consumer)  # guarded once
    await consumer.perform_seek()
    assert consumer.seen == [False] and not consumer.flow_active


async def test_a_failed_seek_leaves_the_flow_as_it_was() -> None:
    consumer = StubConsumer(fails=True)
    hold_flow_while_seeking(consumer)
    with pytest.raises(TimeoutError):
        await consumer.perform_seek()
    assert consumer.seen == [False] and consumer.flow_active
