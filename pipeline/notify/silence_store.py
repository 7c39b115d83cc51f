"""Silences on Kafka: written by ``servewatch silence``, followed by every notifier.

The silences topic is compacted and keyed by silence id, so it *is* the table of silences:
every notifier reads it whole from the beginning (no consumer group: each needs every
silence) and keeps following it. ``SilenceFeed.ready`` is set once the topic has been read
up to the end it had at start, and the notifier plans nothing before that, so a restarted
notifier cannot page for a group that a silence mutes.
"""

from __future__ import annotations

import asyncio
import logging

from pydantic import ValidationError

from servewatch.pipeline import topics
from servewatch.pipeline.kafka import PLAINTEXT, KafkaAuth, follow_topic, send_one
from servewatch.pipeline.notify.silences import SilenceBook
from servewatch.schemas.silence import Silence

logger = logging.getLogger(__name__)


class SilenceFeed:
    def __init__(self, bootstrap: str, book: SilenceBook, auth: KafkaAuth = PLAINTEXT) -> None:
        self.bootstrap = bootstrap
        self.book = book
        self.auth = auth
        self.ready = asyncio.Event()

    async def run(self, follow: bool = True) -> None:
        """Read every silence, set ``ready`` at the end the topic had at start, then keep following."""
        async for record in follow_topic(self.bootstrap, topics.SILENCES, follow=follow, auth=self.auth):
            self._apply(record.value)
            if record.caught_up and not self.ready.is_set():
                logger.info("silences read: %d known", len(self.book.all()))
                self.ready.set()

    async def run_forever(self, retry_s: float = 2.0) -> None:
        """``run``, started again after a failure (the broker away, a rebalance of metadata):
        a notifier that stopped following silences would page through new ones."""
        while True:
            try:
                await self.run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("silences feed failed (%s); reading them again in %.0f s", exc, retry_s)
                await asyncio.sleep(retry_s)

    def _apply(self, raw: bytes | None) -> None:
        if raw is None:
            return
        try:
            self.book.apply(Silence.model_validate_json(raw))
        except ValidationError as exc:
            logger.warning("skipped an unreadable silence record: %s", exc.errors()[0]["msg"])


async def read_silences(bootstrap: str, auth: KafkaAuth = PLAINTEXT) -> list[Silence]:
    """Every silence's latest record, as the notifiers see them."""
    book = SilenceBook()
    await SilenceFeed(bootstrap, book, auth).run(follow=False)
    return book.all()


async def write_silence(bootstrap: str, silence: Silence, auth: KafkaAuth = PLAINTEXT) -> None:
    await send_one(bootstrap, topics.SILENCES, silence.id.encode(), silence.model_dump_json().encode(), auth)
