"""One replica's incidents against its peers: the evidence a comparison gives each window,
accumulated in a CUSUM, turned into ``replica_outlier`` events.

Shared by the request logs' comparison (``models.detect.replicas``) and the scrapes'
(``models.detect.engine_peers``): each says, per window, instance and signal, a CUSUM
increment (a log-likelihood ratio of "``min_ratio`` or more worse than its peers" against
"as its peers") and the ratio it saw; this module keeps the CUSUM, the incident lifecycle
and the wording. The CUSUM is reported on the surprise scale (log10) and judged against the
detector's ``threshold``; it is capped at three times that, so a fixed replica resolves soon.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servewatch.models.detect.events import incident_event
from servewatch.models.detect.lifecycle import IncidentTracker, Transition
from servewatch.models.detect.signal_detector import DetectorConfig
from servewatch.models.windows.segment_keys import join_key
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal
from servewatch.schemas.series import SeriesPoint, SignalPoint

LN10 = math.log(10.0)


def count_step(
    count: float, requests: float, peer_count: float, peer_requests: float, floor: float, alternative: float
) -> tuple[float, float] | None:
    """(CUSUM increment, ratio to the peers) of an instance's ``count`` events (failures,
    preemptions) over its ``requests``: the Poisson log-likelihood ratio of ``alternative``
    times the peers' rate (at least ``floor``) against it. None without requests on either side."""
    if requests <= 0 or peer_requests <= 0:
        return None
    expected = requests * max(peer_count / peer_requests, floor)
    return count * math.log(alternative) - expected * (alternative - 1), count / expected


def window_cap(config: DetectorConfig) -> float:
    """The most one window without critical evidence adds to an instance's CUSUM (natural log):
    half the bar, as a segment's lifecycle needs two anomalous windows, so that one
    heavy-tailed window never pages alone."""
    return config.threshold * LN10 / 2


def replica_series_key(model: str, instance: str, source: str = "requests") -> str:
    """The series key of an instance's ratios to its peers (no segment's key starts so); the
    scrapes' comparison of the same instance is a row of its own."""
    key = "~replica|" + join_key({"model": model, "instance": instance})
    return key if source == "requests" else f"{key}|from={source}"


@dataclass(slots=True)
class InstanceState:
    """One replica of one model: what it served and each signal's CUSUM and incident."""

    served: int = 0
    last_seen: float = -math.inf
    cusum: dict[str, float] = field(default_factory=dict)  # signal -> log-likelihood ratio (natural log)
    ratio: dict[str, float] = field(default_factory=dict)  # signal -> latest ratio to its peers
    peers: int = 0  # peers it was compared with, latest window
    trackers: dict[str, IncidentTracker] = field(default_factory=dict)
    share: float = math.nan  # its usual share of the requests its peers and it complete (learned)

    @property
    def firing(self) -> bool:
        return any(tracker.firing for tracker in self.trackers.values())

    def names(self, signal: Signal) -> bool:
        """Whether an incident of ``signal`` names this instance now: its differences from its
        peers are the fault's, and kept out of the spread the healthy ones are judged with (a
        percentile moves little for a minority of bad replicas, but one of four is a quarter
        of the differences, and it would widen the spread until its own evidence faded)."""
        tracker = self.trackers.get(signal.value)
        return tracker is not None and tracker.firing

    def state(self) -> dict[str, Any]:
        return {"served": self.served, "last_seen": self.last_seen, "cusum": self.cusum, "ratio": self.ratio,
                "trackers": {name: tracker.state() for name, tracker in self.trackers.items()},
                "share": None if math.isnan(self.share) else round(self.share, 5)}  # fmt: skip

    @classmethod
    def from_state(cls, saved: dict[str, Any], config: DetectorConfig) -> InstanceState:
        state = cls(int(saved["served"]), float(saved["last_seen"]))
        share = saved.get("share")  # absent in a state stored before it was kept: learned again
        state.share = math.nan if share is None else float(share)
        state.cusum = {str(k): float(v) for k, v in saved["cusum"].items()}
        state.ratio = {str(k): float(v) for k, v in saved["ratio"].items()}
        for signal, kept in saved["trackers"].items():
            tracker = state.trackers[str(signal)] = config.tracker()
            tracker.load_state(kept)
        return state


def tail_spread(values: Iterable[float]) -> float:
    """The spread of absolute differences read from their tail: the 90th percentile over the
    normal curve's (1.645). A percentile, so that a minority of bad replicas moves it little;
    the 90th, because differences between replicas have heavier tails than a median shows.

    >>> tail_spread([0.0, 1.0, 2.0, 3.0]) == float(np.quantile([0.0, 1.0, 2.0, 3.0], 0.9)) / 1.645
    True
    """
    return _percentile(np.fromiter(values, dtype=float), 0.9) / 1.645


def _percentile(values: np.ndarray, q: float) -> float:
    """``np.quantile(values, q)`` (its default, linear interpolation), to the last bit, by a
    partition around the two values it interpolates: ``np.quantile`` costs a few times more
    in its generality on the few hundred values a comparison keeps, once per window."""
    n = len(values)
    at = (n - 1) * q
    if at >= n - 1:
        return float(values.max())
    low = math.floor(at)
    gamma = at - low
    around = np.partition(values, (low, low + 1))
    a, b = float(around[low]), float(around[low + 1])
    # numpy's lerp: from the nearer end, so that the result is exact at either end.
    return b - (b - a) * (1.0 - gamma) if gamma >= 0.5 else a + (b - a) * gamma


def restored_instances(
    restore: Callable[[str], dict[str, Any] | None] | None, key: str, config: DetectorConfig,
    rest: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, InstanceState]:  # fmt: skip
    """A model's instances as stored under ``key`` (``{"instances": {name: InstanceState.state()}}``),
    ``rest(stored)`` reading what else the caller stored; none where nothing is stored, and
    none where another version's state cannot be read (the model starts fresh)."""
    stored = restore(key) if restore is not None else None
    if stored is None:
        return {}
    try:
        instances = {str(name): InstanceState.from_state(saved, config) for name, saved in stored["instances"].items()}
        if rest is not None:
            rest(stored)
    except (KeyError, TypeError, ValueError, AttributeError):
        return {}
    return instances


@dataclass
class PeerIncidents:
    """CUSUM and lifecycle per (instance, signal); ``words`` says what a ratio means per signal
    (``"decodes {ratio:.1f}x slower per output token"``), ``basis`` what the peers were
    compared on (``"on the same request mix"``)."""

    config: DetectorConfig
    words: dict[Signal, str]
    basis: str
    #: Whether one window with critical evidence may page alone (``step``'s ``alone`` decides
    #: where given). The scrapes' comparison decides per interval: engines are scraped out
    #: of step, so only a difference that holds against the peers' intervals over the same
    #: time may (``models.detect.engine_peers``).
    critical_alone: bool = True

    def step(
        self, model: str, instance: str, state: InstanceState, signal: Signal, step: tuple[float, float] | None,
        window: tuple[float, float], present: bool, load: dict[str, float], alone: bool | None = None,
    ) -> AnomalyEvent | None:  # fmt: skip
        """Feed one window's ``(increment, ratio)`` (None: not compared in it; ``present``:
        the instance served in it at all; ``alone``: whether this window may page alone with
        critical evidence, ``critical_alone`` if None). Returns the event of a lifecycle
        step, if any."""
        name = signal.value
        bar = self.config.threshold * LN10
        level = state.cusum.get(name, 0.0)
        if step is not None:
            increment, ratio = step
            # As a segment's lifecycle: a window pages alone only with critical evidence; else
            # it is worth ``window_cap`` at most.
            if increment < self.config.critical * LN10 or not (self.critical_alone if alone is None else alone):
                increment = min(increment, window_cap(self.config))
            level = min(max(0.0, level + increment), 3 * bar)
            state.ratio[name] = round(ratio, 3)
        elif not present:
            level = 0.0  # absent (drained, scaled in): nothing against it
        state.cusum[name] = level
        tracker = state.trackers.get(name)
        anomalous = step is not None and level >= bar
        if tracker is None:
            if not anomalous:
                return None
            tracker = state.trackers[name] = self.config.tracker()
        score = level / LN10
        severity = Severity.CRITICAL if score >= self.config.critical else Severity.WARNING
        if state.peers == 1:
            # Two replicas: no majority says which one to drain, only that they differ. That is
            # for the triage feed (``info``); what users feel pages at the model level.
            severity = Severity.INFO
        transition = tracker.step(anomalous, window_start=window[0], severity=severity.value, sustained=anomalous)
        if not tracker.firing and transition is None and not anomalous and level == 0.0:
            del state.trackers[name]  # quiet again: a healthy replica keeps no tracker
        if transition is None:
            return None
        return self._event(model, instance, state, signal, transition, tracker, window, score, load)

    def _event(
        self, model: str, instance: str, state: InstanceState, signal: Signal, transition: Transition,
        tracker: IncidentTracker, window: tuple[float, float], score: float, load: dict[str, float],
    ) -> AnomalyEvent:  # fmt: skip
        ratio = state.ratio.get(signal.value, 1.0)
        did = self.words[signal].format(ratio=ratio)
        peers = state.peers
        than = "its only peer" if peers == 1 else f"its {peers} peers"
        said = f"instance {instance} of model {model} {did} than {than} {self.basis}"
        if transition is Transition.RESOLVED:
            summary = f"Resolved: instance {instance} of model {model} is back in line with its peers."
            hints: list[Hint] = []
        elif peers == 1:
            # Two replicas: no majority says which one is off, only that they differ.
            message = f"{said}; with two replicas this says they differ, not which one is faulty"
            hints = [Hint(code="replica_outlier", message=message)]
            summary = f"Instance {instance} differs from {than}: {did}."
        else:
            message = f"{said}; drain it or check its GPU, its engine's config and its neighbours"
            hints = [Hint(code="replica_outlier", message=message)]
            summary = f"Instance {instance} of model {model} {did} than {than}."
        return incident_event(
            key=join_key({"model": model, "instance": instance}),
            signal=signal,
            incident_start=tracker.incident_start or window[0],
            transition=transition,
            labels={"model": model, "instance": instance},
            window=window,
            observed=ratio,
            expected=1.0,
            score=score,
            severity=Severity(tracker.severity or Severity.WARNING.value),
            summary=summary,
            hints=hints,
            load={**load, "peers": float(peers)},
            incident_name=f"replica_{signal.value}",
        )


def ratio_point(
    incidents: PeerIncidents, min_ratio: float, model: str, instance: str, state: InstanceState,
    found: dict[Signal, tuple[float, float]], window: tuple[float, float], load: dict[str, float],
    source: str = "requests",
) -> SeriesPoint:  # fmt: skip
    """An instance's window as a replica table row (``servewatch.series``, key
    ``replica_series_key``): per signal its ratio to its peers, the ratio that pages, and the
    accumulated evidence as the surprise."""
    bar = incidents.config.threshold
    signals = {}
    for signal, (_, ratio) in found.items():
        score = state.cusum.get(signal.value, 0.0) / LN10
        tracker = state.trackers.get(signal.value)
        signals[signal.value] = SignalPoint(
            observed=round(ratio, 4), expected=1.0, high=min_ratio, score=round(score, 3),
            anomalous=score >= bar, firing=tracker is not None and tracker.firing,
        )  # fmt: skip
    return SeriesPoint(
        key=replica_series_key(model, instance, source),
        segment={"model": model, "instance": instance, "source": source},
        window_start=window[0], window_end=window[1], load={**load, "peers": float(state.peers)}, signals=signals,
    )  # fmt: skip
