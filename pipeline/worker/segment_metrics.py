"""Per-segment gauges: each segment's signals as last judged, for Prometheus and Grafana.

Events say when something is wrong; these say what every segment looks like right now, so a
dashboard can draw a model's TTFT against what was expected and the band around it, and list
the segments whose incidents are open, without reading the ``servewatch.series`` topic.

Labels are ``model``, ``segment`` and ``signal``. ``segment`` is the segment key without its
``model=`` part (``model=m|route=chat|prompt_band=<4k`` gives ``route=chat|prompt_band=<4k``;
``all`` when the model is the only dimension), so ``model`` filters in PromQL while the pair
still names one segment.

Cardinality is bounded by the segmenter, not by traffic: the worker keeps at most
``SERVEWATCH_MAX_SEGMENTS`` segments (plus the shared overflow one), so each gauge has at
most (max_segments + 1) × signals series (at most ~16k with the default cap of 1000 and
the 16 signals of ``schemas.anomaly.Signal``). Label values come from segment keys, never
from requests. That holds only if a segment's series go when the segment does: the worker
calls ``forget_segment`` when it drops one (idle, its id reused).
A signal missing from a later point keeps its last value (it was not judged that window);
a band that disappears (``low``/``high`` None) has its series removed at once, so a chart
never shows bounds that no longer apply.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Gauge

from servewatch.schemas.series import SeriesPoint

_LABELS = ["model", "segment", "signal"]

OBSERVED = Gauge("servewatch_segment_observed", "A segment's signal in its last judged window.", _LABELS)
EXPECTED = Gauge("servewatch_segment_expected", "What the detector expected of that window.", _LABELS)
BAND_LOW = Gauge(
    "servewatch_segment_band_low", "Lower bound of the normal band at the paging threshold (if modelled).", _LABELS
)
BAND_HIGH = Gauge(
    "servewatch_segment_band_high", "Upper bound of the normal band at the paging threshold (if modelled).", _LABELS
)
SCORE = Gauge("servewatch_segment_score", "Surprise of the last judged window (-log10 p).", _LABELS)
FIRING = Gauge("servewatch_segment_firing", "1 while an incident of the segment's signal is open, else 0.", _LABELS)

#: Label sets written per segment key and gauge, so a segment's series can be removed
#: exactly (prometheus_client cannot list a gauge's children portably).
_written: dict[str, dict[Gauge, set[tuple[str, str, str]]]] = {}


def segment_label(key: str) -> str:
    """The ``segment`` label of a segment key: the key without its ``model=`` part.

    >>> segment_label("model=m|route=chat|prompt_band=<4k")
    'route=chat|prompt_band=<4k'
    >>> segment_label("model=m")
    'all'
    """
    return "|".join(part for part in key.split("|") if not part.startswith("model=")) or "all"


def _model_of(point: SeriesPoint) -> str:
    if "model" in point.segment:
        return point.segment["model"]
    for part in point.key.split("|"):
        if part.startswith("model="):
            return part.removeprefix("model=")
    return "other"


def _set(key: str, gauge: Gauge, labels: tuple[str, str, str], value: float) -> None:
    gauge.labels(*labels).set(value)
    _written.setdefault(key, {}).setdefault(gauge, set()).add(labels)


def _drop(key: str, gauge: Gauge, labels: tuple[str, str, str]) -> None:
    written = _written.get(key, {}).get(gauge)
    if written is not None and labels in written:
        written.discard(labels)
        gauge.remove(*labels)


def record_points(points: Iterable[SeriesPoint]) -> None:
    """Set the gauges from judged windows (later points of a segment win)."""
    for point in points:
        model, segment = _model_of(point), segment_label(point.key)
        for name, signal in point.signals.items():
            labels = (model, segment, name)
            _set(point.key, OBSERVED, labels, signal.observed)
            _set(point.key, EXPECTED, labels, signal.expected)
            _set(point.key, SCORE, labels, signal.score)
            _set(point.key, FIRING, labels, 1.0 if signal.firing else 0.0)
            for gauge, bound in ((BAND_LOW, signal.low), (BAND_HIGH, signal.high)):
                if bound is None:
                    _drop(point.key, gauge, labels)
                else:
                    _set(point.key, gauge, labels, bound)


def forget_segment(key: str) -> None:
    """Remove every series of the segment ``key`` (the worker dropped it)."""
    for gauge, written in _written.pop(key, {}).items():
        for labels in written:
            gauge.remove(*labels)
