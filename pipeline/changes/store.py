"""Writing a change marker and reading the changes topic whole (the CLI, the shipper, the web page)."""

from __future__ import annotations

import logging

import orjson
from pydantic import ValidationError

from servewatch.pipeline import topics
from servewatch.pipeline.kafka import PLAINTEXT, KafkaAuth, follow_topic, send_one
from servewatch.schemas.change_marker import ChangeMarker
from servewatch.schemas.change_report import ChangeReport

logger = logging.getLogger(__name__)


async def write_marker(bootstrap: str, marker: ChangeMarker, auth: KafkaAuth = PLAINTEXT) -> None:
    """Publish ``marker`` on ``servewatch.changes``, keyed by its model; returns once the broker has it."""
    await send_one(bootstrap, topics.CHANGES, marker.model.encode(), marker.model_dump_json().encode(), auth)


def parse_change_record(raw: bytes | None) -> ChangeMarker | ChangeReport | None:
    """A record of the changes topic by its ``kind`` (None, logged, when unreadable)."""
    if not raw:
        return None
    try:
        value = orjson.loads(raw)
        kind = value.get("kind") if isinstance(value, dict) else None
        if kind == "change_report":
            return ChangeReport.model_validate(value)
        if kind == "change_marker":
            return ChangeMarker.model_validate(value)
        logger.warning("skipped a record of the changes topic of kind %r", kind)
        return None
    except orjson.JSONDecodeError as exc:
        logger.warning("skipped a record of the changes topic that is not JSON: %s", exc)
    except ValidationError as exc:
        logger.warning("skipped an unreadable record of the changes topic: %s", exc.errors()[0]["msg"])
    return None


async def read_changes(bootstrap: str, auth: KafkaAuth = PLAINTEXT) -> tuple[list[ChangeMarker], list[ChangeReport]]:
    """Every marker and report of the changes topic, in topic order."""
    markers: list[ChangeMarker] = []
    reports: list[ChangeReport] = []
    async for record in follow_topic(bootstrap, topics.CHANGES, follow=False, auth=auth):
        parsed = parse_change_record(record.value)
        if isinstance(parsed, ChangeMarker):
            markers.append(parsed)
        elif isinstance(parsed, ChangeReport):
            reports.append(parsed)
    return markers, reports
