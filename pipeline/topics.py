"""Every Kafka topic servewatch reads or writes, declared once.

Names are part of the contract with shippers and consumers; change them only with a
schema version bump. Values are raw bytes: the hot path decodes JSON itself (orjson +
pydantic) because Faust's per-record codecs cost more than the work they do.
"""

from __future__ import annotations

from dataclasses import dataclass

import faust

REQUESTS = "servewatch.requests"  # RequestLog JSON: one object, an array, or NDJSON per message
PARTIALS = "servewatch.partials"  # internal: closed windows' partials (models/windows/wire.py), by segment
#: AnomalyEvent and IncidentGroup JSON, keyed by model: a model's records stay in order on one
#: partition, so one notifier sees a group's members and its own records, firing before resolved.
ANOMALIES = "servewatch.anomalies"
#: internal: incident events before grouping, keyed by model, so that one worker groups a model's
INCIDENTS = "servewatch.incidents"
DEADLETTER = "servewatch.deadletter"  # DeadLetter JSON
SCRAPES = "servewatch.scrapes"  # EngineInterval JSON from `servewatch scrape`, keyed by instance|model
SILENCES = "servewatch.silences"  # Silence JSON keyed by id, compacted: the latest record of an id wins
NOTIFICATIONS = "servewatch.notifications"  # Delivery JSON: what the notifier did with each notification
SERIES = "servewatch.series"  # SeriesPoint JSON: each segment's judged windows (observed, expected, band), by segment
FEEDBACK = "servewatch.feedback"  # Feedback JSON: on-call's verdicts on incident groups, keyed by group
#: ChangeMarker JSON (``servewatch mark``, the shipper's ``POST /v1/changes``) and the worker's
#: ChangeReport JSON verifying each change, keyed by model; kept 30 days, read whole at start.
CHANGES = "servewatch.changes"
#: Faust table of detector state per segment (JSON, ``SegmentDetectors.state``); its
#: changelog topic is ``<app id>-servewatch-detector-state-changelog``, created by Faust.
DETECTOR_STATE_TABLE = "servewatch-detector-state"

#: Notifier state per model (JSON, ``pipeline.notify.state.ModelState``): what each sink was told.
NOTIFY_STATE_TABLE = "servewatch-notify-state"


def requests_group(app_id: str) -> str:
    """The consumer group the workers of ``app_id`` read the requests topic in (apart from
    their Faust app's group, ``app_id``: the requests topic is read in batches by a plain
    consumer, ``pipeline.streams.batch_reader``)."""
    return f"{app_id}-requests"


ALL = (
    REQUESTS,
    PARTIALS,
    INCIDENTS,
    ANOMALIES,
    DEADLETTER,
    SCRAPES,
    SILENCES,
    NOTIFICATIONS,
    SERIES,
    FEEDBACK,
    CHANGES,
)
#: Bytes a requests message may hold on the broker: the default ``SERVEWATCH_MAX_MESSAGE_BYTES``
#: (Apache Kafka's own default, 1 MiB, would refuse the shipper's larger batches).
REQUESTS_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
#: Topic settings servewatch creates its topics with (``ensure_topics``; the compose file's
#: ``topics`` service says the same): requests take batches of up to 8 MiB; silences are a
#: table by key (the latest record of each id is kept); chart points are kept 6 h, what the
#: triage page shows and reads at its start.
TOPIC_CONFIGS: dict[str, dict[str, str]] = {
    REQUESTS: {"max.message.bytes": str(REQUESTS_MAX_MESSAGE_BYTES)},
    SILENCES: {"cleanup.policy": "compact"},
    SERIES: {"retention.ms": str(6 * 3600 * 1000)},
    CHANGES: {"retention.ms": str(30 * 24 * 3600 * 1000)},
}


@dataclass(frozen=True)
class Topics:
    requests: faust.TopicT
    partials: faust.TopicT
    incidents: faust.TopicT
    anomalies: faust.TopicT
    deadletter: faust.TopicT
    scrapes: faust.TopicT
    notifications: faust.TopicT
    series: faust.TopicT
    feedback: faust.TopicT
    changes: faust.TopicT


def declare_topics(app: faust.App, partitions: int) -> Topics:
    def raw(name: str) -> faust.TopicT:
        return app.topic(name, key_type=bytes, value_type=bytes, key_serializer="raw",
                         value_serializer="raw", partitions=partitions)  # fmt: skip

    return Topics(
        requests=raw(REQUESTS), partials=raw(PARTIALS), incidents=raw(INCIDENTS), anomalies=raw(ANOMALIES),
        deadletter=raw(DEADLETTER), scrapes=raw(SCRAPES), notifications=raw(NOTIFICATIONS),
        series=raw(SERIES), feedback=raw(FEEDBACK), changes=raw(CHANGES),
    )  # fmt: skip
