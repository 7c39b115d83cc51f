"""Every model's traffic in judgement: a ``TrafficModel`` and an incident per model, fed the
requests per model of each window the detector bank releases."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from servewatch.models.detect.events import incident_event
from servewatch.models.detect.lifecycle import IncidentTracker, Transition
from servewatch.models.detect.signal_detector import DetectorConfig
from servewatch.models.stats.traffic import HOURS, TrafficModel, negative_binomial
from servewatch.models.windows.segment_keys import join_key
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal


class TrafficWatch:
    """Every model's ``TrafficModel`` and incident, fed each released window's counts.

    ``observe(start, end, counts)`` takes the requests per model in the window ``[start,
    end)`` (models absent from ``counts`` sent none) and returns the events of models whose
    traffic dropped (``traffic_drop``) or came back.
    """

    def __init__(self, config: DetectorConfig, restore: Callable[[str], dict[str, Any] | None] | None = None) -> None:
        self.config = config
        self.models: dict[str, tuple[TrafficModel, IncidentTracker]] = {}
        #: A model's stored state (``state``), when the watch first meets the model after a
        #: restart; the bank passes its table's, under ``key(model)``.
        self.restore = restore
        self.judged = 0  # windows judged since the states were last taken
        negative_binomial()  # imported as a worker or replay starts, not in its first judged window

    @staticmethod
    def key(model: str) -> str:
        """The state table key of a model's traffic (segment keys start ``model=``, engines'
        ``instance|``: a ``~`` starts neither)."""
        return f"~traffic|{model}"

    def _meet(self, model: str) -> None:
        traffic, tracker = TrafficModel(), self.config.tracker()
        stored = self.restore(self.key(model)) if self.restore is not None else None
        if stored is not None:
            try:
                traffic.load_state(stored["model"])
                tracker.load_state(stored["tracker"])
            except (KeyError, TypeError, ValueError, IndexError):  # another version: start fresh
                traffic, tracker = TrafficModel(), self.config.tracker()
        self.models[model] = (traffic, tracker)

    def states(self) -> list[tuple[str, dict[str, Any]]]:
        """(key, state) of every model's traffic, for the state table."""
        self.judged = 0
        return [(self.key(m), {"model": t.state(), "tracker": k.state()}) for m, (t, k) in self.models.items()]

    def observe(self, start: float, end: float, counts: dict[str, int]) -> list[AnomalyEvent]:
        self.judged += 1
        for model in counts:
            if model not in self.models:
                self._meet(model)
        hour = int(start // 3600) % HOURS
        events = []
        for model, (traffic, tracker) in self.models.items():
            k = counts.get(model, 0)
            x: dict[Hashable, Any] = {"hour": hour}
            score = traffic.score_one(x, k)
            anomalous = score >= self.config.threshold
            severity = Severity.CRITICAL if score >= self.config.critical else Severity.WARNING
            transition = tracker.step(anomalous, window_start=start, severity=severity.value)
            if not anomalous and not tracker.firing:
                traffic.learn_one(x, k)
            if transition is not None:
                events.append(self._event(model, traffic, tracker, transition, start, end, k, x, score))
        return events

    def _event(
        self, model: str, traffic: TrafficModel, tracker: IncidentTracker, transition: Transition, start: float,
        end: float, k: int, x: dict[Hashable, Any], score: float,
    ) -> AnomalyEvent:  # fmt: skip
        usual = traffic.expected(x)
        key = join_key({"model": model})
        resolved = transition is Transition.RESOLVED
        if resolved:
            summary = f"Resolved: traffic of model {model} is back: {k:,} requests in the window, {usual:,.0f} usual."
            hints: list[Hint] = []
        else:
            message = (
                f"model {model} served {k:,} requests in the window against {usual:,.0f} usual at this hour: the "
                "model went dark or its traffic went elsewhere (check the router, the serving instances and the "
                "shippers)"
            )
            hints = [Hint(code="traffic_drop", message=message)]
            summary = f"Traffic of model {model} dropped to {k:,} requests per window against {usual:,.0f} usual."
        return incident_event(
            key=key,
            signal=Signal.TRAFFIC,
            incident_start=tracker.incident_start or start,
            transition=transition,
            labels={"model": model},
            window=(start, end),
            observed=float(k),
            expected=usual,
            score=score,
            severity=Severity(tracker.severity or Severity.WARNING.value),
            load={"requests": float(k), "requests_per_s": k / max(end - start, 1e-9)},
            hints=hints,
            summary=summary,
        )
