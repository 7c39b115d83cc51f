"""A group's labels, and which sinks' routes want it. Pure: no clock, no I/O.

Alertmanager matches on one value per label; a group of incidents spans several signals
and segments, so here a label may hold several values (every member's ``signal``, every
member's ``route``...). ``=`` and ``=~`` hold when *some* value matches, ``!=`` and ``!~``
when *none* does; a label a group lacks reads as the empty string, as in Alertmanager.

>>> labels = {"model": {"llama"}, "signal": {"ttft", "itl"}}
>>> matches(Matcher(name="signal", value="itl"), labels), matches(Matcher(name="signal", op="!=", value="itl"), labels)
(True, False)
>>> matches(Matcher(name="route", op="!=", value="chat"), labels)
True
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from servewatch.models.detect.lifecycle import SEVERITY_RANK
from servewatch.pipeline.notify.config import Route
from servewatch.schemas.anomaly import AnomalyEvent, Status
from servewatch.schemas.incident_group import IncidentGroup
from servewatch.schemas.silence import Matcher

Labels = Mapping[str, set[str]]


def open_members(members: Iterable[AnomalyEvent]) -> list[AnomalyEvent]:
    return [m for m in members if m.status is Status.FIRING]


def explained_by_load(members: Iterable[AnomalyEvent], group: IncidentGroup | None = None) -> bool:
    """A group is explained by load when the grouper says so (its model's load group), or when
    every open member is (every member, once all resolved)."""
    if group is not None and group.explained_by_load:
        return True
    members = list(members)
    judged = open_members(members) or members
    return bool(judged) and all(m.explained_by_load for m in judged)


def labels_of(group: IncidentGroup, members: Iterable[AnomalyEvent]) -> dict[str, set[str]]:
    members = list(members)
    labels: dict[str, set[str]] = {
        "alertname": {group.cause},
        "cause": {group.cause},
        "model": {group.model},
        "group": {group.group},
        "severity": {group.severity.value},
        "status": {group.status.value},
        "signal": {s.value for s in group.signals} | {m.signal.value for m in members},
        "explained_by_load": {str(explained_by_load(members, group)).lower()},
    }
    for segment in [*(m.segment for m in group.members), *(m.segment for m in members)]:
        for name, value in segment.items():
            labels.setdefault(name, set()).add(value)
    return labels


def matches(matcher: Matcher, labels: Labels) -> bool:
    values = labels.get(matcher.name) or {""}
    if matcher.op == "=":
        return matcher.value in values
    if matcher.op == "!=":
        return matcher.value not in values
    pattern = re.compile(matcher.value)
    found = any(pattern.fullmatch(v) for v in values)
    return found if matcher.op == "=~" else not found


def wants(route: Route, group: IncidentGroup, members: Iterable[AnomalyEvent]) -> bool:
    """Whether a sink with this ``route`` is to be told about ``group``."""
    members = list(members)
    if SEVERITY_RANK[group.severity] < SEVERITY_RANK[route.min_severity]:
        return False
    if route.explained_by_load is not None and explained_by_load(members, group) != route.explained_by_load:
        return False
    labels = labels_of(group, members)
    conditions = [
        (route.models, "model"),
        ([s.value for s in route.signals], "signal"),
        (route.causes, "cause"),
    ]
    for wanted, name in conditions:
        if wanted and not set(wanted) & labels[name]:
            return False
    if any(value not in labels.get(name, set()) for name, value in route.labels.items()):
        return False
    return all(matches(m, labels) for m in route.matchers)
