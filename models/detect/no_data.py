"""Segments that go silent: their open incidents end as ``no_data``, and idle ones are forgotten.

A window is judged only when requests arrive, so a segment that stops sending (a route
retired, a model drained, a shipper down) would keep its incident firing forever and its
detectors in memory for the worker's lifetime. Event time moves on with the other segments'
windows; measured by it (the latest window judged), a segment silent for
``DetectorConfig.no_data_after_s`` has its open incidents resolved as ``no_data`` (not as
recovered: nothing says it recovered), and one silent for ``segment_idle_s`` is dropped.
Whether traffic that stopped is itself a fault is ``models.stats.traffic``'s business.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servewatch.models.detect.events import incident_event
from servewatch.models.detect.lifecycle import Transition
from servewatch.models.explain.wording import segment_phrase
from servewatch.models.windows.segment_keys import parse_key
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity

if TYPE_CHECKING:
    from servewatch.models.detect.detector import SegmentDetectors

NO_DATA = "no_data"


def no_data_events(segment: SegmentDetectors, now: float) -> list[AnomalyEvent]:
    """Resolve every open incident of ``segment``, silent since its last window, as ``no_data``."""
    events = []
    silent_s = now - segment.last_window_end
    labels = parse_key(segment.key)
    for detector in list((segment.active or {}).values()):
        tracker = detector.tracker
        if tracker is None or not tracker.firing:
            continue
        start = tracker.incident_start if tracker.incident_start is not None else segment.last_window_end
        who = f"{detector.spec.what} for {segment_phrase(labels)}"
        message = (
            f"the segment has sent no requests for {silent_s:,.0f} s (event time): the incident ends without "
            "evidence that it recovered; if the traffic should be there, look at the model's traffic and the shippers"
        )
        events.append(
            incident_event(
                key=segment.key,
                signal=detector.spec.signal,
                incident_start=start,
                transition=Transition.RESOLVED,
                labels=labels,
                window=(segment.last_window_end, now),
                observed=0.0,
                expected=0.0,
                score=0.0,
                severity=Severity(tracker.severity or Severity.INFO.value),
                load={"requests": 0.0, "silent_s": round(silent_s, 3)},
                hints=[Hint(code=NO_DATA, message=message)],
                id_tag=f"resolved:{NO_DATA}",
                summary=f"No data: {who} has had no requests for {silent_s:,.0f} s; resolved as no_data.",
            )
        )
        detector.tracker = None
        segment.keep(detector)
        segment.transitioned = True
    return events
