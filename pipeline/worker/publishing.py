"""What the worker publishes after judging: incident events (with what the engines say, the
change they follow and their evidence read back), chart points, and dead letters.

Every ``publish_*`` sends its records and returns once they are on the broker: the steps
that call them acknowledge their input next (``pipeline.worker.outbox``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from servewatch.models.explain.changes import ChangeBook, mention_change
from servewatch.models.explain.evidence_sample import EvidenceBudget, MessageKey
from servewatch.pipeline import topics
from servewatch.pipeline.worker import segment_metrics
from servewatch.pipeline.worker.engine_stage import JudgeEngines
from servewatch.pipeline.worker.evidence import resolve
from servewatch.pipeline.worker.outbox import Outbox, delivered
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.dead_letter import DeadLetter
from servewatch.schemas.series import SeriesPoint

logger = logging.getLogger(__name__)

ReadMessages = Callable[[set[MessageKey]], Awaitable[dict[MessageKey, bytes]]]


class EventPublisher:
    """Completes judged events and sends them to the incidents topic, keyed by model (every
    incident of a model reaches the one worker that groups them)."""

    def __init__(
        self, outbox: Outbox, engines: JudgeEngines, read_messages: ReadMessages, budget: EvidenceBudget,
        segment_of: Callable[[Any], str], window_s: float, change_horizon_windows: int,
    ) -> None:  # fmt: skip
        self.outbox = outbox
        self.engines = engines
        self.read_messages = read_messages
        self.budget = budget
        self.segment_of = segment_of  # a scan's filter: never registers a segment
        self.window_s = window_s
        self.change_horizon_windows = change_horizon_windows
        self.changes = ChangeBook()  # markers read by ``pipeline.worker.followers``

    async def publish_events(self, events: list[AnomalyEvent]) -> None:
        events = await self.completed(events)
        sent = []
        for event in events:
            model = event.segment.get("model", "other").encode()
            sent.append(await self.outbox.send(topics.INCIDENTS, event.model_dump_json().encode(), key=model))
        await delivered(sent)

    async def completed(self, events: list[AnomalyEvent]) -> list[AnomalyEvent]:
        """The events as they are published: with what the engines say, the change each follows
        (its first suspect) and their evidence read back, each step giving new events."""
        explained = self.engines.explain(events)
        told = [mention_change(e, self.changes, self.window_s, self.change_horizon_windows) for e in explained]
        return await resolve(told, self.read_messages, self.budget, self.segment_of)

    async def publish_series(self, points: list[SeriesPoint]) -> None:
        """Judged windows as chart points, by segment, and as per-segment gauges; the engines'
        ratios to their peers as replica table rows."""
        if not points:
            return
        segment_metrics.record_points(points)
        for point in points:
            await self.outbox.send(topics.SERIES, point.model_dump_json().encode(), key=point.key.encode())

    async def publish_dead_letters(self, letters: list[DeadLetter], where: str = "") -> None:
        for letter in letters:
            logger.warning("dead letter (%s) at %s%s/%s: %s", letter.reason, where, letter.source_partition,
                           letter.source_offset, letter.error)  # fmt: skip
            await self.outbox.send(topics.DEADLETTER, letter.model_dump_json().encode())

    async def publish_late_letters(self, letters: list[DeadLetter]) -> None:
        """Records that came after their window was judged: counted by reason in
        ``servewatch_late_records_total``, logged once per batch rather than per letter."""
        if not letters:
            return
        logger.warning("%d late-record letters dead-lettered (servewatch_late_records_total counts the records); "
                       "first: %s", len(letters), letters[0].error)  # fmt: skip
        for letter in letters:
            await self.outbox.send(topics.DEADLETTER, letter.model_dump_json().encode())
