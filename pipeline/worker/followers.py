"""Topics every worker reads whole, with no consumer group: on-call's feedback and change markers.

A reader that fails (the broker away, a topic not there yet) reads again from the start
after a pause; a record it cannot read is skipped with a warning.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import orjson

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.models.detect.tolerance import Tolerances
from servewatch.models.explain.changes import ChangeBook
from servewatch.schemas.change_marker import ChangeMarker
from servewatch.schemas.feedback import Feedback

logger = logging.getLogger(__name__)

#: Seconds between a reader's failure and its next attempt.
RETRY_S = 2.0


async def follow(read: Callable[[], AsyncIterator[bytes]], take: Callable[[bytes], None], what: str) -> None:
    """Give ``take`` every record ``read`` yields, forever; read again after a failure."""
    while True:
        try:
            async for raw in read():
                try:
                    take(raw)
                except ValueError as exc:
                    logger.warning("skipped an unreadable %s: %s", what, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("%s reader failed (%s); reading again in %g s", what, exc, RETRY_S)
            await asyncio.sleep(RETRY_S)


def take_feedback(
    grouper: IncidentGrouper, tolerances: Tolerances, clock: Callable[[], float]
) -> Callable[[bytes], None]:
    """On-call's verdicts: the grouper carries them on the group's records, and an ``expected``
    widens the group's signals' tolerance in its model (``models.detect.tolerance``)."""

    def take(raw: bytes) -> None:
        feedback = Feedback.model_validate_json(raw)
        grouper.note_feedback(feedback)
        tolerances.apply(feedback, now=clock())
        logger.info("feedback on group %s: %s by %s", feedback.group, feedback.verdict, feedback.by)

    return take


def take_change_markers(changes: ChangeBook) -> Callable[[bytes], None]:
    """Change markers, so that an incident starting soon after one names it
    (``models.explain.changes``); the change reports on the same topic are skipped."""

    def take(raw: bytes) -> None:
        value = orjson.loads(raw)
        if isinstance(value, dict) and value.get("kind") == "change_marker":
            changes.add(ChangeMarker.model_validate(value))

    return take
