"""The detectors' state in a changelog-backed table keyed by segment (or engine).

State is a cache of what the models learned: a write that fails is counted and logged,
never worth an event or the worker. Until a later write succeeds, nothing judged since is
acknowledged (``failed``): those windows are in no stored state, and a restart judges
them again. Segments idle long enough to be dropped take their state and gauges with them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, cast

import orjson

from servewatch.pipeline.messages.partitioning import partition_of
from servewatch.pipeline.streams.durable_table import DurableWrites
from servewatch.pipeline.worker import metrics, segment_metrics

logger = logging.getLogger(__name__)


class DetectorStateStore:
    """Reads and writes detector states in ``table`` (a Faust table of bytes, or any mapping
    with ``send_changelog``/``partition_for_key`` as ``DurableWrites`` needs)."""

    def __init__(self, table: Any, partitions: int) -> None:
        self.table = table
        self.partitions = partitions
        self.failed = False  # a write failed: every state is written again at the next save
        self.writes = DurableWrites(table, on_failure=self._not_delivered)

    def restore(self, key: str) -> dict[str, Any] | None:
        """The stored state of ``key``, or None for a segment or engine never stored."""
        stored = self.table.get(key.encode())
        return None if stored is None else cast(dict[str, Any], orjson.loads(stored))

    def save(self, banks: Iterable[Any], every_one: bool = False, quiet_bank: Any = None, occasion: str = "") -> None:
        """Store what each bank says is due (``every_one``: every segment's latest), and drop
        the state of segments the banks expired. ``quiet_bank`` may store its unsaved segments
        too (its stage is quiet). Never raises."""
        every_one, self.failed = every_one or self.failed, False
        try:
            for bank in banks:
                due = (
                    bank.states_to_save(every_one, unsaved=True)
                    if bank is quiet_bank
                    else bank.states_to_save(every_one)
                )
                for key, state in due:
                    self.writes.put(key.encode(), orjson.dumps(state), partition_of(key, self.partitions))
                self._drop_expired(bank)
        except Exception as exc:
            self._not_delivered(exc, occasion)

    async def delivered(self) -> None:
        """Wait until every state written is on the broker (a failure is counted, not raised)."""
        await self.writes.delivered()

    def _drop_expired(self, bank: Any) -> None:
        """Segments idle for ``segment_idle_s``: their state and gauges go too."""
        expired = getattr(bank, "expired", None)
        while expired:
            key = expired.pop()
            self.table.pop(key.encode(), None)
            segment_metrics.forget_segment(key)

    def _not_delivered(self, exc: BaseException, occasion: str = "") -> None:
        metrics.STATE_WRITE_FAILURES.inc()
        logger.warning("detector state not stored%s (%r): a restart would relearn those segments", occasion, exc)
        self.failed = True
