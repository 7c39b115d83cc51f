"""Shares that should stay put (prefix-cache hit rate, KV-cache usage): a level in logit space.

A share is judged on the logit scale, where 2 % → 0.02 and 90 % → 0.9 are far apart while
90 % → 92 % is not. The model keeps an exponentially weighted mean and variance of the
window's logit (its usual level and wobble) and adds the sampling noise of the window's
requests, so a collapse over a handful of requests is weak evidence and over hundreds is
strong. ``tail`` says which way is bad: a hit rate falling, a usage rising.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, Literal, NamedTuple

from river import base

from servewatch.models.stats.compact import CompactState, count, number
from servewatch.models.stats.latency import upper_tail_surprise
from servewatch.models.stats.params import param, shared

_EPS = 1e-3


def _logit(p: float) -> float:
    p = min(max(p, _EPS), 1 - _EPS)
    return math.log(p / (1 - p))


def shortfall_surprise(observed: float, expected: float, n: int, spread_var: float) -> float:
    """Surprise of a share ``observed`` over ``n`` requests falling short of ``expected``, in
    logit space: ``spread_var`` is the usual window-to-window variance, plus sampling noise.

    >>> shortfall_surprise(0.02, 0.9, 100, 0.02) > 10, shortfall_surprise(0.85, 0.9, 100, 0.02) < 1
    (True, True)
    """
    if n <= 0 or not (math.isfinite(observed) and math.isfinite(expected)):
        return 0.0
    e = min(max(expected, _EPS), 1 - _EPS)
    z = (_logit(e) - _logit(observed)) / math.sqrt(spread_var + 1.0 / (n * e * (1 - e)))
    return upper_tail_surprise(z) if z > 0 else 0.0


class _ShareParams(NamedTuple):
    tail: str
    halflife: float
    min_spread: float
    grace_windows: int


class ShareLevel(CompactState, base.SupervisedAnomalyDetector):
    """A share in [0, 1]; ``x["trials"]`` is the requests behind it (its sampling noise).

    Parameters
    ----------
    tail
        ``"lower"``: a drop is anomalous (hit rate); ``"upper"``: a rise is (usage).
    halflife
        Windows over which the level and wobble forget.
    min_spread
        Floor on the usual window-to-window sd of the logit.
    grace_windows
        Windows learned before ``score_one`` says anything but 0.

    Examples
    --------
    >>> import random
    >>> rng = random.Random(5)
    >>> model = ShareLevel()
    >>> for _ in range(50):
    ...     model.learn_one({"trials": 200}, min(0.99, max(0.0, rng.gauss(0.9, 0.02))))
    >>> model.score_one({"trials": 200}, 0.03) > 10     # hit rate collapsed
    True
    >>> model.score_one({"trials": 200}, 0.88) < 2      # a wobble
    True
    >>> model.score_one({"trials": 200}, 0.99)          # better is never anomalous here
    0.0
    """

    # Learned state: three doubles, alone or in a segment's buffer (``models.stats.compact``);
    # constructor arguments shared (``models.stats.params``).
    __slots__ = ()
    STATE_SIZE = 3
    mean = number(0)
    var = number(1)
    n_learned = count(2)
    tail = param("tail")
    halflife = param("halflife")
    min_spread = param("min_spread")
    grace_windows = param("grace_windows")

    def __init__(
        self,
        tail: Literal["lower", "upper"] = "lower",
        halflife: float = 100.0,
        min_spread: float = 0.15,
        grace_windows: int = 6,
    ) -> None:
        if tail not in ("lower", "upper"):
            raise ValueError("tail must be 'lower' or 'upper'")
        self._params = shared(_ShareParams, tail, halflife, min_spread, grace_windows)
        self._own([0.0, min_spread**2, 0.0])

    @property
    def expected(self) -> float:
        """The usual share."""
        return 1.0 / (1.0 + math.exp(-self.mean))

    def learn_one(self, x: dict[Hashable, Any], y: base.typing.Target) -> None:
        y = float(y)
        if not math.isfinite(y) or int(x.get("trials", 1)) <= 0:
            return
        value = _logit(y)
        if self.n_learned == 0:
            self.mean = value
        alpha = max(1.0 - 0.5 ** (1.0 / self.halflife), 1.0 / (self.n_learned + 1))
        delta = value - self.mean
        self.mean += alpha * delta
        self.var = (1.0 - alpha) * (self.var + alpha * delta * delta)
        self.n_learned += 1

    def score_one(self, x: dict[Hashable, Any], y: base.typing.Target) -> float:
        """Surprise of share ``y`` over ``x["trials"]`` requests, in the bad direction only."""
        y, n = float(y), int(x.get("trials", 1))
        if self.n_learned < self.grace_windows or n <= 0 or not math.isfinite(y):
            return 0.0
        drop = shortfall_surprise(y, self.expected, n, max(self.var, self.min_spread**2))
        rise = shortfall_surprise(1.0 - y, 1.0 - self.expected, n, max(self.var, self.min_spread**2))
        return drop if self.tail == "lower" else rise

    def adopt(self, share: float) -> None:
        """A lasting change was accepted as the new normal."""
        self.mean = _logit(share)

    def state(self) -> dict[str, Any]:
        return {"mean": self.mean, "var": self.var, "n_learned": self.n_learned}

    def load_state(self, state: dict[str, Any]) -> None:
        self._set_numbers(0, [float(state["mean"]), float(state["var"]), float(int(state["n_learned"]))])
