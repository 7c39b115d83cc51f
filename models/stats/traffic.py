"""Traffic that stops: requests per model per window against the model's usual for the hour.

No latency or rate signal can see a model that goes dark: with no requests there are no
windows to judge. So the detector bank counts each model's requests in every window it
releases (0 where a model sent none) and ``TrafficModel`` judges the count against what
the model usually serves at that hour of the day (UTC): an exponentially weighted mean per
hour, the model's overall mean until an hour has history of its own, and a learned
overdispersion (real traffic is burstier than Poisson). A count far below it, at most
``drop_share`` of the usual, is a ``traffic_drop``; a rise is load, never an anomaly.
``models.detect.traffic_watch`` keeps one per model, with its incident.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable
from typing import Any, NamedTuple

from river import base

from servewatch.models.stats.compact import CompactState, count, number
from servewatch.models.stats.params import param, shared

_LN10 = math.log(10.0)
HOURS = 24


class _TrafficParams(NamedTuple):
    halflife: float
    hour_halflife: float
    hour_windows: int
    drop_share: float
    grace_windows: int


@functools.cache  # the import machinery runs once, not in every window judged
def negative_binomial() -> Any:
    """scipy.stats' negative binomial, imported at the first call rather than with this module:
    scipy.stats costs most of a second to import, and the CLI imports this module for every
    command, most of which never judge traffic (``ship``, ``scrape``, ``--help``)."""
    from scipy.stats import nbinom

    return nbinom


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
        return max(-float(negative_binomial().logcdf(k, r, p)) / _LN10, 0.0)

    def state(self) -> dict[str, Any]:
        return {"numbers": self.numbers}

    def load_state(self, state: dict[str, Any]) -> None:
        self._set_numbers(0, [float(v) for v in state["numbers"]])
