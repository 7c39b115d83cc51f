"""Writes to a changelog-backed Faust table that can be awaited until they are on the broker.

``table[key] = value`` hands the changelog record to Faust's buffer and returns; the
producer's own flush can return before a record still on its way from that buffer to the
client (Faust waits 0.1 s at most). A state that covers offsets about to be committed, or a
notification reported done, must be on the broker first: ``DurableWrites`` writes as the
table does, keeps each record's future, and ``delivered`` awaits them in order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class DurableWrites:
    """``put`` as ``table[key] = value`` does; ``await delivered()`` before relying on it.

    ``on_failure(exc)``: a record the broker refused, or that never reached it; without one,
    ``delivered`` raises the first such failure (after waiting for the rest of none)."""

    def __init__(self, table: Any, on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.table = table
        self.on_failure = on_failure
        self.unsent: list[Any] = []  # changelog records written, not yet acknowledged

    def put(self, key: bytes, value: bytes) -> None:
        table = self.table
        self.unsent.append(table.send_changelog(table.partition_for_key(key), key, value))
        table.data[key] = value

    async def delivered(self) -> None:
        while self.unsent:
            try:
                await self.unsent.pop(0)
            except Exception as exc:
                if self.on_failure is None:
                    raise
                self.on_failure(exc)
