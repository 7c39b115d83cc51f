"""Anomaly-topic records as a few readable lines for a terminal: the demo's live view and
``servewatch replay --format text`` print the same thing."""

from __future__ import annotations

from datetime import UTC, datetime

from servewatch.schemas.anomaly import AnomalyEvent, Status
from servewatch.schemas.incident_group import IncidentGroup


def utc(seconds: float) -> str:
    """Unix seconds as ``2026-01-01 00:10:20Z``."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def event_text(event: AnomalyEvent, when: str, update: bool = False) -> str:
    """Two to four lines for one incident event; ``when`` leads it (a time, a phase);
    ``update``: a later event of an incident already shown."""
    segment = "/".join(v for k, v in event.segment.items() if v != "-")
    # A resolve always reads as one, however many events of its incident were shown before.
    resolved = event.status is Status.RESOLVED
    status = "UPDATE" if not resolved and (update or event.transition == "update") else event.status.value.upper()
    head = (
        f"[{when}] {status:8} {event.severity.value:8} {event.signal.value:5} {segment}  "
        f"score={event.score:.1f} explained_by_load={str(event.explained_by_load).lower()}"
    )
    hints = f"\n      hints: {', '.join(h.code for h in event.hints)}" if event.hints else ""
    changed = ""
    if event.facets is not None and event.facets.changes:  # what moved in the traffic, against the baseline
        changed = f"\n      changed: {'; '.join(event.facets.changes[:3])}"
    shown = [r for r in event.evidence if r.get("sample") in ("slowest", "faulty")][:1]
    evidence = ""
    if shown:  # one request to look up in one's own log store
        r = shown[0]
        evidence = f"\n      e.g. {r.get('request_id')} on {r.get('instance', '?')}: " + ", ".join(
            f"{name}={r[name]}" for name in ("ttft_s", "prompt_tokens", "cached_tokens", "finish_reason") if name in r
        )
    return f"{head}\n      {event.summary}{hints}{changed}{evidence}"


def group_text(group: IncidentGroup) -> str:
    """One line for a group's lifecycle step."""
    return f"  >> group {group.transition.upper()} {group.severity.value}: {group.title}"
