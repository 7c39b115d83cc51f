"""Writes to a changelog-backed Faust table that can be awaited until they are on the broker.

``table[key] = value`` hands the changelog record to Faust's buffer and returns; the
producer's own flush can return before a record still on its way from that buffer to the
client (Faust waits 0.1 s at most). A state that covers offsets about to be committed, or a
notification reported done, must be on the broker first: ``DurableWrites`` writes as the
table does, keeps each record's future, and ``delivered`` awaits them in order.

Writes come from timers and hooks too, where Faust has no current event: its RocksDB store
takes the partition of a write from the current event's message (and asserts there is one),
so each write is made under a stand-in event of the key's own partition. Under a real
event of another partition (a scrape's, a partials message of another partition) it would
land in that partition's database, which the worker drops when the partition moves.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from faust.streams import _current_event

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Message:
    partition: int


@dataclass(frozen=True)
class _AtPartition:
    """What a Faust store reads of the current event when writing: its message's partition."""

    message: _Message


class DurableWrites:
    """``put`` as ``table[key] = value`` does; ``await delivered()`` before relying on it.

    ``on_failure(exc)``: a record the broker refused, or that never reached it; without one,
    ``delivered`` raises the first such failure (after waiting for the rest of none)."""

    def __init__(self, table: Any, on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.table = table
        self.on_failure = on_failure
        self.unsent: list[Any] = []  # changelog records written, not yet acknowledged

    def put(self, key: bytes, value: bytes, partition: int) -> None:
        """Write ``key``, whose partition is ``partition``. The changelog record is placed by
        the table's own partitioner (``use_partitioner``), which puts the key there too."""
        table = self.table
        self.unsent.append(table.send_changelog(table.partition_for_key(key), key, value))
        at = _AtPartition(_Message(partition))
        token = _current_event.set(weakref.ref(at))  # type: ignore[arg-type]
        try:
            table.data[key] = value
        finally:
            _current_event.reset(token)

    async def delivered(self) -> None:
        while self.unsent:
            try:
                await self.unsent.pop(0)
            except Exception as exc:
                if self.on_failure is None:
                    raise
                self.on_failure(exc)
