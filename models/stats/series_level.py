"""A series on its own: a robust level and scale of its recent points, no load to condition on.

``servewatch backtest-series`` scores a series exported from a dashboard, often without
the load columns the load-conditioned model needs (``models.stats.latency``). Fed a
constant demand, that model is a load-blind level built for 10 s windows of a live
segment: a slow anchor, a noise estimate that forgets over hundreds of windows and tails
learned over a thousand. A series of 5-minute points whose scale changes by a factor of
ten within a day (NAB's) blinds it for days. This model is what a careful
rolling z-score is, made robust and calibrated:

* **space**: the log of the value for latency-like series (a 2x rise means the same at
  50 ms and at 5 s), the value itself otherwise;
* **level and scale** are exponentially weighted over recent points (``level_halflife``,
  ``scale_halflife``), and each point moves them by at most ``huber`` sds, so one wild
  point cannot drag the level or blow up the scale; the clipped squares are rescaled so
  that the variance stays right for tails that heavy (``tails.clipped_square_mean``);
* **Gaussian tails**: a point is judged as a standard normal residual. Unlike
  ``LoadConditionedLatency`` it learns no heavy tails: on NAB (``bench/nab.py``) learning
  them from a few days of 5-minute points cost more faults missed than the false pages it
  saved, and the incident lifecycle already asks for 2 anomalous points of 3, which an
  isolated wild point of heavy-tailed noise does not give. The price: a series whose noise
  throws wild points in pairs (Student-t of 5 degrees, AR 0.5) pages about 1.3 times in
  10,000 points, beside the 1 promised (``tests/test_backtest_series.py`` bounds it at 2);
* **two points**: each point is also judged with the one before (``tails.pair_surprise``):
  a shift of 3 sds that one point cannot prove, two can.

It has no seasonality: a daily cycle is judged as the level moving. ``score_one`` is the
same surprise as every servewatch model (``-log10`` of a tail probability: 4 is 1 in 10,000),
and ``judge`` answers as ``LoadConditionedLatency.judge`` does, so a signal's detector and its
incident lifecycle take it unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, ClassVar, Literal, NamedTuple

from river import base

from servewatch.models.stats.compact import CompactState, count, number
from servewatch.models.stats.latency import Judgement, Prediction
from servewatch.models.stats.params import param, shared
from servewatch.models.stats.tails import TWO_LOOKS, clipped_square_mean, pair_surprise, upper_tail_surprise

#: What the prior scale is worth, in points: a series' first few points cannot make it look
#: quiet (or wild) on their own.
SCALE_PRIOR_POINTS = 4.0
#: Degrees of freedom the residuals are judged with: Gaussian (see the module's docstring).
GAUSSIAN = 1000.0
#: A point this surprising alone (1 in 10,000) speaks for itself and pairs with no next one:
#: the model learns no echo of wild points, so a spike's fading point would pass for a fault's.
PAIR_PREVIOUS_MAX = 4.0


class _Params(NamedTuple):
    tail: str
    space: str
    level_halflife: float
    scale_halflife: float
    huber: float
    prior_sd: float
    min_sd: float
    grace_windows: int


class SeriesLevel(CompactState, base.SupervisedAnomalyDetector):
    """One series' recent level and scale; ``y`` is its value, ``x`` is not read.

    Parameters
    ----------
    tail
        ``"upper"``: higher than usual is anomalous (latency); ``"lower"``: lower is (throughput).
    space
        ``"log"`` (positive, latency-like values: judged as ratios) or ``"raw"``.
    level_halflife
        Points over which the level forgets.
    scale_halflife
        Points over which the scale (the usual distance from the level) forgets.
    huber
        A point moves the level and scale as if it were at most this many sds away.
    prior_sd
        The scale before any point (in ``space``), worth ``SCALE_PRIOR_POINTS`` points.
    min_sd
        Floor on the scale: in log space an absolute one (0.02 is 2 %), in raw space relative
        to the level's size. A perfectly flat series is not infinitely sure of itself.
    grace_windows
        Points learned before ``score_one`` says anything but 0.

    Examples
    --------
    >>> import random
    >>> rng = random.Random(3)
    >>> model = SeriesLevel()
    >>> for _ in range(100):
    ...     model.learn_one({}, 45.0 * math.exp(rng.gauss(0, 0.04)))
    >>> round(model.expected)
    45
    >>> model.score_one({}, 90.0) > 8        # twice the usual: page
    True
    >>> model.score_one({}, 47.0) < 1        # a wobble
    True
    >>> model.score_one({}, 20.0)            # lower is never anomalous for latency
    0.0
    """

    __slots__ = ()
    #: Gaussian tails, not learned: a lone wild point waits for a second (``SignalDetector.judge``).
    tails_learned: ClassVar[bool] = False
    STATE_SIZE = 4
    level = number(0)
    var = number(1)
    n_learned = count(2)
    last_z = number(3)  # the previous point's residual in sds, towards ``tail`` (for the pair)
    tail = param("tail")
    space = param("space")
    level_halflife = param("level_halflife")
    scale_halflife = param("scale_halflife")
    huber = param("huber")
    prior_sd = param("prior_sd")
    min_sd = param("min_sd")
    grace_windows = param("grace_windows")

    def __init__(
        self,
        tail: Literal["upper", "lower"] = "upper",
        space: Literal["log", "raw"] = "log",
        level_halflife: float = 12.0,
        scale_halflife: float = 48.0,
        huber: float = 3.0,
        prior_sd: float = 0.1,
        min_sd: float = 0.02,
        grace_windows: int = 6,
    ) -> None:
        if tail not in ("upper", "lower"):
            raise ValueError("tail must be 'upper' (a rise is bad) or 'lower' (a drop is bad)")
        if space not in ("log", "raw"):
            raise ValueError("space must be 'log' (positive values, judged as ratios) or 'raw'")
        self._params = shared(
            _Params, tail, space, level_halflife, scale_halflife, huber, prior_sd, min_sd, grace_windows
        )
        self._own([0.0, prior_sd**2, 0.0, 0.0])

    # -- the series' space ------------------------------------------------------------------
    def _value(self, y: float) -> float | None:
        """``y`` in the model's space; None where it has none there (a gap, or log of <= 0)."""
        if not math.isfinite(y):
            return None
        if self.space == "log":
            return math.log(y) if y > 0 else None
        return y

    @property
    def sd(self) -> float:
        floor = self.min_sd if self.space == "log" else self.min_sd * max(abs(self.level), 1e-9)
        return max(math.sqrt(max(self.var, 0.0)), floor)

    @property
    def warm(self) -> bool:
        return self.n_learned >= self.grace_windows

    @property
    def expected(self) -> float:
        """The usual value, in the series' own units."""
        return math.exp(self.level) if self.space == "log" else self.level

    def _residual(self, value: float) -> float:
        """Standardised residual towards ``tail`` (positive: the bad direction)."""
        sign = 1.0 if self.tail == "upper" else -1.0
        return sign * (value - self.level) / self.sd

    # -- judging ----------------------------------------------------------------------------
    def predict_one(self, x: dict[Hashable, Any] | None = None) -> Prediction:
        """The usual level and spread, as ``LoadConditionedLatency.predict_one`` gives them
        (in the model's space: log for latency-like series)."""
        sd = self.sd
        return Prediction(self.level, sd, self.level, sd, nu=GAUSSIAN)

    def judge(self, x: dict[Hashable, Any], y: float) -> Judgement:
        """The prediction, and the surprise of ``y`` alone and with the point before (the
        larger, less ``TWO_LOOKS``), shaped as ``LoadConditionedLatency.judge`` answers:
        no load, so the load-blind surprise is the same and nothing is ever at an unusual
        demand."""
        prediction = self.predict_one(x)
        value = self._value(float(y))
        if not self.warm or value is None:
            return Judgement(prediction, 0.0, 0.0, False, True, 0.0)
        z = self._residual(value)
        alone = upper_tail_surprise(z) if z > 0 else 0.0
        paired = (
            pair_surprise(z, self.last_z, 0.0, GAUSSIAN, previous_max=PAIR_PREVIOUS_MAX)
            if self.n_learned > self.grace_windows
            else 0.0
        )
        surprise = max(max(alone, paired) - TWO_LOOKS, 0.0)
        return Judgement(prediction, surprise, surprise, False, True, max(paired - TWO_LOOKS, 0.0), alone=alone)

    def score_one(self, x: dict[Hashable, Any], y: base.typing.Target) -> float:
        return self.judge(x, float(y)).conditioned

    # -- learning ---------------------------------------------------------------------------
    def learn_one(self, x: dict[Hashable, Any], y: base.typing.Target) -> None:
        value = self._value(float(y))
        if value is None:
            return
        n = self.n_learned
        if n == 0:
            self.level = value
        else:
            sd = self.sd
            self.last_z = self._residual(value)
            # A point moves the level and the scale as if it were at most ``huber`` sds away;
            # the clipped square is rescaled by what clipping leaves of a unit variance.
            limit = self.huber * sd
            delta = min(max(value - self.level, -limit), limit)
            a_level = max(1.0 - 0.5 ** (1.0 / self.level_halflife), 1.0 / (n + 1))
            a_scale = max(1.0 - 0.5 ** (1.0 / self.scale_halflife), 1.0 / (n + SCALE_PRIOR_POINTS))
            square = delta * delta / clipped_square_mean(self.huber, GAUSSIAN)
            self.var += a_scale * (square - self.var)
            self.level += a_level * delta
        self.n_learned = n + 1

    def note_unlearned(
        self, x: dict[Hashable, Any], y: float, *, tails: bool = True, drift: bool = False, pairs: bool = True
    ) -> None:
        """A judged point the model does not learn (it was anomalous): it is still the next
        point's pair, unless ``pairs`` is off (load explained it). (``tails`` and ``drift``
        are ``LoadConditionedLatency``'s: this model learns no tails and has no drift check.)"""
        value = self._value(float(y))
        if value is not None and self.warm:
            self.last_z = self._residual(value) if pairs else 0.0

    def adopt(self, x: dict[Hashable, Any], y: float) -> None:
        """A lasting change was accepted as the new normal: the level is ``y`` from here."""
        value = self._value(float(y))
        if value is not None:
            self.level, self.last_z = value, 0.0

    # -- state ------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "var": self.var,
            "n_learned": self.n_learned,
            "last_z": self.last_z,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self._set_numbers(
            0,
            [
                float(state["level"]),
                float(state["var"]),
                float(int(state["n_learned"])),
                float(state["last_z"]),
            ],
        )
