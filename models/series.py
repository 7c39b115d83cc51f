"""One series through one signal's model, point by point: ``servewatch backtest-series``.

Users export a series (TTFT p95, an error rate, a hit rate) from Grafana or Prometheus and
ask "what would servewatch have said?". Each point is scored with what came before it
only (no look-ahead), then learned unless it was anomalous, exactly as a segment's
detector does with its windows; a run of ``adopt_after`` anomalous points becomes the new
normal. Optional load columns condition latency signals the way the live detector does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from models.signal_detector import DetectorConfig, SignalDetector
from models.signals import BY_SIGNAL, MODEL_FIGURES, Reading
from schemas.anomaly import Signal

#: Load columns a series may carry (per second), and the model inputs they feed.
LOAD_COLUMNS = MODEL_FIGURES


@dataclass(frozen=True, slots=True)
class ScoredPoint:
    timestamp: float
    value: float
    anomaly_score: float
    is_anomaly: bool


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
) -> Iterator[ScoredPoint]:
    """Score ``points`` (dicts with ``timestamp``, ``value`` and optional load or ``trials``)
    in order. For a rate signal ``value`` is the count of bad requests out of ``trials``.

    The live detector's own ``SignalDetector`` judges, learns and adopts, so a series is
    scored by exactly the rules a segment's windows are. A point explained by load keeps its
    (high) score but is not an anomaly.

    >>> flat = [{"timestamp": t, "value": 0.5} for t in range(30)]
    >>> spike = [{"timestamp": 30, "value": 5.0}, {"timestamp": 31, "value": 0.5}]
    >>> [(p.timestamp, p.is_anomaly) for p in score_series(flat + spike)][-2:]
    [(30.0, True), (31.0, False)]
    """
    spec = BY_SIGNAL[signal]
    config = DetectorConfig(threshold=threshold, grace_windows=grace_windows, adopt_after=adopt_after)
    detector = SignalDetector(spec, spec.build(grace_windows))
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
        verdict = detector.judge(reading, config)
        yield ScoredPoint(float(point["timestamp"]), value, round(verdict.score, 4), verdict.pages)
        if not verdict.pages:
            detector.learn(reading)
        if detector.note_run(verdict.pages, reading, adopt_after):  # a lasting change: the new normal
            detector.adopt(reading)
