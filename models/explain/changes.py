"""Which change an incident follows: change markers per model, and the hint they give.

A step that starts a few windows after someone flipped a config is most likely the flip.
``ChangeBook`` keeps each model's recent markers (from ``servewatch.changes``);
``mention_change`` names the latest one before a firing incident's start, within a horizon,
on the event (``AnomalyEvent.change``) and puts it first among its hints, so the on-call
reads "started 4 windows after change 'enable prefix caching'" before any other guess.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from servewatch.schemas.anomaly import AnomalyEvent, Hint, Status
from servewatch.schemas.change_marker import ChangeMarker, ChangeRef


@dataclass
class ChangeBook:
    """Markers per model, by time; ``per_model`` bounds memory (the oldest go first).

    >>> book = ChangeBook()
    >>> book.add(ChangeMarker(id="c1", at=1000.0, model="m", description="enable prefix caching"))
    >>> book.add(ChangeMarker(id="c2", at=2000.0, model="m", description="raise max_num_seqs"))
    >>> book.latest("m", at=1500.0).id, book.latest("m", at=2500.0).id, book.latest("m", at=900.0)
    ('c1', 'c2', None)
    """

    per_model: int = 256
    _markers: dict[str, list[ChangeMarker]] = field(default_factory=dict)

    def add(self, marker: ChangeMarker) -> None:
        """Add (or replace, by id) a marker; idempotent, so a topic read twice changes nothing."""
        markers = self._markers.setdefault(marker.model, [])
        markers[:] = [known for known in markers if known.id != marker.id]
        bisect.insort(markers, marker, key=lambda known: known.at)
        del markers[: max(0, len(markers) - self.per_model)]

    def latest(self, model: str, at: float, instance: str | None = None) -> ChangeMarker | None:
        """The model's latest marker at or before ``at``; with ``instance``, markers of other
        instances are skipped (a marker without an instance applies to all)."""
        markers = self._markers.get(model, [])
        for marker in reversed(markers[: bisect.bisect_right(markers, at, key=lambda known: known.at)]):
            if instance is None or marker.instance in (None, instance):
                return marker
        return None

    def of_model(self, model: str) -> list[ChangeMarker]:
        return list(self._markers.get(model, []))


def mention_change(event: AnomalyEvent, book: ChangeBook, window_s: float, horizon_windows: int) -> AnomalyEvent:
    """Name, on a firing ``event`` (a copy of it), the change its incident most likely follows:
    its model's latest marker at most ``horizon_windows`` windows before the window it fired
    in. The change's hint goes first; a resolved event keeps what its firing said.

    >>> from servewatch.schemas.anomaly import Signal, Severity
    >>> event = AnomalyEvent(id="e", fingerprint="f", status=Status.FIRING, signal=Signal.TTFT,
    ...     segment={"model": "m"}, window_start=1040.0, window_end=1050.0, observed=2.0, expected=1.0,
    ...     score=4.0, severity=Severity.WARNING, load={}, explained_by_load=False, summary="TTFT up",
    ...     hints=[Hint(code="prefill_bound", message="more prefill")])
    >>> book = ChangeBook()
    >>> book.add(ChangeMarker(id="c1", at=1000.0, model="m", description="disable prefix caching"))
    >>> event = mention_change(event, book, window_s=10.0, horizon_windows=30)
    >>> event.change.windows_after, [hint.code for hint in event.hints]
    (4, ['change_marker', 'prefill_bound'])
    >>> event.hints[0].message
    "started 4 windows after change c1 on m: 'disable prefix caching'"
    """
    if event.status is not Status.FIRING or event.change is not None:
        return event
    model = event.segment.get("model", "other")
    marker = book.latest(model, at=event.window_start, instance=event.segment.get("instance"))
    if marker is None:
        return event
    windows = math.floor((event.window_start - marker.at) / window_s) if window_s > 0 else 0
    if windows > horizon_windows:
        return event
    change = ChangeRef(id=marker.id, at=marker.at, description=marker.description, windows_after=windows)
    where = f" on {model}" + (f" ({marker.instance})" if marker.instance else "")
    message = f"started {windows} window{'s' * (windows != 1)} after change {marker.id}{where}: '{marker.description}'"
    return event.model_copy(
        update={"change": change, "hints": [Hint(code="change_marker", message=message), *event.hints]}
    )
