"""The worker's first step: requests messages in, closed windows' partials out.

A requests message is acknowledged (its offset committed) only once every window it fed
has been sent on to the partials topic and is on the broker, so a crash replays what was
still in memory (``StageOne.safe_to_ack``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from servewatch.models.windows.window import WindowStats
from servewatch.pipeline import topics
from servewatch.pipeline.messages.dead_letters import internal_error
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.worker.outbox import Outbox, delivered
from servewatch.pipeline.worker.publishing import EventPublisher
from servewatch.pipeline.worker.stage_one import StageOne

logger = logging.getLogger(__name__)


class RequestAggregation:
    """Folds requests messages into windows (``StageOne``) and sends the closed ones on."""

    def __init__(self, stage_one: StageOne, outbox: Outbox, publisher: EventPublisher, partitions: int) -> None:
        self.stage_one = stage_one
        self.outbox = outbox
        self.publisher = publisher
        self.partitions = partitions  # of the partials topic

    async def on_message(self, raw: bytes | None, origin: MessageOrigin, token: Any) -> None:
        """One requests message; ``token`` is acknowledged once what it fed is sent on. A bug
        costs the message (dead-lettered as ``internal_error``), never the worker."""
        try:
            letters, partials = self.stage_one.process(raw, origin, token=token)
        except Exception as exc:
            logger.exception("failed to process message %s/%s", origin.partition, origin.offset)
            letters, partials = [internal_error(raw, origin, exc)], []
            self.stage_one.acknowledge_in_order(origin.partition or 0, token)
        await self.publisher.publish_dead_letters(letters)
        await self.send_and_acknowledge(partials)

    async def on_batch(
        self, topic: str, partition: int, messages: Sequence[tuple[bytes | None, int]], token_of: Callable[[int], Any]
    ) -> None:
        """Messages of one partition in offset order, with cumulative tokens (``BatchReader``):
        as ``on_message`` for each, runs of one-record messages decoded and folded together."""
        try:
            letters, partials = self.stage_one.process_batch(topic, partition, messages, token_of)
        except Exception:
            # A bug: message by message, so that only the message that meets it is lost (those
            # folded before it are taken as read already).
            logger.exception("failed to process a batch of partition %s; going message by message", partition)
            for raw, offset in messages:
                await self.on_message(raw, MessageOrigin(topic, partition, offset), token_of(offset))
            return
        await self.publisher.publish_dead_letters(letters)
        await self.send_and_acknowledge(partials)

    async def flush_idle(
        self, broker_answers: Callable[[], Awaitable[bool]], unread: Callable[[], Awaitable[set[int]]] | None = None
    ) -> None:
        """Advance quiet partitions' event time and send the windows that closes. Silence is
        idleness only while the broker answers (``BrokerWatch``) and where nothing is left to
        read (``unread``, the partitions whose end is past the consumer's position): asked
        when partitions go quiet."""
        waiting: set[int] = set()
        if self.stage_one.quiet():
            if not await broker_answers():
                return
            if unread is not None:
                waiting = await unread()
        await self.send_and_acknowledge(self.stage_one.flush_idle(unread=waiting))

    def take_over(self, partitions: set[int]) -> None:
        """Requests partitions assigned: they hold the windows open until read (``StageOne.take_over``)."""
        self.stage_one.take_over(partitions)

    async def hand_over(self, partitions: set[int]) -> None:
        """Requests partitions revoked: send what their open windows hold, as if they closed."""
        if partitions:
            await self.send_and_acknowledge(self.stage_one.drop_partitions(partitions))

    async def send_and_acknowledge(self, partials: list[WindowStats]) -> None:
        """Send, then wait until every bundle is on the broker before acknowledging the
        requests messages they cover: Faust's flush before a commit can miss a record still on
        its way from its buffer to the client (``DurableWrites`` says more)."""
        sent = [
            await self.outbox.send(topics.PARTIALS, bundle, partition=partition)
            for partition, bundle in self.stage_one.bundles(partials, self.partitions)
        ]
        await delivered(sent)
        for event in self.stage_one.safe_to_ack():
            event.ack()
