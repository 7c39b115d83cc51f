"""Traffic that stops: requests per model per window against the model's usual for the hour.

No latency or rate signal can see a model that goes dark: with no requests there are no
windows to judge. So the detector bank counts each model's requests in every window it
releases (0 where a model sent none) and ``TrafficModel`` judges the count against what
the model usually serves at that hour of the day (UTC): an exponentially weighted mean per
hour, the model's overall mean until an hour has history of its own, and a learned
overdispersion (real traffic is burstier than Poisson). A count far below it, at most
``drop_share`` of the usual, is a ``traffic_drop``; a rise is load, never an anomaly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

from river import base
from scipy.stats import nbinom

from models.compact import CompactState, count, number
from models.lifecycle import IncidentTracker, Transition, fingerprint
from models.params import param, shared
from models.signal_detector import DetectorConfig
from models.wording import event_id
from schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status

_LN10 = math.log(10.0)
HOURS = 24


class _TrafficParams(NamedTuple):
    halflife: float
    hour_halflife: float
    hour_windows: int
    drop_share: float
    grace_windows: int


class TrafficModel(CompactState, base.AnomalyDetector):
    """Requests per window of one model (``x["hour"]``: the window's hour of the day, UTC).

    Parameters
    ----------
    halflife
        Windows over which the overall mean and the overdispersion forget.
    hour_halflife
        Windows *of that hour* over which an hour's mean forgets (a day has 360 windows of
        10 s per hour: a few days' worth).
    hour_windows
        Windows an hour needs before its own mean replaces the overall one.
    drop_share
        A count at most this share of the usual is a drop worth judging.
    grace_windows
        Windows learned before ``score_one`` says anything but 0.

    Examples
    --------
    >>> import random
    >>> rng = random.Random(2)
    >>> model = TrafficModel()
    >>> for i in range(720):
    ...     model.learn_one({"hour": 9}, rng.randint(35, 65))
    >>> model.score_one({"hour": 9}, 0) > 8        # the model went dark
    True
    >>> model.score_one({"hour": 9}, 30) < 1       # a quiet window
    True
    >>> model.score_one({"hour": 9}, 500)          # a surge is load
    0.0
    """

    __slots__ = ()
    STATE_SIZE = 4 + 2 * HOURS
    mean = number(0)  # overall EW mean of requests per window
    dispersion = number(1)  # EW of (count - mean)^2 / mean: 1 for Poisson traffic
    n_learned = count(2)
    halflife = param("halflife")
    hour_halflife = param("hour_halflife")
    hour_windows = param("hour_windows")
    drop_share = param("drop_share")
    grace_windows = param("grace_windows")

    def __init__(
        self,
        halflife: float = 360.0,
        hour_halflife: float = 1000.0,
        hour_windows: int = 100,
        drop_share: float = 0.2,
        grace_windows: int = 30,
    ) -> None:
        if not 0.0 < drop_share < 1.0:
            raise ValueError("drop_share must be in (0, 1)")
        self._params = shared(_TrafficParams, halflife, hour_halflife, hour_windows, drop_share, grace_windows)
        self._own([0.0, 1.0, 0.0, 0.0, *[0.0] * (2 * HOURS)])

    def _hour(self, x: dict[Hashable, Any]) -> int:
        return int(x.get("hour", 0)) % HOURS

    def expected(self, x: dict[Hashable, Any]) -> float:
        """The usual requests per window at ``x``'s hour."""
        hour = self._hour(x)
        mean, windows = self._buf[self._at + 4 + 2 * hour], self._buf[self._at + 5 + 2 * hour]
        return mean if windows >= self.hour_windows else self.mean

    def learn_one(self, x: dict[Hashable, Any], y: base.typing.Target | None = None) -> None:
        k = float(y or 0.0)
        n = self.n_learned
        alpha = max(1.0 - 0.5 ** (1.0 / self.halflife), 1.0 / (n + 1))
        usual = max(self.mean, 1e-9)
        if n >= 1:
            sample = min((k - usual) ** 2 / usual, 100.0)  # one wild window moves it a little
            self.dispersion += alpha * (sample - self.dispersion)
        self.mean += alpha * (k - self.mean)
        hour = 4 + 2 * self._hour(x)
        mean, windows = self._buf[self._at + hour], self._buf[self._at + hour + 1]
        beta = max(1.0 - 0.5 ** (1.0 / self.hour_halflife), 1.0 / (windows + 1))
        self._set_numbers(hour, [mean + beta * (k - mean), windows + 1.0])
        self.n_learned = n + 1

    def score_one(self, x: dict[Hashable, Any], y: base.typing.Target | None = None) -> float:
        """Surprise of so few requests (lower tail of a negative binomial); 0 above ``drop_share`` of the usual."""
        k = float(y or 0.0)
        usual = self.expected(x)
        if self.n_learned < self.grace_windows or usual <= 0 or k > self.drop_share * usual:
            return 0.0
        phi = max(self.dispersion, 1.0 + 1e-6)
        # Negative binomial of mean ``usual`` and variance ``phi * usual``.
        r, p = usual / (phi - 1.0), 1.0 / phi
        return max(-float(nbinom.logcdf(k, r, p)) / _LN10, 0.0)

    def state(self) -> dict[str, Any]:
        return {"numbers": self.numbers}

    def load_state(self, state: dict[str, Any]) -> None:
        self._set_numbers(0, [float(v) for v in state["numbers"]])


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
        key = f"model={model}"
        fp = fingerprint(key, Signal.TRAFFIC.value, tracker.incident_start or start)
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
        return AnomalyEvent(
            id=event_id(fp, f"{'resolved' if resolved else 'firing'}:{transition.value}", start),
            fingerprint=fp,
            status=Status.RESOLVED if resolved else Status.FIRING,
            transition=transition.value,
            signal=Signal.TRAFFIC,
            segment={"model": model},
            window_start=start,
            window_end=end,
            observed=float(k),
            expected=usual,
            score=round(score, 3),
            severity=Severity(tracker.severity or Severity.WARNING.value),
            load={"requests": float(k), "requests_per_s": k / max(end - start, 1e-9)},
            explained_by_load=False,
            hints=hints,
            summary=summary,
        )
