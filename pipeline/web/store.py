"""What the triage page knows: the anomaly, series, feedback and changes topics in bounded memory.

The page must answer "what is firing, what just resolved, what did the signal look like"
without a database, so the web process keeps the recent past itself: the latest record of
each incident group, recent incident events, a few hours of each segment's judged windows,
the verdicts given, and change markers with the latest report verifying each. Everything
is capped (the oldest goes first), so a busy fleet or a long-lived process cannot grow it
without bound. No I/O here: the Kafka feed calls ``add``,
the HTTP handlers query, and live clients get each new record through a bounded queue (a
client that does not keep up is dropped, never allowed to hold records back for others).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from servewatch.models.detect.lifecycle import SEVERITY_RANK
from servewatch.models.windows.segment_keys import is_replica_key, join_key
from servewatch.schemas.anomaly import AnomalyEvent, Status
from servewatch.schemas.change_marker import ChangeMarker
from servewatch.schemas.change_report import ChangeReport
from servewatch.schemas.feedback import Feedback
from servewatch.schemas.incident_group import IncidentGroup
from servewatch.schemas.series import SeriesPoint

logger = logging.getLogger(__name__)

Record = AnomalyEvent | IncidentGroup | SeriesPoint | Feedback | ChangeMarker | ChangeReport
#: The record kinds a live client gets unless it asks for others (series points are many).
DEFAULT_KINDS = frozenset({"group", "incident", "feedback"})
SPARK_SIGNALS = ("ttft", "itl", "throughput")


def segment_key(segment: dict[str, str]) -> str:
    """The key the worker gives a segment, rebuilt from its labels (they keep the key's order).

    >>> segment_key({"model": "m", "route": "chat", "prompt_band": "<4k"})
    'model=m|route=chat|prompt_band=<4k'
    """
    return join_key(segment)


#: A replica table row's place: by model, instance, then where its comparison comes from.
REPLICA_ORDER = ("model", "instance", "source")


@dataclass(frozen=True)
class Filters:
    """Conditions a group or an incident must all meet; ``severity`` is a minimum."""

    model: str | None = None
    signal: str | None = None
    severity: str | None = None
    status: str | None = None

    def keep(self, record: AnomalyEvent | IncidentGroup) -> bool:
        if isinstance(record, IncidentGroup):
            model, signals = record.model, {s.value for s in record.signals}
        else:
            model, signals = record.segment.get("model", "other"), {record.signal.value}
        return (
            (self.model is None or model == self.model)
            and (self.signal is None or self.signal in signals)
            and (self.severity is None or SEVERITY_RANK[record.severity.value] >= SEVERITY_RANK.get(self.severity, 0))
            and (self.status is None or record.status.value == self.status)
        )


@dataclass(frozen=True)
class Member:
    """One incident of a group: its latest event, and the latest one that carried evidence."""

    latest: AnomalyEvent
    detail: AnomalyEvent


@dataclass(frozen=True)
class SegmentOverview:
    key: str
    point: SeriesPoint
    sparklines: dict[str, list[float]]


@dataclass(frozen=True)
class Change:
    """A change marker and the latest report verifying it (None until the worker wrote one)."""

    marker: ChangeMarker
    report: ChangeReport | None


def supersedes(new: ChangeReport, held: ChangeReport | None) -> bool:
    """Whether ``new`` is a later report of its change than ``held``: a final one over an interim
    one, else the one whose period after has more requests (a record read again changes nothing)."""
    if held is None:
        return True
    return (new.final, new.after.requests) >= (held.final, held.after.requests) and new != held


@dataclass
class Subscription:
    """One live client: records arrive on ``queue``; ``None`` means it was dropped (too slow)."""

    kinds: frozenset[str]
    queue: asyncio.Queue[str | None]
    dropped: bool = False


@dataclass
class TriageStore:
    """Bounded, queryable memory of the triage topics (see the module's docstring)."""

    max_groups: int = 500
    max_events: int = 5000
    series_points: int = 2160  # 6 h of 10 s windows per segment
    series_horizon_s: float = 6 * 3600
    max_segments: int = 2000
    resolved_keep_s: float = 6 * 3600  # resolved groups stay listed this long (event time)
    feedback_per_group: int = 20
    sparkline_points: int = 60
    queue_size: int = 256
    max_changes: int = 1000
    clock: float = 0.0  # the latest event time seen on the anomaly topic
    _groups: OrderedDict[str, IncidentGroup] = field(default_factory=OrderedDict, repr=False)
    _events: OrderedDict[str, AnomalyEvent] = field(default_factory=OrderedDict, repr=False)
    _by_group: dict[str, dict[str, list[str]]] = field(default_factory=dict, repr=False)
    _series: dict[str, list[SeriesPoint]] = field(default_factory=dict, repr=False)
    _feedback: OrderedDict[str, list[Feedback]] = field(default_factory=OrderedDict, repr=False)
    _markers: OrderedDict[str, ChangeMarker] = field(default_factory=OrderedDict, repr=False)
    _reports: OrderedDict[str, ChangeReport] = field(default_factory=OrderedDict, repr=False)
    _subscribers: list[Subscription] = field(default_factory=list, repr=False)

    # -- input ---------------------------------------------------------------------------
    def add(self, record: Record) -> None:
        """Fold one record in and hand it to live clients."""
        if isinstance(record, IncidentGroup):
            self._add_group(record)
        elif isinstance(record, AnomalyEvent):
            self._add_event(record)
        elif isinstance(record, SeriesPoint):
            self._add_point(record)
        elif isinstance(record, ChangeMarker | ChangeReport):
            if not self._add_change(record):
                return  # read again (a reconnect reads the topic from its start): nothing new
        elif not self._add_feedback(record):
            return  # the same verdict again (our own, back from the topic): nothing new to show
        self._publish(record)

    def _add_group(self, group: IncidentGroup) -> None:
        self.clock = max(self.clock, group.window_end)
        if group.feedback is not None:  # the worker carries the latest verdict: one we may not have read yet
            self._add_feedback(group.feedback)
        self._groups[group.group] = group
        self._groups.move_to_end(group.group)
        while len(self._groups) > self.max_groups:  # the least recently moved resolved group goes first
            victim = next((k for k, g in self._groups.items() if g.status is Status.RESOLVED), None)
            self._groups.pop(victim if victim is not None else next(iter(self._groups)))

    def _add_event(self, event: AnomalyEvent) -> None:
        self.clock = max(self.clock, event.window_end)
        self._events.pop(event.id, None)
        self._events[event.id] = event
        ids = self._by_group.setdefault(event.group or f"incident:{event.fingerprint}", {})
        ids.setdefault(event.fingerprint, []).append(event.id)
        while len(self._events) > self.max_events:
            self._forget_event(self._events.popitem(last=False)[1])

    def _forget_event(self, event: AnomalyEvent) -> None:
        group = event.group or f"incident:{event.fingerprint}"
        members = self._by_group.get(group, {})
        ids = [i for i in members.get(event.fingerprint, []) if i != event.id]
        if ids:
            members[event.fingerprint] = ids
        else:
            members.pop(event.fingerprint, None)
        if not members:
            self._by_group.pop(group, None)

    def _add_point(self, point: SeriesPoint) -> None:
        points = self._series.setdefault(point.key, [])
        if not points or point.window_start > points[-1].window_start:
            points.append(point)
        else:  # late or repeated: keep the list ordered, a repeat replaces
            at = bisect.bisect_left(points, point.window_start, key=lambda p: p.window_start)
            if at < len(points) and points[at].window_start == point.window_start:
                points[at] = point
            else:
                points.insert(at, point)
        horizon = points[-1].window_end - self.series_horizon_s
        drop = max(len(points) - self.series_points, 0)
        while drop < len(points) and points[drop].window_end < horizon:
            drop += 1
        del points[:drop]
        if len(self._series) > self.max_segments:  # the segment heard from longest ago goes (not this one)
            others = (k for k in self._series if k != point.key)
            del self._series[min(others, key=lambda k: self._series[k][-1].window_end)]

    def _add_feedback(self, feedback: Feedback) -> bool:
        given = self._feedback.setdefault(feedback.group, [])
        if feedback in given:
            return False
        given.append(feedback)
        given.sort(key=lambda f: f.at)
        del given[: -self.feedback_per_group]
        self._feedback.move_to_end(feedback.group)
        while len(self._feedback) > 2 * self.max_groups:
            self._feedback.popitem(last=False)
        return True

    def _add_change(self, record: ChangeMarker | ChangeReport) -> bool:
        if isinstance(record, ChangeMarker):
            if self._markers.get(record.id) == record:
                return False
            self._markers[record.id] = record
            while len(self._markers) > self.max_changes:  # the earliest posted goes, with its report
                self._reports.pop(self._markers.popitem(last=False)[0], None)
            return True
        if record.change is None:  # an offline comparison, of no marker: nothing to show it with
            return False
        if not supersedes(record, self._reports.get(record.change)):
            return False
        self._reports[record.change] = record
        self._reports.move_to_end(record.change)
        while len(self._reports) > self.max_changes:
            self._reports.popitem(last=False)
        return True

    # -- queries ---------------------------------------------------------------------------
    def groups(self, filters: Filters = Filters()) -> list[IncidentGroup]:
        """Firing groups and those resolved within ``resolved_keep_s``, newest first."""
        recent = self.clock - self.resolved_keep_s
        shown = [
            g for g in self._groups.values()
            if (g.status is Status.FIRING or g.window_end >= recent) and filters.keep(g)
        ]  # fmt: skip
        return sorted(shown, key=lambda g: (g.window_start, g.window_end), reverse=True)

    def group(self, key: str) -> IncidentGroup | None:
        return self._groups.get(key)

    def members(self, key: str) -> list[Member]:
        """The group's incidents (latest state each), most severe and newest first."""
        members = []
        for ids in self._by_group.get(key, {}).values():
            events = [self._events[i] for i in ids if i in self._events]
            if events:
                detail = next((e for e in reversed(events) if e.evidence), events[-1])
                members.append(Member(latest=events[-1], detail=detail))
        rank = SEVERITY_RANK
        return sorted(
            members,
            key=lambda m: (m.latest.status is Status.FIRING, rank[m.detail.severity.value], m.detail.window_start),
            reverse=True,
        )

    def anomalies(self, filters: Filters = Filters(), group: str | None = None, limit: int = 200) -> list[AnomalyEvent]:
        """Incident events, newest first."""
        # newest arrival first among equal windows (the sort is stable)
        shown = [e for e in reversed(self._events.values()) if filters.keep(e) and (group is None or e.group == group)]
        shown.sort(key=lambda e: (e.window_end, e.window_start), reverse=True)
        return shown[:limit]

    def anomaly(self, event_id: str) -> AnomalyEvent | None:
        return self._events.get(event_id)

    def latest(self, event: AnomalyEvent) -> AnomalyEvent:
        """The newest event held of ``event``'s incident (its current state)."""
        ids = self._by_group.get(event.group or f"incident:{event.fingerprint}", {}).get(event.fingerprint, [])
        held = [self._events[i] for i in ids if i in self._events]
        return held[-1] if held else event

    def feedback(self, group: str) -> list[Feedback]:
        return list(self._feedback.get(group, []))

    def series(self, key: str, since: float | None = None, until: float | None = None) -> list[SeriesPoint]:
        """A segment's judged windows in [since, until], oldest first."""
        return [
            p for p in self._series.get(key, [])
            if (since is None or p.window_end > since) and (until is None or p.window_start <= until)
        ]  # fmt: skip

    def segments(self, model: str | None = None) -> list[SegmentOverview]:
        """Each segment's latest judged window and its recent values per headline signal."""
        overview = []
        for key in sorted(self._series):
            if is_replica_key(key):
                continue  # an instance's ratios to its peers: ``replicas``
            points = self._series[key]
            latest = points[-1]
            if model is not None and latest.segment.get("model") != model:
                continue
            recent = points[-self.sparkline_points :]
            sparks = {s: [p.signals[s].observed for p in recent if s in p.signals] for s in SPARK_SIGNALS}
            overview.append(SegmentOverview(key, latest, {s: v for s, v in sparks.items() if v}))
        return overview

    def replicas(self, model: str | None = None) -> list[SegmentOverview]:
        """Each serving instance's latest ratios to its peers (``models.detect.replicas``), by
        model and instance, with its recent ratios per signal."""
        overview = []
        for key in sorted(self._series):
            points = self._series[key]
            latest = points[-1]
            if not is_replica_key(key) or (model is not None and latest.segment.get("model") != model):
                continue
            recent = points[-self.sparkline_points :]
            sparks = {s: [p.signals[s].observed for p in recent if s in p.signals] for s in latest.signals}
            overview.append(SegmentOverview(key, latest, sparks))
        return sorted(overview, key=lambda o: tuple(o.point.segment.get(k, "") for k in REPLICA_ORDER))

    def models(self) -> list[str]:
        names = {g.model for g in self._groups.values()}
        names |= {points[-1].segment.get("model", "other") for points in self._series.values()}
        return sorted(names)

    def markers(self, model: str | None = None) -> list[ChangeMarker]:
        """Change markers (of ``model``), oldest first."""
        return sorted((m for m in self._markers.values() if model is None or m.model == model), key=lambda m: m.at)

    def changes(self, model: str | None = None) -> list[Change]:
        """Change markers (of ``model``) with their latest report, newest first."""
        return [Change(m, self._reports.get(m.id)) for m in reversed(self.markers(model))]

    def change(self, change_id: str) -> Change | None:
        marker = self._markers.get(change_id)
        return None if marker is None else Change(marker, self._reports.get(change_id))

    def after_change(self, change_id: str) -> list[AnomalyEvent]:
        """The incidents held that started soon after a change (their latest event each), newest first."""
        latest: dict[str, AnomalyEvent] = {}
        for event in self._events.values():
            if event.change is not None and event.change.id == change_id:
                latest[event.fingerprint] = event
        return sorted(latest.values(), key=lambda e: e.window_start, reverse=True)

    # -- live clients ----------------------------------------------------------------------
    def subscribe(self, kinds: frozenset[str] = DEFAULT_KINDS) -> Subscription:
        subscription = Subscription(kinds, asyncio.Queue(self.queue_size))
        self._subscribers.append(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        if subscription in self._subscribers:
            self._subscribers.remove(subscription)

    def close(self) -> None:
        """End every live client's stream (the server is stopping)."""
        for subscription in list(self._subscribers):
            self._drop(subscription)

    def _publish(self, record: Record) -> None:
        wanted = [s for s in self._subscribers if record.kind in s.kinds]
        if not wanted:
            return
        text = orjson.dumps(record.model_dump(mode="json")).decode()
        for subscription in wanted:
            try:
                subscription.queue.put_nowait(text)
            except asyncio.QueueFull:
                logger.warning("a live client fell %d records behind; dropped", self.queue_size)
                self._drop(subscription)

    def _drop(self, subscription: Subscription) -> None:
        self.unsubscribe(subscription)
        subscription.dropped = True
        while not subscription.queue.empty():  # make room for the end-of-stream marker
            subscription.queue.get_nowait()
        subscription.queue.put_nowait(None)


def group_json(group: IncidentGroup, feedback: list[Feedback]) -> dict[str, Any]:
    """A group as the API shows it: its latest record with every verdict held (``verdicts``;
    the record's own ``feedback`` is the latest the worker had when it wrote the record)."""
    return {**group.model_dump(mode="json"), "verdicts": [f.model_dump(mode="json") for f in feedback]}
