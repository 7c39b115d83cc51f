"""From closed segment windows to ``AnomalyEvent``s: one detector per segment and signal.

A window is judged twice. Against the load-conditioned model: is latency higher than this
*demand* explains? (pages). Against the load-blind level: is latency higher than usual at
all? (if so but demand explains it, an ``info`` event with ``explained_by_load: true``).
Windows that page are not learned, so an incident never becomes the new normal.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from models.hints import Baseline, latency_hints
from models.latency import LoadConditionedLatency, quantile_sampling_var
from models.lifecycle import IncidentTracker, Transition, fingerprint
from models.window import WindowStats
from schemas.anomaly import AnomalyEvent, Severity, Signal, Status


@dataclass(frozen=True)
class DetectorConfig:
    """Knobs shared by every segment's detectors."""

    threshold: float = 4.0  # surprise (-log10 p) at which a window is anomalous
    critical: float = 8.0  # surprise at which a paging window is critical
    min_requests: int = 5  # fewer TTFT samples in a window: no verdict, nothing learned
    ttft_quantile: float = 0.95
    fire_after: int = 2
    fire_within: int = 3
    resolve_after: int = 3
    update_every: int = 6
    young_windows: int = 30  # baseline younger than this is flagged in events
    grace_windows: int = 6


def _segment_phrase(labels: dict[str, str]) -> str:
    rest = [
        f"{name.replace('_band', '')} {value}" for name, value in labels.items() if name != "model" and value != "-"
    ]
    return f"model {labels.get('model', 'other')}" + (f" ({', '.join(rest)})" if rest else "")


def event_id(fp: str, status: str, window_start: float) -> str:
    return hashlib.blake2b(f"{fp}|{status}|{window_start:.3f}".encode(), digest_size=12).hexdigest()


@dataclass(slots=True)
class TTFTDetector:
    """TTFT tail of one segment, judged against demand."""

    key: str
    config: DetectorConfig = field(default_factory=DetectorConfig)
    model: LoadConditionedLatency = field(init=False)
    tracker: IncidentTracker = field(init=False)
    usual: Baseline = field(default_factory=Baseline)
    last_window_end: float = -math.inf

    def __post_init__(self) -> None:
        c = self.config
        self.model = LoadConditionedLatency(grace_windows=c.grace_windows)
        self.tracker = IncidentTracker(c.fire_after, c.fire_within, c.resolve_after, c.update_every)

    def observe(self, window: WindowStats) -> AnomalyEvent | None:
        if window.end <= self.last_window_end:
            return None  # already judged: a replayed window changes nothing (idempotent)
        ttft = window.ttft
        count = ttft.count
        if count < self.config.min_requests:
            return None
        self.last_window_end = window.end
        c = self.config
        load = window.load()
        observed, p90, p10 = ttft.quantiles(c.ttft_quantile, 0.9, 0.1)
        spread = math.log(p90 / p10) / 2.563  # log sd within window
        x: dict[Hashable, Any] = {name: value for name, value in load.items()}  # river-typed features
        x["sampling_var"] = quantile_sampling_var(c.ttft_quantile, count, max(spread, 0.1))
        prediction = self.model.predict_one(x)
        conditioned = self.model.score_one(x, observed)
        level = self.model.level_score(x, observed)
        pages = conditioned >= c.threshold and math.log(observed) > prediction.level
        explained = not pages and level >= c.threshold
        severity = (
            Severity.CRITICAL if pages and conditioned >= c.critical else Severity.WARNING if pages else Severity.INFO
        )
        demand_ratio = math.exp(self.model.demand_index(x)) if self.model.n_learned else 1.0
        usual_snapshot = Baseline(**{k: getattr(self.usual, k) for k in Baseline.__dataclass_fields__})
        if not pages:
            self.model.learn_one(x, observed)
            self.usual.learn(load)
        transition = self.tracker.step(pages or explained, window_start=window.start, severity=severity.value)
        if transition is None:
            return None
        status = Status.RESOLVED if transition is Transition.RESOLVED else Status.FIRING
        fp = fingerprint(self.key, Signal.TTFT.value, self.tracker.incident_start or window.start)
        labels = window.labels
        if status is Status.RESOLVED:
            severity = Severity(self.tracker.severity or Severity.INFO.value)
            hints = []
            summary = (
                f"Resolved: TTFT p{c.ttft_quantile * 100:.0f} for {_segment_phrase(labels)} is back to "
                f"{observed:.2f} s against {prediction.expected:.2f} s expected."
            )
            explained = False
        else:
            hints = latency_hints(load, usual_snapshot, explained_by_load=explained)
            summary = self._summary(labels, observed, prediction.expected, math.exp(prediction.level), load,
                                    demand_ratio, explained, hints)  # fmt: skip
        return AnomalyEvent(
            id=event_id(fp, f"{status.value}:{transition.value}", window.start),
            fingerprint=fp,
            status=status,
            signal=Signal.TTFT,
            segment=labels,
            window_start=window.start,
            window_end=window.end,
            observed=observed,
            expected=prediction.expected,
            score=round(max(conditioned, level if explained else conditioned), 3),
            severity=severity,
            load={**{k: round(v, 4) for k, v in load.items()}, "demand_vs_usual": round(demand_ratio, 3)},
            explained_by_load=explained,
            hints=hints,
            evidence=window.evidence_records() if status is Status.FIRING else [],
            summary=summary,
            baseline_young=self.model.n_learned < c.young_windows,
        )

    def _summary(
        self,
        labels: dict[str, str],
        observed: float,
        expected: float,
        usual: float,
        load: dict[str, float],
        demand_ratio: float,
        explained: bool,
        hints: list,
    ) -> str:
        q = f"p{self.config.ttft_quantile * 100:.0f}"
        head = f"TTFT {q} for {_segment_phrase(labels)} is {observed:.2f} s"
        if explained:
            return (
                f"{head} against a usual {usual:.2f} s, in line with load: demand is {demand_ratio:.1f}x usual "
                f"({load['requests_per_s']:.1f} req/s); explained by load, not paging."
            )
        why = f"; {hints[0].message}" if hints else ""
        return (
            f"{head} against {expected:.2f} s expected at this load ({load['requests_per_s']:.1f} req/s, "
            f"demand {demand_ratio:.1f}x usual); not explained by load{why}."
        )


@dataclass
class DetectorBank:
    """All segments' detectors. Bounded: segments are capped upstream by the ``Segmenter``."""

    config: DetectorConfig = field(default_factory=DetectorConfig)
    detectors: dict[str, TTFTDetector] = field(default_factory=dict)
    windows_judged: int = 0

    def observe(self, window: WindowStats) -> list[AnomalyEvent]:
        detector = self.detectors.get(window.key)
        if detector is None:
            detector = self.detectors[window.key] = TTFTDetector(window.key, self.config)
        self.windows_judged += 1
        event = detector.observe(window)
        return [event] if event is not None else []
