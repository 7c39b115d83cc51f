"""``servewatch replay --scrapes``: recorded ``/metrics`` scrapes through the engine detectors, no broker.

A record is what ``servewatch scrape --record`` writes, one JSON line per good scrape:
``{"timestamp": <unix s>, "instance": "host:port", "body": "<exposition text>"}``. Lines
are fed in file order to the scraper's ``IntervalTracker`` (so intervals come from bucket
and counter deltas exactly as live) and each interval to the worker's ``JudgeEngines``.
A line that is not such a record, or whose body is not an exposition, is rejected with
its line number and reason, and the replay goes on. A day recorded replays in seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import orjson
from prometheus_client.metrics_core import Metric

from servewatch.pipeline.ingest.scrape.exposition import Snapshot, parse, read_families
from servewatch.pipeline.ingest.scrape.scraper import IntervalTracker
from servewatch.pipeline.messages.dead_letters import dead_letter
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.worker.engine_stage import JudgeEngines
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.dead_letter import DeadLetter

logger = logging.getLogger(__name__)


@dataclass
class ScrapeReplayStats:
    scrapes: int = 0
    intervals: int = 0
    events: int = 0
    rejected: int = 0
    rejected_samples: list[DeadLetter] = field(default_factory=list)


class ScrapeReplay:
    """Feed recorded scrapes (JSON lines, bytes) through ``JudgeEngines``; yields its events.

    ``engines`` is kept: a request-log replay after it names the instances whose metrics
    said ``enable_prefix_caching=False`` (``JudgeEngines.explain``).
    """

    def __init__(self, settings: Settings | None = None) -> None:
        self.engines = JudgeEngines(settings or Settings())
        self.tracker = IntervalTracker()
        self.stats = ScrapeReplayStats()

    def feed(self, line: bytes, number: int) -> list[AnomalyEvent]:
        """One line of a record (``number``: its line number from 1, for rejections)."""
        if not line.strip():
            return []
        source = MessageOrigin(topic="scrapes-file", partition=0, offset=number)
        try:
            record = orjson.loads(line)
            timestamp, instance, body = float(record["timestamp"]), str(record["instance"]), str(record["body"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return self._reject("invalid_record", f"not a recorded scrape ({type(exc).__name__}: {exc})", line, source)
        try:
            snapshot = parse(body, instance, timestamp)
        except ValueError as exc:
            return self._reject("invalid_exposition", str(exc), line, source)
        return self._judge(snapshot)

    def feed_families(self, families: Iterable[Metric], instance: str, timestamp: float) -> list[AnomalyEvent]:
        """One scrape as metric families, as a collector holds them before rendering them as
        text (the simulated engines': ``pipeline.dev.sim_scrapes``); read as the text parser
        reads the same families (``exposition.read_families``)."""
        return self._judge(read_families(families, instance, timestamp))

    def _judge(self, snapshot: Snapshot) -> list[AnomalyEvent]:
        intervals = self.tracker.feed_snapshot(snapshot)
        self.stats.scrapes += 1
        events = [event for interval in intervals for event in self.engines.judge(interval)]
        self.stats.intervals += len(intervals)
        self.stats.events += len(events)
        return events

    def _reject(self, reason: str, error: str, line: bytes, source: MessageOrigin) -> list[AnomalyEvent]:
        self.stats.rejected += 1
        if len(self.stats.rejected_samples) < 20:
            self.stats.rejected_samples.append(dead_letter(reason, error, line, source))
        logger.debug("scrape record line %d rejected: %s", source.offset, error)
        return []

    def run(
        self, lines: Iterable[bytes], progress: Callable[[ScrapeReplayStats], None] | None = None
    ) -> Iterator[AnomalyEvent]:
        last_report = time.monotonic()
        for number, line in enumerate(lines, start=1):
            yield from self.feed(line, number)
            if progress is not None and time.monotonic() - last_report >= 0.5:
                progress(self.stats)
                last_report = time.monotonic()
