"""One builder of ``AnomalyEvent``: an event's identity and status follow from its incident.

Four places announce incidents (a segment's signal in ``detector``, a model's traffic in
``traffic_watch``, a silent segment in ``silence``, an engine's spare capacity in
``headroom``). Each says what it saw; this module alone decides what makes two events the
same incident (the ``fingerprint``: segment, signal, incident start) and the same record
(the ``id``: fingerprint, transition, window), so that a consumer's deduplication and
grouping read every event alike.

>>> event = incident_event(key="model=m", signal=Signal.TRAFFIC, incident_start=60.0,
...     transition=Transition.FIRING, labels={"model": "m"}, window=(60.0, 70.0), observed=0.0,
...     expected=50.0, score=9.1, severity=Severity.WARNING, summary="Traffic of model m dropped.")
>>> event.status.value, event.fingerprint == fingerprint("model=m", "traffic", 60.0)
('firing', True)
>>> resolved = incident_event(key="model=m", signal=Signal.TRAFFIC, incident_start=60.0,
...     transition=Transition.RESOLVED, labels={"model": "m"}, window=(90.0, 100.0), observed=48.0,
...     expected=50.0, score=0.2, severity=Severity.WARNING, summary="Resolved.")
>>> resolved.fingerprint == event.fingerprint, resolved.id == event.id
(True, False)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from servewatch.models.detect.lifecycle import Transition, fingerprint
from servewatch.models.explain.wording import event_id
from servewatch.schemas.anomaly import AnomalyEvent, ChangeRef, Hint, Severity, Signal, Status
from servewatch.schemas.evidence_pointer import EvidencePointer


def incident_event(
    *,
    key: str,
    signal: Signal,
    incident_start: float,
    transition: Transition,
    labels: Mapping[str, str],
    window: tuple[float, float],
    observed: float,
    expected: float,
    score: float,
    severity: Severity,
    summary: str,
    hints: list[Hint] | None = None,
    load: Mapping[str, float] | None = None,
    explained_by_load: bool = False,
    evidence: list[dict[str, Any]] | None = None,
    pointers: tuple[EvidencePointer, ...] = (),
    baseline_young: bool = False,
    incident_name: str | None = None,
    id_tag: str | None = None,
    change: ChangeRef | None = None,
) -> AnomalyEvent:
    """The event of ``transition`` of the incident of ``signal`` in segment ``key`` begun at
    ``incident_start``, seen in ``window`` (start, end).

    ``incident_name`` names the incident in its fingerprint where that is not the signal
    (spare capacity reads the KV cache's usage but is its own kind of incident); ``id_tag``
    replaces the transition in the record's id (``no_data`` ends an incident with no window
    of its own, and the id says so).
    """
    resolved = transition is Transition.RESOLVED
    fp = fingerprint(key, incident_name or signal.value, incident_start)
    tag = id_tag or f"{'resolved' if resolved else 'firing'}:{transition.value}"
    start, end = window
    return AnomalyEvent(
        id=event_id(fp, tag, start),
        fingerprint=fp,
        status=Status.RESOLVED if resolved else Status.FIRING,
        transition=transition.value,
        signal=signal,
        segment=dict(labels),
        window_start=start,
        window_end=end,
        observed=observed,
        expected=expected,
        score=round(score, 3),
        severity=severity,
        load=dict(load or {}),
        explained_by_load=explained_by_load,
        hints=hints or [],
        evidence=evidence or [],
        pointers=pointers,
        summary=summary,
        baseline_young=baseline_young,
        change=change,
    )
