"""Scrape vLLM/SGLang ``/metrics`` endpoints and turn each pair of scrapes into ``EngineInterval``s.

``IntervalTracker`` holds the last parsed scrape per instance and is all the logic: the
live ``Scraper`` (HTTP, health, timeouts) and a replay of recorded scrapes both feed it
``(instance, timestamp, body)``. A target that fails (refused, timed out, an HTTP error,
text that is not an exposition) is marked down and keeps its last good scrape, so the
next good one covers the whole gap; a server that restarted shows as ``counter_reset``.

Recorded scrapes are JSON lines ``{"timestamp": <unix s>, "instance": "host:port",
"body": "<exposition text>"}``, the format ``servewatch scrape --record`` writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from servewatch.pipeline.ingest.scrape.exposition import Snapshot, interval, parse
from servewatch.schemas.engine_interval import EngineInterval

logger = logging.getLogger(__name__)


def instance_of(url: str) -> str:
    """``host:port`` of a metrics URL, the ``instance`` label Prometheus would give it."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


def check_targets(targets: Sequence[str]) -> None:
    """Raise ``ValueError`` with a clear message for a missing or malformed target URL."""
    if not targets:
        raise ValueError("at least one --target is needed")
    for url in targets:
        try:
            scheme = httpx.URL(url).scheme
        except httpx.InvalidURL as exc:
            raise ValueError(f"target {url!r} is not a URL: {exc}") from None
        if scheme not in ("http", "https"):
            raise ValueError(f"target {url!r} needs http:// or https://")


@dataclass
class IntervalTracker:
    """Last good scrape per instance -> intervals as new scrapes arrive."""

    last: dict[str, Snapshot] = field(default_factory=dict)

    def feed(self, instance: str, timestamp: float, body: str) -> list[EngineInterval]:
        """Intervals since the instance's previous scrape (none for its first); raises
        ``ValueError`` on text that is not an exposition, keeping the previous scrape."""
        return self.feed_snapshot(parse(body, instance, timestamp))

    def feed_snapshot(self, snapshot: Snapshot) -> list[EngineInterval]:
        """As ``feed``, for a scrape already read (``exposition.read_families``)."""
        previous = self.last.get(snapshot.instance)
        if previous is not None and snapshot.timestamp <= previous.timestamp:
            return []  # out of order or repeated: nothing new
        self.last[snapshot.instance] = snapshot
        return interval(previous, snapshot) if previous is not None else []


@dataclass
class TargetHealth:
    url: str
    instance: str
    up: bool = False
    scrapes: int = 0
    failures: int = 0  # in a row
    last_error: str | None = None
    last_success: float | None = None


@dataclass
class Scrape:
    """One successful scrape, as recorded."""

    timestamp: float
    instance: str
    body: str

    def to_record(self) -> dict[str, object]:
        return {"timestamp": self.timestamp, "instance": self.instance, "body": self.body}


class Scraper:
    """Scrape every target once per ``round()``, concurrently; never raises for a target's fault."""

    def __init__(
        self,
        targets: Sequence[str],
        client: httpx.AsyncClient,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_targets(targets)
        self.client, self.timeout_s, self.clock = client, timeout_s, clock
        self.health = {url: TargetHealth(url, instance_of(url)) for url in targets}
        self.tracker = IntervalTracker()

    async def round(self) -> tuple[list[Scrape], list[EngineInterval]]:
        """Scrape all targets; the good scrapes and the intervals they complete."""
        results = await asyncio.gather(*(self._scrape(health) for health in self.health.values()))
        scrapes = [scrape for scrape, _ in results if scrape is not None]
        return scrapes, [interval for _, intervals in results for interval in intervals]

    async def _scrape(self, health: TargetHealth) -> tuple[Scrape | None, list[EngineInterval]]:
        """One target: fetched and read, or marked down with the reason (keeping its last good scrape)."""
        health.scrapes += 1
        timestamp = self.clock()
        try:
            response = await self.client.get(health.url, timeout=self.timeout_s)
            response.raise_for_status()
        except httpx.TimeoutException:
            self._failed(health, f"timed out after {self.timeout_s:g} s")
            return None, []
        except httpx.HTTPError as exc:
            self._failed(health, f"{type(exc).__name__}: {exc}")
            return None, []
        try:
            intervals = self.tracker.feed(health.instance, timestamp, response.text)
        except ValueError as exc:
            self._failed(health, f"not a Prometheus exposition: {exc}")
            return None, []
        health.up, health.failures, health.last_success = True, 0, timestamp
        return Scrape(timestamp, health.instance, response.text), intervals

    @staticmethod
    def _failed(health: TargetHealth, error: str) -> None:
        if health.up or health.failures == 0:
            logger.warning("target %s down: %s", health.url, error)
        health.up, health.failures, health.last_error = False, health.failures + 1, error


async def run_scrapes(
    scraper: Scraper,
    interval_s: float,
    on_round: Callable[[int, list[Scrape], list[EngineInterval]], object],
    rounds: int | None = None,
    stop: asyncio.Event | None = None,
) -> int:
    """Scrape every ``interval_s`` (on a fixed cadence, not drifting by the scrape's own
    time) until ``rounds`` are done or ``stop`` is set; ``on_round`` gets each round's
    scrapes and intervals and may be a coroutine function. Returns the rounds run."""
    stop = stop or asyncio.Event()
    done, started = 0, time.monotonic()
    while not stop.is_set() and (rounds is None or done < rounds):
        scrapes, intervals = await scraper.round()
        done += 1
        result = on_round(done, scrapes, intervals)
        if asyncio.iscoroutine(result):
            await result
        if rounds is not None and done >= rounds:
            break
        next_at = started + done * interval_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=max(next_at - time.monotonic(), 0.0))
    return done
