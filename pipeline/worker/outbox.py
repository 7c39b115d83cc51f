"""Where the worker's stages send records: a topic name, a value, a key and a partition.

``send`` hands a record to the producer and returns its delivery, an awaitable that is done
once the record is on the broker. A stage sends a step's records, then awaits their
deliveries before it acknowledges what they cover: a crash in between replays the step
rather than lose its records. ``FaustOutbox`` sends on the worker's Faust topics; tests
hand a stage a list that records what it was given.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable
from dataclasses import fields
from typing import Any, Protocol

from servewatch.pipeline.topics import Topics


class Outbox(Protocol):
    async def send(
        self, topic: str, value: bytes, key: bytes | None = None, partition: int | None = None
    ) -> Awaitable[Any]: ...


class FaustOutbox:
    """Sends on the app's declared topics (``pipeline.topics``), by topic name."""

    def __init__(self, topics: Topics) -> None:
        channels = (getattr(topics, field.name) for field in fields(topics))
        self._by_name = {channel.get_topic_name(): channel for channel in channels}

    async def send(
        self, topic: str, value: bytes, key: bytes | None = None, partition: int | None = None
    ) -> Awaitable[Any]:
        return await self._by_name[topic].send(key=key, value=value, partition=partition)


async def delivered(deliveries: Iterable[Awaitable[Any]]) -> None:
    """Wait until every record sent is on the broker (a refused one raises)."""
    for delivery in deliveries:
        await delivery
