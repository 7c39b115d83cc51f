"""One series through one signal's model, point by point: ``servewatch backtest-series``.

Users export a series (TTFT p95, an error rate, a hit rate) from Grafana or Prometheus and
ask "what would servewatch have said?". Each point is scored with what came before it
only (no look-ahead), then learned unless it was anomalous, exactly as a segment's
detector does with its windows; a run of ``adopt_after`` anomalous points becomes the new
normal. Optional load columns condition latency signals the way the live detector does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from models.signals import BY_SIGNAL, MODEL_FIGURES
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
        return {f"model_{name}": float(point.get(name) or 1.0) for name in LOAD_COLUMNS}
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

    >>> flat = [{"timestamp": t, "value": 0.5} for t in range(30)]
    >>> spike = [{"timestamp": 30, "value": 5.0}, {"timestamp": 31, "value": 0.5}]
    >>> [(p.timestamp, p.is_anomaly) for p in score_series(flat + spike)][-2:]
    [(30.0, True), (31.0, False)]
    """
    spec = BY_SIGNAL[signal]
    model = spec.build(grace_windows)
    run_total, run_length = 0.0, 0  # the current run of anomalous points
    for point in points:
        value, x = float(point["value"]), _inputs(point, spec.kind)
        if spec.kind == "latency":
            score = model.judge(x, value)[1] if value > 0 else 0.0
        else:
            score = model.score_one(x, value)
        anomalous = score >= threshold
        yield ScoredPoint(float(point["timestamp"]), value, round(score, 4), anomalous)
        if not anomalous:
            model.learn_one(x, value)
            run_total, run_length = 0.0, 0
            continue
        run_total, run_length = run_total + _adoptable(value, x, spec.kind), run_length + 1
        if run_length >= adopt_after:  # a lasting change: the new normal
            mean = run_total / run_length
            if spec.kind == "latency":
                model.adopt(x, math.exp(mean))
            else:
                model.adopt(mean)
            run_total, run_length = 0.0, 0


def _adoptable(value: float, x: Mapping[str, Any], kind: str) -> float:
    if kind == "latency":
        return math.log(max(value, 1e-9))
    if kind == "rate":
        return value / max(int(x["trials"]), 1)
    return value
