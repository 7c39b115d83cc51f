"""One series through one signal's model, point by point: ``servewatch backtest-series``.

Users export a series (TTFT p95, an error rate, a hit rate) from Grafana or Prometheus and
ask "what would servewatch have said?". Each point is scored with what came before it
only (no look-ahead), then learned unless it was anomalous, exactly as a segment's
detector does with its windows, and the incident lifecycle says where it would have paged;
a run of ``adopt_after`` anomalous points becomes the new normal. Optional load columns
condition latency signals the way the live detector does; a latency-like series without
them is judged by its own recent level and scale (``SeriesLevel``): the load-conditioned
model fed a constant demand is built for a live segment's 10 s windows, and on exported
series it missed most of NAB's faults (``bench/nab.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from servewatch.models.detect.lifecycle import SEVERITY_RANK, Transition
from servewatch.models.detect.signal_detector import DetectorConfig, SignalDetector
from servewatch.models.detect.signals import BY_SIGNAL, MODEL_FIGURES, Reading, SignalSpec
from servewatch.models.stats.series_level import SeriesLevel
from servewatch.schemas.anomaly import Signal

#: Load columns a series may carry (per second), and the model inputs they feed.
LOAD_COLUMNS = MODEL_FIGURES


@dataclass(frozen=True, slots=True)
class ScoredPoint:
    timestamp: float
    value: float
    anomaly_score: float
    #: Where the lifecycle would page: an incident starts (or reopens), or its severity steps up.
    is_anomaly: bool
    #: The lifecycle after this point: ``normal``, ``pending`` (anomalous, not firing yet),
    #: ``firing``, ``resolved`` (it ended here), or ``explained`` (load explains the rise:
    #: an ``info`` incident, never a page).
    status: str = "normal"
    explained_by_load: bool = False


def _inputs(point: Mapping[str, Any], kind: str) -> dict[Any, Any]:
    if kind == "latency":
        # Missing load: a constant demand, so the model is the load-blind level it starts as.
        x = {f"model_{name}": float(point.get(name) or 1.0) for name in LOAD_COLUMNS}
        # A series' load is what was served; arrivals are not known apart from it.
        x["model_arrivals_per_s"] = x["model_requests_per_s"]
        x["model_arrival_prompt_tokens_per_s"] = x["model_prompt_tokens_per_s"]
        return x
    return {"trials": int(point.get("trials") or 100)}


def score_series(
    points: Iterable[Mapping[str, Any]],
    signal: Signal = Signal.TTFT,
    threshold: float = 4.0,
    grace_windows: int = 6,
    adopt_after: int = 90,
    model: Literal["auto", "load", "series"] = "auto",
) -> Iterator[ScoredPoint]:
    """Score ``points`` (dicts with ``timestamp``, ``value`` and optional load or ``trials``)
    in order. For a rate signal ``value`` is the count of bad requests out of ``trials``.

    The live detector's own ``SignalDetector`` judges, learns and adopts, and its incident
    lifecycle (2 anomalous points of 3 fire, 3 normal ones resolve; a rate's sequential
    evidence fires and resolves at once), so a series is scored by exactly the rules a
    segment's windows are. ``is_anomaly`` marks where it would page, not every point that
    scores high: a 10-point step is one page, not ten.

    ``model`` chooses what judges a latency-like signal: ``"load"`` the load-conditioned
    model (missing load is a constant demand), ``"series"`` the series' own recent level
    (``SeriesLevel``), ``"auto"`` the first when the first point carries load columns and the
    second otherwise. Rates and shares keep their own models.

    >>> flat = [{"timestamp": t, "value": 0.5} for t in range(30)]
    >>> step = [{"timestamp": 30 + t, "value": 5.0} for t in range(3)] + [{"timestamp": 33, "value": 0.5}]
    >>> [(p.timestamp, p.is_anomaly, p.status) for p in score_series(flat + step)][-4:]
    [(30.0, False, 'pending'), (31.0, True, 'firing'), (32.0, False, 'firing'), (33.0, False, 'firing')]
    """
    spec = BY_SIGNAL[signal]
    points = iter(points)
    first = next(points, None)
    if first is None:
        return
    points = itertools.chain([first], points)
    if spec.kind == "latency" and (model == "series" or (model == "auto" and not _has_load(first))):
        spec = _series_spec(spec)
    config = DetectorConfig(threshold=threshold, grace_windows=grace_windows, adopt_after=adopt_after)
    detector = SignalDetector(spec, spec.build(grace_windows))
    tracker = config.tracker()
    for point in points:
        value, x = float(point["value"]), _inputs(point, spec.kind)
        if spec.kind == "latency" and not value > 0:  # no latency to judge (a gap filled with 0)
            yield ScoredPoint(float(point["timestamp"]), value, 0.0, False)
            continue
        if spec.kind == "rate":
            trials = int(x["trials"])
            reading = Reading(value / max(trials, 1), trials, x, int(value))
        else:
            reading = Reading(value, int(x.get("trials", 1)), x)
        detector.tracker = tracker
        verdict = detector.judge(reading, config)
        anomalous, severity = detector.for_lifecycle(verdict, config)
        if anomalous and tracker.reopens(paging=verdict.pages) is False:
            tracker = detector.tracker = config.tracker()  # the other kind: a new incident
        before = tracker.severity if tracker.firing else None
        step = tracker.step(anomalous, window_start=float(point["timestamp"]), severity=severity,
                            sustained=verdict.sustained)  # fmt: skip
        stepped_up = SEVERITY_RANK[severity] > SEVERITY_RANK.get(before or "", -1)
        pages = severity != "info" and (step is Transition.FIRING or (step is Transition.UPDATE and stepped_up))
        status = _status(step, tracker.firing, tracker.severity, anomalous)
        yield ScoredPoint(float(point["timestamp"]), value, round(verdict.score, 4), pages, status, verdict.explained)
        detector.learn_if_normal(reading, verdict)
        if detector.note_run(verdict.pages, reading, adopt_after):  # a lasting change: the new normal
            detector.adopt(reading)
            tracker.end_by_adoption()


def _has_load(point: Mapping[str, Any]) -> bool:
    """Whether a series carries load columns (read from its first point: an export's columns
    are the same on every row, and a cell left empty there is a gap, not a missing column)."""
    return any(name in point for name in LOAD_COLUMNS)


def _series_spec(spec: SignalSpec) -> SignalSpec:
    """The signal judged by the series' own recent level (``SeriesLevel``): no load to
    condition on. Same tail as the signal's own model (a drop in throughput is the fault)."""
    tail = spec.build(0).tail
    return replace(spec, build=lambda grace: SeriesLevel(tail=tail, space="log", grace_windows=grace))


def _status(step: Transition | None, firing: bool, severity: str | None, anomalous: bool) -> str:
    if step is Transition.RESOLVED:
        return "resolved"
    if firing:
        return "explained" if severity == "info" else "firing"
    return "pending" if anomalous else "normal"
