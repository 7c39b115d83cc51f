"""Load-conditioned latency: what should a window's latency be, given its demand?

The model is a small Bayesian linear regression (a Kalman filter whose level may drift)
of log latency on a demand index ``D``, the mean log ratio of requests/s and prompt
tokens/s to the segment's reference demand (learned over its first windows)::

    log(latency) = level + e * D + e_surge * max(0, D - log(surge_ratio)) + noise

Latency is flat in demand at low utilisation and rises steeply near capacity, so one
slope cannot serve both: small day-to-day jitter would teach "latency ignores demand"
and the first real surge would page. The hinge term ``e_surge`` covers demand beyond
``surge_ratio`` times the usual; it starts from an informative prior (latency grows at
least in proportion to demand there) and is learned once the segment has seen surges.
Two properties follow, and they are the point:

* a window at the usual demand is judged against a tight prediction, so a 10x TTFT at flat
  traffic (prefix cache off) is wildly surprising;
* a window at 3x demand is judged against a prediction that expects a rise and is unsure
  of its size, so a surge-driven rise is *explained by load* instead of paging, and the
  window teaches the model the segment's real response to load.

Demand deliberately means requests/s and prompt tokens/s only. Uncached prompt tokens and
concurrency are reported with each window but are not regressors: a disabled prefix
cache multiplies uncached tokens, and any slowdown raises concurrency (Little's law), so
conditioning on them would explain away the very faults servewatch exists to catch.

``score_one`` returns the *surprise*, ``-log10`` of the upper-tail probability of the
observation under the predictive distribution: 2 means 1 in 100, 4 means 1 in 10,000.
It does not saturate, and it means the same on every signal.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from river import base

from models.compact import CompactState, count
from models.params import param, shared

_LN10 = math.log(10.0)
FEATURES: tuple[str, str] = ("requests_per_s", "prompt_tokens_per_s")


def upper_tail_surprise(z: float) -> float:
    """``-log10 P(Z >= z)`` for a standard normal, accurate far into the tail.

    >>> round(upper_tail_surprise(0.0), 3), round(upper_tail_surprise(3.0), 2)
    (0.301, 2.87)
    >>> upper_tail_surprise(60.0) > upper_tail_surprise(50.0) > 500
    True
    """
    if z < 8.0:
        return -math.log10(max(0.5 * math.erfc(z / math.sqrt(2.0)), 1e-300))
    # Mills-ratio asymptote: log sf(z) ~ -z^2/2 - log(z) - log(sqrt(2 pi)).
    log_sf = -0.5 * z * z - math.log(z) - 0.5 * math.log(2.0 * math.pi)
    return -log_sf / _LN10


def quantile_sampling_var(q: float, n: int, log_spread_sd: float) -> float:
    """Variance of the log of a sample ``q``-quantile over ``n`` values.

    Asymptotic variance of a sample quantile, ``q(1-q) / (n f(x_q)^2)``, for log values that
    are roughly normal with standard deviation ``log_spread_sd`` within the window.

    >>> round(quantile_sampling_var(0.95, 10, 0.5), 3), round(quantile_sampling_var(0.95, 1000, 0.5), 5)
    (0.112, 0.00112)
    """
    if n <= 0:
        return math.inf
    z = _normal_quantile(q)
    density = math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return q * (1.0 - q) / (n * density * density) * log_spread_sd**2


@functools.lru_cache(maxsize=64)
def _normal_quantile(q: float) -> float:
    """Inverse standard normal CDF by bisection on erfc (called once per window; exactness is cheap)."""
    lo, hi = -10.0, 10.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if 0.5 * math.erfc(-mid / math.sqrt(2.0)) < q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Prediction:
    mean: float  # in log space
    sd: float  # predictive standard deviation, log space
    level: float  # load-blind baseline (log space): what the segment usually shows
    level_sd: float

    @property
    def expected(self) -> float:
        """Expected latency in seconds (the median of the log-normal prediction)."""
        return math.exp(self.mean)


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    """Dot product of two 3-vectors."""
    return a[0] * b[0] + a[1] * b[1] + a[2] * b[2]


def _matvec(m: Sequence[float], v: Sequence[float]) -> list[float]:
    """A 3x3 matrix (row-major, flat) times a 3-vector."""
    return [
        m[0] * v[0] + m[1] * v[1] + m[2] * v[2],
        m[3] * v[0] + m[4] * v[1] + m[5] * v[2],
        m[6] * v[0] + m[7] * v[1] + m[8] * v[2],
    ]


class _Params(NamedTuple):
    elasticity: float
    surge_ratio: float
    surge_elasticity: float
    elasticity_sd: float
    level_drift_sd: float
    noise_sd: float
    noise_halflife: float
    grace_windows: int
    min_noise_sd: float
    features: tuple[str, str]
    tail: str


#: Layout of ``LoadConditionedLatency``'s learned numbers: reference log demand (2),
#: regression weights (3), their covariance (3x3, row-major), noise variance and weight,
#: load-blind level mean and variance; the windows learned follow.
_STATE_SIZE = 18


class LoadConditionedLatency(CompactState, base.SupervisedAnomalyDetector):
    """Latency of a window given its demand; ``y`` is a latency in seconds (e.g. TTFT p95).

    ``x`` holds the window's ``requests_per_s`` and ``prompt_tokens_per_s``, and optionally
    ``sampling_var``: the variance (log space) that the observation owes to its finite sample
    (see ``quantile_sampling_var``). A p95 over 8 requests is far noisier than over 800;
    counting that keeps small segments quiet without hiding big ones.

    Parameters
    ----------
    elasticity
        Prior mean of d log(latency) / d log(demand) around the usual demand.
    surge_ratio
        Demand above this multiple of the usual is a surge, with its own slope.
    surge_elasticity
        Prior mean of the extra slope beyond ``surge_ratio`` (queueing near capacity).
    elasticity_sd
        How unsure both slope priors are. Wide enough that a surge's rise of any plausible
        size stays explainable until the segment has seen its own load changes.
    level_drift_sd
        How far (log space, per window) the level may drift on its own: slow changes are
        tracked, sudden ones are surprising.
    noise_sd
        Prior for the window-to-window noise of log latency, refined from the data.
    noise_halflife
        Windows over which the noise and level estimates forget.
    grace_windows
        Windows learned before ``score_one`` says anything but 0 (a cold segment is quiet);
        the reference demand is the mean over these windows.
    min_noise_sd
        Floor on the noise: below ~5 % latency jitter is measurement, not signal.
    features
        The two demand figures of ``x`` the index is built from (e.g. requests/s and
        output tokens/s for decode latency).
    tail
        ``"upper"``: higher than predicted is anomalous (latency); ``"lower"``: lower is
        (throughput), with ``elasticity`` then usually negative.

    Examples
    --------
    >>> import random
    >>> rng = random.Random(7)
    >>> model = LoadConditionedLatency()
    >>> for _ in range(60):
    ...     x = {"requests_per_s": rng.uniform(9, 11), "prompt_tokens_per_s": rng.uniform(9e3, 11e3)}
    ...     model.learn_one(x, 0.8 * math.exp(rng.gauss(0, 0.1)))
    >>> flat = {"requests_per_s": 10.0, "prompt_tokens_per_s": 10_000.0}
    >>> round(model.predict_one(flat).expected, 1)
    0.8
    >>> model.score_one(flat, 8.0) > 10      # 10x TTFT at flat traffic: page
    True
    >>> surge = {"requests_per_s": 30.0, "prompt_tokens_per_s": 30_000.0}
    >>> model.score_one(surge, 2.4) < 2      # 3x TTFT at 3x traffic: explained by load
    True
    """

    # Thousands of segments each hold several: the whole learned state is a run of doubles
    # (``_STATE_SIZE`` and the count), alone or in the segment's buffer (``models.compact``).
    # The constructor arguments live in one ``_Params`` shared by every model built with
    # the same ones (they are read through the properties below, as river expects).
    __slots__ = ()
    STATE_SIZE = _STATE_SIZE + 1  # and the windows learned
    n_learned = count(_STATE_SIZE)
    elasticity = param("elasticity")
    surge_ratio = param("surge_ratio")
    surge_elasticity = param("surge_elasticity")
    elasticity_sd = param("elasticity_sd")
    level_drift_sd = param("level_drift_sd")
    noise_sd = param("noise_sd")
    noise_halflife = param("noise_halflife")
    grace_windows = param("grace_windows")
    min_noise_sd = param("min_noise_sd")
    features = param("features")
    tail = param("tail")

    def __init__(
        self,
        elasticity: float = 0.3,
        surge_ratio: float = 1.3,
        surge_elasticity: float = 1.0,
        elasticity_sd: float = 1.0,
        level_drift_sd: float = 0.01,
        noise_sd: float = 0.3,
        noise_halflife: float = 100.0,
        grace_windows: int = 6,
        min_noise_sd: float = 0.05,
        features: tuple[str, str] = FEATURES,
        tail: str = "upper",
    ) -> None:
        if len(features) != 2:
            raise ValueError("features: exactly two demand figures")
        if tail not in ("upper", "lower"):
            raise ValueError("tail must be 'upper' (a rise is bad) or 'lower' (a drop is bad)")
        self._params = shared(
            _Params,
            elasticity, surge_ratio, surge_elasticity, elasticity_sd, level_drift_sd, noise_sd, noise_halflife,
            grace_windows, min_noise_sd, tuple(features), tail,
        )  # fmt: skip
        prior_var = elasticity_sd**2
        self._own(
            [
                0.0, 0.0,  # reference log demand: set over the grace windows
                0.0, elasticity, surge_elasticity,  # weights: level, slope, surge slope
                100.0, 0.0, 0.0, 0.0, prior_var, 0.0, 0.0, 0.0, prior_var,  # covariance
                noise_sd**2, 2.0,  # noise variance, and the pseudo-windows behind that prior
                0.0, noise_sd**2,  # load-blind level: EW mean and variance of log latency
                0.0,  # windows learned
            ],
        )  # fmt: skip

    # -- features -----------------------------------------------------------------
    # Plain floats, not numpy: the vectors have two or three elements, and numpy's cost
    # per call was most of a window's judging time.
    def _log_demand(self, x: dict[Hashable, Any]) -> list[float]:
        return [math.log(max(float(x.get(name, 0.0)), 1e-6)) for name in self._params.features]

    def demand_index(self, x: dict[Hashable, Any]) -> float:
        """Mean log ratio of demand to the reference: 0 is usual, log(3) is three times."""
        if self.n_learned == 0:
            return 0.0
        reference = self.numbers[0:2]
        return sum(now - usual for now, usual in zip(self._log_demand(x), reference, strict=True)) / 2

    def _phi(self, x: dict[Hashable, Any]) -> tuple[float, float, float]:
        d = self.demand_index(x)
        return (1.0, d, max(0.0, d - math.log(self.surge_ratio)))

    @property
    def _decay(self) -> float:
        return float(0.5 ** (1.0 / self.noise_halflife))

    # -- river API -----------------------------------------------------------------
    def learn_one(self, x: dict[Hashable, Any], y: base.typing.Target) -> None:
        y = float(y)
        if not (y > 0 and math.isfinite(y)):
            return
        log_y = math.log(y)
        state = self.numbers
        reference, weights, cov = state[0:2], state[2:5], state[5:14]
        noise_var, noise_weight, level_mean, level_var = state[14:18]
        n = self.n_learned
        if n < self.grace_windows:
            # Reference demand = running mean over the grace windows but the first: a stream
            # usually starts mid-window, and a partial first window would set the reference
            # so low that normal traffic would look like a surge and teach the surge slope.
            now = self._log_demand(x)
            weight = 1.0 if n <= 1 else 1.0 / n
            reference = [r + (d - r) * weight for r, d in zip(reference, now, strict=True)]
            self._set_numbers(0, reference)
        if n == 0:
            weights[0] = level_mean = log_y
        phi = self._phi(x)
        sampling_var = float(x.get("sampling_var", 0.0))
        # Predict step: the level may drift a little each window.
        cov[0] += self.level_drift_sd**2
        residual = log_y - _dot(phi, weights)
        cov_phi = _matvec(cov, phi)
        param_var = _dot(phi, cov_phi)
        # Noise between windows: exponentially weighted mean of squared innovations, net of
        # parameter uncertainty and of this window's own sampling noise.
        decay = self._decay
        sample = max(residual * residual - param_var - sampling_var, 0.0)
        weight = decay * noise_weight
        noise_var = (weight * noise_var + sample) / (weight + 1.0)
        noise_weight = weight + 1.0
        total_var = max(noise_var, self.min_noise_sd**2) + sampling_var + param_var
        # Update step (Sherman-Morrison form of the Bayesian update).
        gain = [c / total_var for c in cov_phi]
        weights = [w + g * residual for w, g in zip(weights, gain, strict=True)]
        cov = [cov[3 * i + j] - gain[i] * cov_phi[j] for i in range(3) for j in range(3)]
        # Load-blind level, for "is latency above its usual value at all?".
        alpha = max(1.0 - decay, 1.0 / (n + 1))
        delta = log_y - level_mean
        level_mean += alpha * delta
        level_var = (1.0 - alpha) * (level_var + alpha * delta * delta)
        self._set_numbers(2, [*weights, *cov, noise_var, noise_weight, level_mean, level_var, float(n + 1)])

    def predict_one(self, x: dict[Hashable, Any]) -> Prediction:
        phi = self._phi(x)
        state = self.numbers
        noise_var, _, level_mean, level_var = state[14:18]
        sampling_var = float(x.get("sampling_var", 0.0))
        floor = self.min_noise_sd**2
        sd = math.sqrt(max(noise_var, floor) + sampling_var + _dot(phi, _matvec(state[5:14], phi)))
        level_sd = math.sqrt(max(level_var, floor) + sampling_var)
        return Prediction(_dot(phi, state[2:5]), sd, level_mean, level_sd)

    @property
    def warm(self) -> bool:
        return self.n_learned >= self.grace_windows

    def score_one(self, x: dict[Hashable, Any], y: base.typing.Target) -> float:
        """Surprise of latency ``y`` at demand ``x`` (0 while the model is in its grace period)."""
        y = float(y)
        if not self.warm or not (y > 0 and math.isfinite(y)):
            return 0.0
        prediction = self.predict_one(x)
        return upper_tail_surprise(self._sign * (math.log(y) - prediction.mean) / prediction.sd)

    @property
    def _sign(self) -> float:
        return 1.0 if self._params.tail == "upper" else -1.0

    def level_score(self, x: dict[Hashable, Any], y: float) -> float:
        """Surprise of ``y`` against the load-blind level: is latency high at all?"""
        return self.judge(x, y)[2]

    def judge(self, x: dict[Hashable, Any], y: float) -> tuple[Prediction, float, float]:
        """The prediction at ``x``, and both surprises of ``y`` (``score_one``, ``level_score``)
        from one prediction: what a detector asks of every window."""
        prediction = self.predict_one(x)
        if not self.warm or not (y > 0 and math.isfinite(y)):
            return prediction, 0.0, 0.0
        log_y, sign = math.log(y), self._sign
        conditioned = upper_tail_surprise(sign * (log_y - prediction.mean) / prediction.sd)
        return prediction, conditioned, upper_tail_surprise(sign * (log_y - prediction.level) / prediction.level_sd)

    def borrow(self, other: LoadConditionedLatency) -> None:
        """Cold start: take a warm model's response to load (reference demand, slopes, noise)
        while keeping this model's own level, learned from its first window.

        Meant for a new segment of a model whose other segments are known: latency is
        conditioned on the model's load, so its demand reference and elasticities carry
        over; the level (a long-prompt band is slower than a short one) does not. The
        model is then warm after one more window of its own instead of ``grace_windows``.
        """
        if self.n_learned != 1 or not other.warm:
            return
        mine, theirs = self.numbers, other.numbers
        mine[0:2] = theirs[0:2]  # reference demand
        mine[3:5] = theirs[3:5]  # slopes
        for i in (1, 2):  # their slopes' (co)variances, and none with our level
            for j in (1, 2):
                mine[5 + 3 * i + j] = theirs[5 + 3 * i + j]
            mine[5 + 3 * i] = mine[5 + i] = 0.0
        mine[14] = theirs[14]  # noise variance
        mine[_STATE_SIZE] = max(self.n_learned, self.grace_windows - 1)
        self._set_numbers(0, mine)

    def adopt(self, x: dict[Hashable, Any], y: float) -> None:
        """A lasting change was accepted as the new normal: re-level so that the prediction
        at demand ``x`` is ``y`` (the slopes are kept), and be unsure of the level again."""
        if not (y > 0 and math.isfinite(y)) or self.n_learned == 0:
            return
        log_y = math.log(y)
        state = self.numbers
        state[2] += log_y - _dot(self._phi(x), state[2:5])
        state[5] = max(state[5], 0.1)  # level variance
        state[16] = log_y  # load-blind level
        self._set_numbers(0, state)

    # -- compact state (no pickled river objects) ------------------------------------
    def state(self) -> dict[str, Any]:
        s = self.numbers
        return {
            "n_learned": self.n_learned,
            "reference": s[0:2],
            "weights": s[2:5],
            "cov": [s[5:8], s[8:11], s[11:14]],
            "noise": s[14:16],
            "level": s[16:18],
        }

    def load_state(self, state: dict[str, Any]) -> None:
        values = [
            *state["reference"], *state["weights"], *(v for row in state["cov"] for v in row), *state["noise"],
            *state["level"],
        ]  # fmt: skip
        if len(values) != _STATE_SIZE:
            raise ValueError(f"latency model state has {len(values)} numbers, expected {_STATE_SIZE}")
        self._set_numbers(0, [*map(float, values), float(int(state["n_learned"]))])
