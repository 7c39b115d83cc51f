"""Change verification in a Faust app: markers in, reports and rollback anomalies out.

One task follows ``servewatch.changes`` whole (no consumer group). Each marker starts a
watch (``models.compare.watch.ChangeWatch``) with its own reader of ``servewatch.requests``,
from shortly before the marker's period before (``offsets_for_times``, so the period before
comes from Kafka's retention, nothing is buffered ahead of a marker) until its period after
is complete. Every check publishes a ``ChangeReport`` on ``servewatch.changes`` and any
``rollback_condition_met`` incident on ``servewatch.anomalies`` (keyed by model, as the
worker's own), where the notifier pages it like any other.

At start the topic is read to its end first: markers with a final report are done, the
others (posted within their periods' length of now) are watched again; a check's report
and its incident events have deterministic ids, so a re-run is a duplicate, not a new page.
Run it in one worker of a fleet (``SERVEWATCH_WATCH_CHANGES``): a second would publish twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import faust
from aiokafka import AIOKafkaConsumer

from servewatch.models.compare.report import ChangeVerifier
from servewatch.models.compare.watch import ChangeWatch
from servewatch.pipeline.changes.config import ChangesConfig
from servewatch.pipeline.changes.store import parse_change_record
from servewatch.pipeline.kafka import KafkaAuth, assign_all, follow_topic
from servewatch.pipeline.messages.decode import decode_message
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.topics import Topics
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.change_marker import ChangeMarker
from servewatch.schemas.change_report import ChangeReport

logger = logging.getLogger(__name__)

#: Read the requests topic from this many wall seconds before the period before: producers'
#: clocks and batching put a request's message a little after its own timestamp.
SEEK_MARGIN_S = 120.0


@dataclass
class Watches:
    """The changes under watch, by marker id, and the ids already verified (a final report)."""

    verified: set[str] = field(default_factory=set)
    running: dict[str, tuple[ChangeWatch, asyncio.Task[None]]] = field(default_factory=dict)


def add_change_watcher(app: faust.App, topics: Topics, settings: Settings, config: ChangesConfig) -> Watches:
    """Add the change watcher's task to ``app``; returns its (live) registry of watches."""
    assert settings.kafka.bootstrap is not None
    bootstrap, auth = settings.kafka.bootstrap, KafkaAuth.from_settings(settings)
    changes, requests = topics.changes.get_topic_name(), topics.requests.get_topic_name()
    watches = Watches()
    verifier = ChangeVerifier(
        min_requests=config.min_requests,
        resamples=config.resamples,
        prefix_lifetime_s=config.prefix_lifetime,
        min_stratum_requests=config.min_stratum_requests,
    )
    conditions = config.conditions()
    markers_of_reasoning = tuple(settings.detection.reasoning_markers)

    async def publish(report: ChangeReport, events: list[AnomalyEvent]) -> None:
        key = report.model.encode()
        await topics.changes.send(key=key, value=report.model_dump_json().encode())
        for event in events:
            await topics.anomalies.send(key=key, value=event.model_dump_json().encode())
            logger.warning("change %s: %s %s", report.change, event.status.value, event.summary)

    async def run_watch(watch: ChangeWatch, posted_s: float) -> None:
        """Feed ``watch`` the requests topic from before its period before until it is final."""
        marker = watch.marker
        since = min(marker.at, posted_s) - watch.before_s - SEEK_MARGIN_S
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                    fetch_max_bytes=64 * 1024 * 1024, **auth.client_options())  # fmt: skip
        await consumer.start()
        try:
            await _seek(consumer, requests, since)
            last_taken = time.monotonic()
            while not watch.finished:
                batches = await consumer.getmany(timeout_ms=500)
                for messages in batches.values():
                    for message in messages:
                        rows = decode_message(message.value).accepted
                        if not rows:
                            continue
                        # Event time moves with every model's requests; only the marker's
                        # model's become dicts (most of a fleet's rows are skipped here).
                        watch.observe(max(row.timestamp for row in rows))
                        if watch.add([row.to_row() for row in rows if row.model == marker.model]):
                            last_taken = time.monotonic()
                idle = time.monotonic() - last_taken > config.idle_final
                if watch.due or idle:
                    report, events = await asyncio.to_thread(watch.check, idle)
                    await publish(report, events)
                    logger.info("change %s on %s: %s report (%s before, %s after)", marker.id, marker.model,
                                "final" if report.final else "interim", *watch.requests)  # fmt: skip
        finally:
            await consumer.stop()
        watches.verified.add(marker.id)

    async def arm(marker: ChangeMarker, posted_s: float) -> None:
        if marker.id in watches.verified or marker.id in watches.running:
            return
        for other, _ in list(watches.running.values()):
            if other.marker.model == marker.model and other.marker.at < marker.at:
                for event in other.supersede(marker):  # its period after ends at the later change
                    await topics.anomalies.send(key=marker.model.encode(), value=event.model_dump_json().encode())
        watch = ChangeWatch(marker, before_s=config.before, after_s=config.after, check_every_s=config.check_every,
                            conditions=conditions, verifier=verifier, max_requests=config.max_requests,
                            markers=markers_of_reasoning)  # fmt: skip
        task = asyncio.ensure_future(_guarded(run_watch(watch, posted_s), marker))
        watches.running[marker.id] = (watch, task)
        task.add_done_callback(lambda _: watches.running.pop(marker.id, None))
        logger.info("watching change %s on %s: '%s'", marker.id, marker.model, marker.description)

    @app.task
    async def verify_changes() -> None:
        """Markers of ``servewatch.changes`` in, one watch each (see the module's docstring)."""
        horizon = config.before + config.after + config.idle_final + 3600.0
        while True:
            try:
                async for marker, posted_s in _markers(bootstrap, changes, auth, watches):
                    if time.time() - posted_s <= horizon:
                        await arm(marker, posted_s)
            except asyncio.CancelledError:
                for _, task in watches.running.values():
                    task.cancel()
                raise
            except Exception as exc:
                logger.warning("change watcher failed (%s); reading again in 2 s", exc)
                await asyncio.sleep(2.0)

    return watches


async def _markers(bootstrap: str, topic: str, auth: KafkaAuth, watches: Watches) -> Any:
    """(marker, posted at) for every marker of the topic, in order; final reports seen on the
    way mark their change verified. Markers read before the topic's end at start are held back
    until the end is reached, so a marker verified later in the topic is not watched again."""
    held: list[tuple[ChangeMarker, float]] | None = []
    async for record in follow_topic(bootstrap, topic, auth=auth):
        parsed = parse_change_record(record.value)
        if isinstance(parsed, ChangeReport) and parsed.final and parsed.change:
            watches.verified.add(parsed.change)
        elif isinstance(parsed, ChangeMarker):
            if held is None:
                yield parsed, record.timestamp_s
            else:
                held.append((parsed, record.timestamp_s))
        if record.caught_up and held is not None:
            for marker, posted in held:
                yield marker, posted
            held = None


async def _seek(consumer: AIOKafkaConsumer, topic: str, since_s: float) -> None:
    """Assign every partition of ``topic`` and seek to the first message at or after ``since_s``
    (its end when there is none yet: the period after is still to come)."""
    tps = await assign_all(consumer, topic)
    found = await consumer.offsets_for_times({tp: max(0, int(since_s * 1000)) for tp in tps})
    ends = await consumer.end_offsets(tps)
    for tp in tps:
        at = found.get(tp)
        consumer.seek(tp, at.offset if at is not None else ends[tp])


async def _guarded(work: Any, marker: ChangeMarker) -> None:
    try:
        await work
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("the watch of change %s on %s failed; it is not verified", marker.id, marker.model)
