"""The worker's second step: partials and engine intervals in, incident events out.

One judging step at a time, from judging to its state on the broker (``step``): the agents
and the timers interleave at every await, and a step's state taken while another step's
events are still on their way would be stored before them. Within a step: events first,
then state, both on the broker before the partials that fed them are acknowledged
(``StageTwo.judged_and_stored``). A kill between the two leaves the state from before the
events and the partials unacknowledged: the next worker judges those windows again and
publishes the same events (same fingerprints), at least once. Stored first, a state that
says "firing" would hide an event never sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from servewatch.pipeline.messages.dead_letters import internal_error
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.messages.partitioning import partition_of
from servewatch.pipeline.worker import segment_metrics
from servewatch.pipeline.worker.engine_stage import JudgeEngines
from servewatch.pipeline.worker.publishing import EventPublisher
from servewatch.pipeline.worker.stage_two import StageTwo
from servewatch.pipeline.worker.state_store import DetectorStateStore
from servewatch.schemas.anomaly import AnomalyEvent

logger = logging.getLogger(__name__)


class Judging:
    """Judges segment windows (``StageTwo``) and engine intervals (``JudgeEngines``), stores
    their detectors' state (``DetectorStateStore``) and publishes what they found."""

    def __init__(
        self, stage_two: StageTwo, engines: JudgeEngines, store: DetectorStateStore, publisher: EventPublisher
    ) -> None:
        self.stage_two = stage_two
        self.engines = engines
        self.store = store
        self.publisher = publisher
        self.lock = asyncio.Lock()
        # The worker publishes judged windows for charts, and the engines' ratios to their
        # peers for the replica table; each detector restores what the store holds. Engines'
        # keys (``instance|model``) never look like a segment's (``model=...|route=...``).
        stage_two.bank.series, engines.peers.series = [], []
        stage_two.bank.restore = engines.bank.restore = engines.peers.restore = store.restore

    async def on_partials(self, raw: bytes, via: int, token: Any) -> None:
        """A partials message; ``token`` is acknowledged once every window it fed was judged
        and the state covering them stored: a worker killed while a window waits for other
        partitions' partials reads them again and judges those windows as it would have."""
        await self.step(lambda: self.stage_two.receive(raw, via=via, token=token))

    async def release_due(self) -> None:
        """Judge the windows that waited long enough for their partitions' partials."""
        await self.step(self.stage_two.release_due)

    async def on_scrapes(self, raw: bytes | None, origin: MessageOrigin) -> None:
        """An engine interval (``servewatch scrape``), judged on the engines' capacity signals."""
        async with self.lock:
            try:
                events, letters = self.engines.receive(raw, origin)
            except Exception as exc:
                logger.exception("failed to judge engine interval %s/%s", origin.partition, origin.offset)
                events, letters = [], [internal_error(raw, origin, exc)]
            await self.publisher.publish_dead_letters(letters, where="scrapes ")
            await self._store_and_publish(events)

    async def step(self, judge: Callable[[], list[AnomalyEvent]]) -> None:
        """Run one judging step; a bug in judging costs that step, never the worker."""
        async with self.lock:
            try:
                events = judge()
            except Exception:
                logger.exception("stage 2 failed to judge windows")
                return
            await self._store_and_publish(events)
            self._acknowledge_judged()

    async def store_every_state(self, occasion: str) -> None:
        """Store every segment's and engine's latest state, for whoever judges them next
        (a worker stopping on purpose, or one whose partitions move)."""
        async with self.lock:  # not in the middle of a step whose events are on their way
            self._save(every_one=True, occasion=occasion)
            await self.store.delivered()
            self._acknowledge_judged()

    async def hand_over(self, segments: set[int], engines: set[int]) -> None:
        """Partials (``segments``) and scrapes (``engines``) partitions revoked. Their state is
        in the table, now every one's latest: whoever judges them next restores it, and so does
        this worker if they come back, rather than keep a copy another worker moved past."""
        if not (segments or engines):
            return
        async with self.lock:
            self._save(every_one=True, occasion=" on revocation")
        partitions = self.store.partitions
        bank = self.stage_two.bank
        for key in [key for key in bank.detectors if partition_of(key, partitions) in segments]:
            segment_metrics.forget_segment(key)  # whoever judges it now publishes its gauges
        bank.forget(lambda key: partition_of(key, partitions) in segments)
        self.stage_two.hand_over(segments)
        self.engines.bank.forget(lambda key: partition_of(key, partitions) in engines)
        if engines:  # a model's engines may span partitions: each model is met again from the store
            self.engines.peers.forget()

    async def _store_and_publish(self, events: list[AnomalyEvent]) -> None:
        await self.publisher.publish_events(events)
        self._save()
        await self.store.delivered()
        points = [*(self.stage_two.bank.series or []), *(self.engines.peers.series or [])]
        self.stage_two.bank.series, self.engines.peers.series = [], []
        await self.publisher.publish_series(points)
        letters, self.stage_two.late_letters = self.stage_two.late_letters, []
        await self.publisher.publish_late_letters(letters)

    def _save(self, every_one: bool = False, occasion: str = "") -> None:
        quiet = self.stage_two.bank if self.stage_two.quiet() else None
        banks = (self.stage_two.bank, self.engines.bank, self.engines.peers)
        self.store.save(banks, every_one=every_one, quiet_bank=quiet, occasion=occasion)

    def _acknowledge_judged(self) -> None:
        """Acknowledge the partials messages whose windows' events and states are on the broker
        (none while a state write has failed: those windows are in no stored state)."""
        if not self.store.failed:
            for message in self.stage_two.judged_and_stored():
                message.ack()
