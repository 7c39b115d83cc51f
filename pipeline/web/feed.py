"""The triage page's Kafka side: the topics it shows, read into the store, and verdicts out.

The web process has no state of its own to lose: on start it reads ``servewatch.anomalies``,
``servewatch.series``, ``servewatch.feedback`` and ``servewatch.changes`` (markers and the
reports verifying them) from their beginning (no consumer group, so any number of web
processes can run) and keeps following them. A record it cannot read
(another version, a bad producer) is skipped with a warning; the page must not stop for one.
Verdicts are written to ``servewatch.feedback`` keyed by group, so a group's verdicts stay
in order on one partition.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import orjson
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from servewatch.pipeline import topics
from servewatch.pipeline.kafka import PLAINTEXT, KafkaAuth, producer, read_topic
from servewatch.pipeline.web.store import Record, TriageStore
from servewatch.schemas.change_marker import ChangeMarker
from servewatch.schemas.change_report import ChangeReport
from servewatch.schemas.feedback import Feedback
from servewatch.schemas.incident_group import IncidentGroup, parse_anomaly_record
from servewatch.schemas.series import SeriesPoint

logger = logging.getLogger(__name__)


def parse_change(raw: bytes) -> ChangeMarker | ChangeReport:
    """A record of ``servewatch.changes``: a report by its ``kind``, else a marker (ValueError when neither)."""
    data = orjson.loads(raw)
    if isinstance(data, dict) and data.get("kind") == "change_report":
        return ChangeReport.model_validate(data)
    return ChangeMarker.model_validate(data)


#: How each followed topic's records are read.
PARSERS: dict[str, Callable[[bytes], Record]] = {
    topics.ANOMALIES: parse_anomaly_record,
    topics.SERIES: SeriesPoint.model_validate_json,
    topics.FEEDBACK: Feedback.model_validate_json,
    topics.CHANGES: parse_change,
}
RETRY_S = 2.0

OnGroup = Callable[[IncidentGroup], Awaitable[object]]


async def fold_topic(
    store: TriageStore, bootstrap: str, topic: str, auth: KafkaAuth = PLAINTEXT, on_group: OnGroup | None = None
) -> None:
    """Fold ``topic`` into ``store`` from its beginning, until cancelled; reconnect after a
    broker error (the store keeps what it had; records read again are folded idempotently)."""
    parse = PARSERS[topic]
    while True:
        try:
            async for raw in read_topic(bootstrap, topic, auth=auth):
                try:
                    record = parse(raw)
                except (ValidationError, ValueError) as exc:
                    logger.warning("unreadable record on %s skipped: %s", topic, str(exc).splitlines()[0])
                    continue
                store.add(record)
                if on_group is not None and isinstance(record, IncidentGroup):
                    await on_group(record)
        except (KafkaError, OSError) as exc:
            logger.warning("reading %s failed (%s); retrying in %.0f s", topic, type(exc).__name__, RETRY_S)
            await asyncio.sleep(RETRY_S)


async def follow(
    store: TriageStore, bootstrap: str, auth: KafkaAuth = PLAINTEXT, on_group: OnGroup | None = None
) -> None:
    """Follow every topic the page shows, until cancelled."""
    async with asyncio.TaskGroup() as tasks:
        for topic in PARSERS:
            tasks.create_task(fold_topic(store, bootstrap, topic, auth, on_group))


class FeedbackPublisher:
    """Writes verdicts to ``servewatch.feedback``; ``await publisher(feedback)`` returns once
    the broker has it (so the page says "recorded" only then)."""

    def __init__(self, bootstrap: str, auth: KafkaAuth = PLAINTEXT) -> None:
        self._producer = producer(bootstrap, auth=auth)

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    async def __call__(self, feedback: Feedback) -> None:
        # Bounded: an idempotent producer retries until the broker answers, and a person
        # waiting on the button should hear "not recorded, try again" instead.
        send = self._producer.send_and_wait(
            topics.FEEDBACK, feedback.model_dump_json().encode(), key=feedback.group.encode()
        )
        await asyncio.wait_for(send, self._producer.request_timeout_s)
