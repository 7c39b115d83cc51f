"""The worker's last step: each incident event into its group, onto the anomaly topic.

Incidents are keyed by model, so one worker sees all of a model's and groups them
(``models.detect.grouping``). Each record is on the broker before the next incident is read,
so an incident's offset is never committed ahead of what it published: a kill -9 loses no page.
"""

from __future__ import annotations

import logging

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.pipeline import topics
from servewatch.pipeline.messages.dead_letters import dead_letter, why_unreadable
from servewatch.pipeline.messages.decode import read_incident_event
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.worker import metrics
from servewatch.pipeline.worker.outbox import Outbox
from servewatch.pipeline.worker.publishing import EventPublisher

logger = logging.getLogger(__name__)


class IncidentGrouping:
    """Puts incident events in groups and publishes each with its group's own records."""

    def __init__(self, outbox: Outbox, publisher: EventPublisher, grouper: IncidentGrouper | None = None) -> None:
        self.outbox = outbox
        self.publisher = publisher
        self.grouper = grouper or IncidentGrouper()

    async def on_incident(self, raw: bytes, origin: MessageOrigin) -> None:
        try:
            event = read_incident_event(raw)
        except ValueError as exc:  # not an incident event this version can read: kept, counted
            letter = dead_letter("invalid_incident", why_unreadable(exc), raw, origin)
            metrics.DEAD_LETTERS.labels(letter.reason).inc()  # stage one counts the requests' own
            await self.publisher.publish_dead_letters([letter])
            return
        try:
            event, told = self.grouper.add(event)
        except Exception:
            logger.exception("failed to group an incident event; published as it came")
            told = []
        model = event.segment.get("model", "other").encode()  # by model: see topics.ANOMALIES
        await (await self.outbox.send(topics.ANOMALIES, event.model_dump_json().encode(), key=model))
        logger.info("anomaly %s %s %s: %s", event.status.value, event.signal.value, event.severity.value,
                    event.summary)  # fmt: skip
        for group in told:
            await (await self.outbox.send(topics.ANOMALIES, group.model_dump_json().encode(), key=model))
            logger.info("incident group %s: %s", group.transition, group.title)
