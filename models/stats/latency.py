"""Load-conditioned latency: what should a window's latency be, given its demand?

The model is a small Bayesian linear regression (a Kalman filter whose level may drift)
of log latency on a demand index ``D``, the mean log ratio of two demand figures (e.g.
requests/s and prompt tokens/s that *arrived*) to the segment's reference demand::

    log(latency) = level + e * D + e_surge * max(0, D - log(surge_ratio)) + noise

Latency is flat in demand at low utilisation and rises steeply near capacity, so one
slope cannot serve both: the hinge term ``e_surge`` covers demand beyond ``surge_ratio``
times the usual. Queueing past capacity is not this model's business: a queue that builds
because demand exceeds what the model's engines have ever served is explained by the
capacity check (``models.stats.capacity``), and such windows are not learned here.

Real traffic broke an earlier, plain version of this model, and each part
here answers one way it broke:

* **physics as priors**: latency does not fall as demand rises, and no plausible
  elasticity is above ``max_elasticity`` (``max_surge_elasticity`` past the hinge). The
  slopes are projected into those bounds after every update; a segment's first
  ``grace_windows`` (often a start-up ramp) teach the level only; and the prediction never
  quotes less than the segment has shown at that demand or below (``_floor``);
* **robust noise**: a residual counts at most ``huber`` predictive sds in the update, so one
  wild window (a GC pause) cannot blind the model for an hour, and the noise is learned at
  about the usual demand only (a surge's residuals say more about the slopes);
* **heavy tails**: the predictive is a Student-t whose degrees of freedom follow how often
  the segment's residuals go beyond 3 sds in short runs (``models.stats.tails``): a segment with
  fat tails is judged with fat tails, a quiet one stays sensitive;
* **two windows**: each window is also judged with the one before (``pair_surprise``), so a
  sustained shift that one window under heavy tails cannot prove, two can;
* **the usual level**: at about the usual demand, a rise against the load-blind level
  pages too, where a past surge left the regression unsure;
* **drift**: a slow anchor follows the level with a half-life of ``anchor_halflife``
  windows; latency creeping up a little every window at flat demand (which the level
  follows, then stops following once windows surprise) shows as recent windows' distance
  above the anchored level, against how far that distance usually strays (``drift_var``).

Demand deliberately means arrivals (requests and tokens asking to be served), never
uncached tokens or concurrency: a disabled prefix cache multiplies uncached tokens, and
any slowdown raises concurrency (Little's law), so conditioning on them would explain
away the very faults servewatch exists to catch. The one exception is an engine's
inter-token latency, set by the batch it decodes, which its scrapes measure
(``models.detect.signals.ENGINE_DECODE_DEMAND`` says why that still shows a slowdown).

``score_one`` returns the *surprise*, ``-log10`` of the upper-tail probability of the
observation under the predictive distribution: 2 means 1 in 100, 4 means 1 in 10,000.
It does not saturate, and it means the same on every signal.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from river import base

from servewatch.models.stats.compact import CompactState, count
from servewatch.models.stats.params import param, shared
from servewatch.models.stats.tails import (
    NO_ECHO,
    PRIOR_TAIL_SHARE,
    TWO_LOOKS,
    clipped_square_mean,
    degrees_of_freedom,
    pair_surprise,
    student_surprise,
    tail_bound,
    tail_step,
    upper_tail_surprise,
)

__all__ = ["LoadConditionedLatency", "Prediction", "upper_tail_surprise"]

FEATURES: tuple[str, str] = ("requests_per_s", "prompt_tokens_per_s")

#: Edges of the demand bands (on the demand index ``D``) that keep their own floor.
FLOOR_EDGES = (-0.7, -0.2, 0.2, 0.7)
_NO_FLOOR = -1e9  # a band not seen yet (strict JSON has no infinities)
_BANDS = len(FLOOR_EDGES) + 1
#: Windows learned before residuals count towards the tail share: until the noise estimate
#: has settled, a residual beyond 3 sds says more about the estimate than about the tails.
TAIL_AFTER = 20
#: What the prior noise is worth, in windows: a young segment's first windows cannot make
#: it look quiet (or wild) on their own.
NOISE_PRIOR_WINDOWS = 10.0


@dataclass(frozen=True)
class Prediction:
    mean: float  # in log space, never below the segment's floor at this demand
    sd: float  # predictive standard deviation, log space
    level: float  # load-blind baseline (log space): what the segment usually shows
    level_sd: float
    nu: float = 1000.0  # degrees of freedom of the predictive (heavy tails: small)
    drift: float = 0.0  # how far (log space) the level has moved from its slow anchor
    drift_sd: float = math.inf  # how far the recent distance from the anchor usually strays
    recent: float = 0.0  # recent windows' distance above the anchored level (averaged over a few)

    @property
    def expected(self) -> float:
        """Expected latency in seconds (the median of the log-normal prediction)."""
        return math.exp(self.mean)

    @property
    def anchored(self) -> float:
        """Expected latency had the level stayed at its anchor (for a drift's message)."""
        return math.exp(self.mean - self.drift)


class Judgement(NamedTuple):
    prediction: Prediction
    conditioned: float  # surprise at this demand: max of the window's and the drift's
    level: float  # surprise against the load-blind level
    drifting: bool  # the drift, not the window alone, is what surprises
    #: Demand at or below the usual, engines not saturated: load explains no rise (latency does
    #: not fall as demand rises, so what is high at less than the usual demand is high).
    at_most_usual: bool = True
    #: Surprise of this window together with the one before (``pair_surprise``, less two looks):
    #: evidence that spans two windows, which one wild window cannot give.
    paired: float = 0.0
    #: Surprise of the less surprising of the two alone (less two looks): how far each of them
    #: goes on its own, so that a pair of one ordinary window and one wild one tells apart
    #: from two high ones.
    weaker: float = 0.0
    #: Surprise of this window alone at this demand, one look (no ``TWO_LOOKS``): the answer to
    #: the one question a window is asked when another signal has already named the cause.
    alone: float = 0.0


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
    max_elasticity: float
    max_surge_elasticity: float
    huber: float
    anchor_halflife: float
    drift_sd: float
    drift_after: int


# Layout of the learned numbers (offsets into the model's run of doubles).
_REF, _W, _COV = 0, 2, 5  # reference log demand (2), weights (3), covariance (3x3, row-major)
_NOISE, _NOISE_W, _LEVEL, _LEVEL_VAR = 14, 15, 16, 17  # noise variance and weight; load-blind level
# Tails: share of residuals beyond 3 sds, the run of such windows, the last window's residual
# (sds), the lag-one correlation of residuals, the echo of wild windows and the one seen in the
# current run (``models.stats.tails.tail_step``); then the slow anchor and the level's usual distance
# from it; then the floors.
_TAIL, _RUN, _LAST_Z, _RHO, _ECHO, _ECHO_PENDING, _ANCHOR, _DRIFT_VAR = 18, 19, 20, 21, 22, 23, 24, 25
_WITHIN, _RECENT, _FLOOR = 26, 27, 28  # usual spread within a window; recent distance from the anchor; floors
#: Weight of the latest window in the recent distance from the anchor (a few windows' memory).
_RECENT_WEIGHT = 0.2
_STATE_SIZE = _FLOOR + _BANDS  # the windows learned follow


def _recent_noise_share(rho: float) -> float:
    """Variance of the recent average of windows' standardised residuals: an exponential
    average of weight ``_RECENT_WEIGHT`` keeps this share of one window's noise, more when
    consecutive windows are correlated (``rho``)."""
    rho = min(max(rho, 0.0), 0.9)
    return _RECENT_WEIGHT / (2.0 - _RECENT_WEIGHT) * (1.0 + rho) / (1.0 - rho)


def _recent_after(recent: float, distance: float, level_distance: float, bound: float) -> float:
    """The recent average distance above the anchored level after one more window at
    ``distance``, taken at most ``bound`` beyond the level's own distance: one wild window
    (heavy tails) moves the average as far as an ordinary high one would, and only a run can
    move it far."""
    return recent + _RECENT_WEIGHT * (min(distance, level_distance + bound) - recent)


def _band(d: float) -> int:
    return bisect.bisect_right(FLOOR_EDGES, d)


@functools.cache
def _decay_per_window(halflife: float) -> float:
    """The weight a window's past keeps after one more (``0.5 ** (1 / halflife)``)."""
    return float(0.5 ** (1.0 / halflife))


class LoadConditionedLatency(CompactState, base.SupervisedAnomalyDetector):
    """Latency of a window given its demand; ``y`` is a latency in seconds (e.g. TTFT p95).

    ``x`` holds the window's two demand figures (``features``), and optionally
    ``sampling_var``: the variance (log space) that the observation owes to its finite sample
    (a mean of logs over ``n`` requests: their variance over ``n``). 8 requests are far noisier than 800;
    counting that keeps small segments quiet without hiding big ones.

    Parameters
    ----------
    elasticity
        Prior mean of d log(latency) / d log(demand) around the usual demand.
    surge_ratio
        Demand above this multiple of the usual is a surge, with its own slope.
    surge_elasticity
        Prior mean of the extra slope beyond ``surge_ratio``.
    elasticity_sd
        How unsure both slope priors are.
    level_drift_sd
        How far (log space, per window) the level may drift on its own.
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
        The two demand figures of ``x`` the index is built from.
    tail
        ``"upper"``: higher than predicted is anomalous (latency); ``"lower"``: lower is
        (throughput), and the slopes' signs are mirrored.
    max_elasticity, max_surge_elasticity
        Bounds on the slopes' size (their sign is fixed by ``tail``).
    huber
        A residual counts at most this many predictive sds in an update.
    anchor_halflife
        Windows over which the slow anchor follows the level (the drift check's memory).
    drift_sd
        Prior for how far (log space) the average of recent windows usually stands from what
        the anchored level predicts; learned from the segment's ordinary windows.
    drift_after
        Windows learned before the drift check speaks (0: no drift check, for a figure too
        spiky or too dependent on the request mix for a creeping level to mean anything).

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
    >>> model.score_one(flat, 8.0) > 4       # 10x TTFT at flat traffic: page
    True
    >>> surge = {"requests_per_s": 30.0, "prompt_tokens_per_s": 30_000.0}
    >>> model.score_one(surge, 2.4) < 2      # 3x TTFT at 3x traffic: explained by load
    True
    >>> model.predict_one({"requests_per_s": 1.0, "prompt_tokens_per_s": 1e3}).expected > 0.4  # never absurd
    True
    """

    __slots__ = ()
    #: Its tails are learned, so a window at the critical surprise is as rare as it says and
    #: fires its incident alone (``SignalDetector.judge``).
    tails_learned: ClassVar[bool] = True
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
    max_elasticity = param("max_elasticity")
    max_surge_elasticity = param("max_surge_elasticity")
    huber = param("huber")
    anchor_halflife = param("anchor_halflife")
    drift_sd = param("drift_sd")
    drift_after = param("drift_after")

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
        max_elasticity: float = 1.5,
        max_surge_elasticity: float = 3.0,
        huber: float = 3.0,
        anchor_halflife: float = 360.0,
        drift_sd: float = 0.07,
        drift_after: int = 360,
    ) -> None:
        if len(features) != 2:
            raise ValueError("features: exactly two demand figures")
        if tail not in ("upper", "lower"):
            raise ValueError("tail must be 'upper' (a rise is bad) or 'lower' (a drop is bad)")
        if max_elasticity < 0 or max_surge_elasticity < 0:
            raise ValueError("slope bounds are sizes: use tail to set the sign")
        self._params = shared(
            _Params,
            elasticity, surge_ratio, surge_elasticity, elasticity_sd, level_drift_sd, noise_sd, noise_halflife,
            grace_windows, min_noise_sd, tuple(features), tail, max_elasticity, max_surge_elasticity, huber,
            anchor_halflife, drift_sd, drift_after,
        )  # fmt: skip
        prior_var = elasticity_sd**2
        self._own(
            [
                0.0, 0.0,  # reference log demand: set over the grace windows
                0.0, elasticity, surge_elasticity,  # weights: level, slope, surge slope
                100.0, 0.0, 0.0, 0.0, prior_var, 0.0, 0.0, 0.0, prior_var,  # covariance
                noise_sd**2, NOISE_PRIOR_WINDOWS,  # noise variance, and the pseudo-windows behind that prior
                0.0, noise_sd**2,  # load-blind level: EW mean and variance of log latency
                PRIOR_TAIL_SHARE, 0.0, 0.0, 0.0,  # tails: share beyond 3 sds, run, last residual, correlation
                NO_ECHO, NO_ECHO,  # the echo of wild windows (none seen yet), and the current run's
                0.0, drift_sd**2,  # slow anchor of the level, and how far recent windows usually stand from it
                0.0,  # usual variance of log latency among a window's requests, as a log (0: not seen yet)
                0.0,  # recent windows' distance (log) above what the anchored level predicts
                *[_NO_FLOOR] * _BANDS,  # lowest (sign-adjusted) log value per demand band
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
        return self._demand_index(x, self.numbers)

    def _demand_index(self, x: dict[Hashable, Any], state: Sequence[float]) -> float:
        if state[_STATE_SIZE] == 0:
            return 0.0
        now = self._log_demand(x)
        return (now[0] - state[_REF] + now[1] - state[_REF + 1]) / 2

    def _phi(self, x: dict[Hashable, Any], state: Sequence[float] | None = None) -> tuple[float, float, float]:
        return self._phi_at(self._demand_index(x, self.numbers if state is None else state))

    def _phi_at(self, d: float) -> tuple[float, float, float]:
        """The regression's features at demand index ``d``: level, slope, and the surge beyond ``surge_ratio``."""
        return (1.0, d, max(0.0, d - math.log(self.surge_ratio)))

    @property
    def _decay(self) -> float:
        return _decay_per_window(self.noise_halflife)

    @property
    def _sign(self) -> float:
        return 1.0 if self._params.tail == "upper" else -1.0

    def _project(self, weights: list[float], phi: Sequence[float]) -> list[float]:
        """Slopes into their physical range; the level takes up the difference at ``phi``,
        so the prediction where the model just learned is unchanged."""
        sign, p = self._sign, self._params
        slope = sign * min(max(sign * weights[1], 0.0), p.max_elasticity)
        surge = sign * min(max(sign * weights[2], 0.0), p.max_surge_elasticity)
        level = weights[0] + (weights[1] - slope) * phi[1] + (weights[2] - surge) * phi[2]
        return [level, slope, surge]

    def _floor(self, state: Sequence[float], d: float) -> float:
        """The lowest (sign-adjusted) log value the segment has ever shown at demand ``d`` or
        below (latency does not fall as demand rises): an expectation below it is absurd.
        ``_NO_FLOOR`` until a band at or below ``d`` has been seen."""
        floors = [v for v in state[_FLOOR : _FLOOR + _band(d) + 1] if v > _NO_FLOOR]
        return min(floors) if floors else _NO_FLOOR

    # -- river API -----------------------------------------------------------------
    def learn_one(self, x: dict[Hashable, Any], y: base.typing.Target) -> None:
        y = float(y)
        if not (y > 0 and math.isfinite(y)):
            return
        log_y = math.log(y)
        state = self.numbers
        reference, weights, cov = state[_REF:_W], state[_W:_COV], state[_COV:_NOISE]
        noise_var, noise_weight, level_mean, level_var = state[_NOISE:_TAIL]
        tail_share, run, last_z, rho, echo, pending, anchor, drift_var, within, recent = state[_TAIL:_FLOOR]
        floors = state[_FLOOR:_STATE_SIZE]
        n = self.n_learned
        p = self._params
        grace = n < p.grace_windows
        if grace:
            # A segment's first windows are often a start-up ramp (demand and latency climbing
            # together), not its normal: the reference demand and the level follow the latest
            # of them (half-life of a window, the very first, usually partial, window aside),
            # the slopes keep their priors, and no noise is learned from the climb.
            now = self._log_demand(x)
            weight = 1.0 if n <= 1 else 0.5
            reference = [r + (d - r) * weight for r, d in zip(reference, now, strict=True)]
            self._set_numbers(_REF, reference)
            cov[0] += p.noise_sd**2
        if n == 0:
            weights[0] = level_mean = log_y
        phi = (1.0, 0.0, 0.0) if grace else self._phi(x, state)
        # At about the usual demand, engines not saturated: what the noise, the tails and the
        # load-blind level are learned from (``_ordinary``).
        usual_demand = self._ordinary(x, phi[1])
        sampling_var = self._sampling_var(x, within)
        if "within_var" in x:  # as a mean of logs: one window of a burst's spread does not set it
            rate = max(1.0 - self._decay, 1.0 / (n + 1))  # 1 for the first window
            within += (math.log(max(float(x["within_var"]), 1e-4)) - within) * rate
        # Predict step: the level may drift a little each window.
        cov[0] += p.level_drift_sd**2
        residual = log_y - _dot(phi, weights)
        cov_phi = _matvec(cov, phi)
        param_var = _dot(phi, cov_phi)
        total_var = max(noise_var, p.min_noise_sd**2) + sampling_var + param_var
        sd = math.sqrt(total_var)
        z = residual / sd
        level_distance = self._sign * (weights[0] - anchor)
        recent = _recent_after(recent, self._sign * residual + level_distance, level_distance, p.huber * sd)
        decay = self._decay
        if n >= TAIL_AFTER and usual_demand:
            tail_share, run, echo, pending = tail_step(tail_share, run, z, last_z, rho, n, echo, pending)
            # Lag-one correlation of ordinary residuals (each clipped: a wild one says little).
            clip = max(-3.0, min(3.0, z)) * max(-3.0, min(3.0, last_z))
            rho += (clip - rho) * (1.0 - decay)
        # Bounded influence: a wild window moves the model as far as a ``huber``-sd one would,
        # and the noise as far as a residual ``huber`` times the noise itself (not counting
        # what the model is unsure of: an unsettled level is not noise).
        clipped = max(-p.huber * sd, min(p.huber * sd, residual))
        # The noise is learned where it is judged most: at about the usual demand. A surge's
        # windows teach the slopes; their residuals, which an imperfect slope leaves, are not
        # the segment's noise, and would widen its judgement at the usual demand.
        if not grace and usual_demand:
            bound = p.huber**2 * (max(noise_var, p.min_noise_sd**2) + sampling_var)
            # Clipping shrinks residuals' mean square, the more so the heavier their tails:
            # divide by how much, for the tails the segment has shown, to estimate the variance.
            capped = min(residual * residual, bound) / clipped_square_mean(
                p.huber, degrees_of_freedom(round(tail_share, 4))
            )
            sample = max(capped - param_var - sampling_var, 0.0)
            weight = decay * noise_weight
            noise_var = (weight * noise_var + sample) / (weight + 1.0)
            noise_weight = weight + 1.0
        # Update step (Sherman-Morrison form of the Bayesian update).
        gain = [c / total_var for c in cov_phi]
        weights = self._project([w + g * clipped for w, g in zip(weights, gain, strict=True)], phi)
        cov = [cov[3 * i + j] - gain[i] * cov_phi[j] for i in range(3) for j in range(3)]
        # Load-blind level, for "is latency above its usual value at all?": learned at about
        # the usual demand only, so that a surge does not become what is usual.
        if usual_demand or grace:
            alpha = max(1.0 - decay, 1.0 / (n + 1))
            delta = log_y - level_mean
            level_mean += alpha * delta
            level_var = (1.0 - alpha) * (level_var + alpha * delta * delta)
        # The slow anchor starts once the level has settled. How far recent windows usually
        # stand from it is learned from ordinary windows only, and robustly: a drift in
        # progress must not widen what counts as usual.
        if n + 1 == p.grace_windows:
            anchor = weights[0]
        elif n + 1 > p.grace_windows:
            anchor += (weights[0] - anchor) * (1.0 - 0.5 ** (1.0 / p.anchor_halflife))
            noise = _recent_noise_share(rho) * total_var  # what the windows' own noise explains
            if usual_demand and recent * recent < 9.0 * (drift_var + noise):
                excess = max(recent * recent - noise, 0.0)
                drift_var += (excess - drift_var) * (1.0 - 0.5 ** (0.5 / p.anchor_halflife))
        if n + 1 >= p.grace_windows:
            band, low = _band(phi[1]), self._sign * log_y
            floors[band] = min(low, floors[band]) if floors[band] > _NO_FLOOR else low
        self._set_numbers(
            _W,
            [*weights, *cov, noise_var, noise_weight, level_mean, level_var, tail_share, run, z, rho, echo, pending,
             anchor, drift_var, within, recent, *floors, float(n + 1)],
        )  # fmt: skip

    def note_unlearned(
        self, x: dict[Hashable, Any], y: float, *, tails: bool = True, drift: bool = False, pairs: bool = True
    ) -> None:
        """A judged window the model does not learn (it was anomalous): remember its residual
        for the next window's pair, and, with ``tails`` (outside an incident: inside one the
        fault is not the noise), count it towards the tail share. Otherwise the windows that
        show a segment's heavy tails would never teach them. With ``drift`` (the window is
        unlearned because recent windows drift), it goes on into the recent distance from the
        anchor; a window anomalous on its own does not: a fault or a surge is not a drift,
        and must not leave one behind when it ends. Without ``pairs`` (load explained the
        window) the next window forms no pair with it (``pair_surprise``)."""
        if not self.warm or not (y > 0 and math.isfinite(y)):
            return
        state = self.numbers
        prediction = self._predict(x, state)
        z = (math.log(y) - prediction.mean) / prediction.sd
        share, run, last_z, rho, echo, pending = state[_TAIL:_ANCHOR]
        recent = state[_RECENT]
        if drift:
            now = self._sign * (math.log(y) - prediction.mean + prediction.drift)
            recent = _recent_after(recent, now, self._sign * prediction.drift, self.huber * prediction.sd)
        if tails and self.n_learned >= TAIL_AFTER and self._ordinary(x, self._demand_index(x, state)):
            share, run, echo, pending = tail_step(share, run, z, last_z, rho, self.n_learned, echo, pending)
        self._set_numbers(_TAIL, [share, run, z if pairs else 0.0, rho, echo, pending])
        self._set_numbers(_RECENT, [recent])

    def predict_one(self, x: dict[Hashable, Any]) -> Prediction:
        return self._predict(x, self.numbers)

    def _predict(self, x: dict[Hashable, Any], state: list[float]) -> Prediction:
        return self._predict_at(x, state, self._demand_index(x, state))

    def _predict_at(self, x: dict[Hashable, Any], state: list[float], d: float) -> Prediction:
        """``_predict`` at demand index ``d`` (``_demand_index(x, state)``, which the caller has)."""
        phi = self._phi_at(d)
        noise_var, _, level_mean, level_var = state[_NOISE:_TAIL]
        tail_share, _, _, rho, _, _, anchor, drift_var, within, recent = state[_TAIL:_FLOOR]
        sampling_var = self._sampling_var(x, within)
        floor = self.min_noise_sd**2
        sd = math.sqrt(max(noise_var, floor) + sampling_var + _dot(phi, _matvec(state[_COV:_NOISE], phi)))
        level_sd = math.sqrt(max(level_var, floor) + sampling_var)
        sign = self._sign
        mean = sign * max(sign * _dot(phi, state[_W:_COV]), self._floor(state, phi[1]))
        nu = degrees_of_freedom(round(tail_bound(tail_share, int(state[_STATE_SIZE])), 4))
        recent_sd = math.sqrt(drift_var + floor + _recent_noise_share(rho) * sd * sd)
        return Prediction(mean, sd, level_mean, level_sd, nu, state[_W] - anchor, recent_sd, recent)

    def _ordinary(self, x: dict[Hashable, Any], d: float) -> bool:
        """Whether a window's residual says something of the segment's noise: at about the
        usual demand, engines not saturated. Elsewhere it says more about the slopes, or the
        queue, than about how wild the segment's windows are."""
        return abs(d) < math.log(self.surge_ratio) and not x.get("saturated", 0.0)

    @staticmethod
    def _sampling_var(x: dict[Hashable, Any], within: float) -> float:
        """The variance the observation owes to its finite sample: ``sampling_var`` as given,
        or, where ``x`` gives ``n`` requests and their ``within_var`` (variance of log
        latency), the segment's usual within-window variance (a geometric mean over windows)
        over ``n``: a score test against the spread of normal windows. Meant for a figure
        whose spread within a window is narrow (prefill per token): a fault that slows a
        subset of requests widens that spread as it lifts the mean, and judged by its own
        spread it would hide itself."""
        if "within_var" not in x:
            return float(x.get("sampling_var", 0.0))
        spread = math.exp(within) if within != 0.0 else float(x["within_var"])
        return max(spread, 0.01) / max(float(x["n"]), 1.0)

    @property
    def warm(self) -> bool:
        return self.n_learned >= self.grace_windows

    def score_one(self, x: dict[Hashable, Any], y: base.typing.Target) -> float:
        """Surprise of latency ``y`` at demand ``x`` (0 while the model is in its grace period)."""
        return self.judge(x, float(y)).conditioned

    def level_score(self, x: dict[Hashable, Any], y: float) -> float:
        """Surprise of ``y`` against the load-blind level: is latency high at all?"""
        return self.judge(x, y).level

    def judge(self, x: dict[Hashable, Any], y: float) -> Judgement:
        """The prediction at ``x``, and both surprises of ``y`` (at this demand, with the
        previous window and the drift check; against the load-blind level) from one
        prediction: what a detector asks of every window."""
        state = self.numbers
        d = self._demand_index(x, state)
        prediction = self._predict_at(x, state, d)
        usual_demand = self._ordinary(x, d)
        at_most_usual = usual_demand or (d < 0 and not x.get("saturated", 0.0))
        n_learned, grace_windows = int(state[_STATE_SIZE]), self.grace_windows  # ``n_learned``, ``warm``
        if n_learned < grace_windows or not (y > 0 and math.isfinite(y)):
            return Judgement(prediction, 0.0, 0.0, False, at_most_usual)
        last_z, rho = state[_LAST_Z], state[_RHO]
        log_y, sign, nu = math.log(y), self._sign, prediction.nu
        z = sign * (log_y - prediction.mean) / prediction.sd
        alone = student_surprise(z, nu)
        echo = state[_ECHO]
        paired = pair_surprise(z, sign * last_z, rho, nu, echo) if n_learned > grace_windows else 0.0
        window = max(alone, paired) - TWO_LOOKS
        drift = 0.0
        if 0 < self.drift_after <= n_learned and usual_demand:  # a drift is judged at flat demand
            # How far recent windows, this one included, stand above the anchored level: the
            # latency itself, not the level (which stops following once windows surprise).
            now = sign * (log_y - prediction.mean + prediction.drift)
            recent = _recent_after(prediction.recent, now, sign * prediction.drift, self.huber * prediction.sd)
            drift = upper_tail_surprise(recent / prediction.drift_sd) if now > 0 else 0.0
        level_z = sign * (log_y - prediction.level) / prediction.level_sd
        if at_most_usual:
            # At the usual demand, the usual level is as good a prediction as the regression's,
            # and sharper where a past surge left the slopes unsure: a rise against it pages.
            # Below the usual demand it is a bound (latency does not fall as demand rises),
            # and still sharper where the slopes are unsure so far from the usual demand.
            window = max(window, student_surprise(level_z, nu) - TWO_LOOKS)
        # Against the usual level with Gaussian tails, this score only ever says "explained by
        # load" (an info event), never pages, so it may be as quick to speak as the level is sure.
        level = upper_tail_surprise(level_z)
        weaker = student_surprise(min(z, sign * last_z), nu) - TWO_LOOKS if paired > 0 else 0.0
        return Judgement(
            prediction, max(window, drift, 0.0), level, drift > window, at_most_usual,
            max(paired - TWO_LOOKS, 0.0), max(weaker, 0.0), alone,
        )  # fmt: skip

    def borrow(self, other: LoadConditionedLatency) -> None:
        """Cold start: take a warm model's response to load (reference demand, slopes, noise,
        tails) while keeping this model's own level, learned from its first window.

        Meant for a new segment of a model whose other segments are known: latency is
        conditioned on the model's load, so its demand reference and elasticities carry
        over; the level (a long-prompt band is slower than a short one) does not. The
        model is then warm after one more window of its own instead of ``grace_windows``.
        """
        if self.n_learned != 1 or not other.warm:
            return
        mine, theirs = self.numbers, other.numbers
        mine[_REF : _REF + 2] = theirs[_REF : _REF + 2]  # reference demand
        mine[_W + 1 : _COV] = theirs[_W + 1 : _COV]  # slopes
        for i in (1, 2):  # their slopes' (co)variances, and none with our level
            for j in (1, 2):
                mine[_COV + 3 * i + j] = theirs[_COV + 3 * i + j]
            mine[_COV + 3 * i] = mine[_COV + i] = 0.0
        mine[_NOISE] = theirs[_NOISE]  # noise variance
        mine[_TAIL] = theirs[_TAIL]
        mine[_RHO] = theirs[_RHO]
        mine[_ECHO] = theirs[_ECHO]
        mine[_ANCHOR] = mine[_W]
        mine[_STATE_SIZE] = max(self.n_learned, self.grace_windows - 1)
        self._set_numbers(0, mine)

    def adopt(self, x: dict[Hashable, Any], y: float) -> None:
        """A lasting change was accepted as the new normal: re-level so that the prediction
        at demand ``x`` is ``y`` (the slopes are kept), and be unsure of the level again.
        The anchor and the floors start again from there: the old normal is history."""
        if not (y > 0 and math.isfinite(y)) or self.n_learned == 0:
            return
        log_y = math.log(y)
        state = self.numbers
        state[_W] += log_y - _dot(self._phi(x), state[_W:_COV])
        state[_COV] = max(state[_COV], 0.1)  # level variance
        state[_LEVEL] = log_y
        state[_ANCHOR] = state[_W]
        state[_FLOOR:_STATE_SIZE] = [_NO_FLOOR] * (_STATE_SIZE - _FLOOR)
        self._set_numbers(0, state)

    # -- compact state (no pickled river objects) ------------------------------------
    def state(self) -> dict[str, Any]:
        s = self.numbers
        return {
            "n_learned": self.n_learned,
            "reference": s[_REF:_W],
            "weights": s[_W:_COV],
            "cov": [s[_COV : _COV + 3], s[_COV + 3 : _COV + 6], s[_COV + 6 : _NOISE]],
            "noise": s[_NOISE:_LEVEL],
            "level": s[_LEVEL:_TAIL],
            "tails": s[_TAIL:_ANCHOR],
            "anchor": s[_ANCHOR : _DRIFT_VAR + 1],
            "within": s[_WITHIN],
            "recent": s[_RECENT],
            "floor": [None if v <= _NO_FLOOR else v for v in s[_FLOOR:_STATE_SIZE]],
        }

    def load_state(self, state: dict[str, Any]) -> None:
        values = [
            *state["reference"], *state["weights"], *(v for row in state["cov"] for v in row), *state["noise"],
            *state["level"], *state["tails"], *state["anchor"], state["within"], state["recent"],
            *(_NO_FLOOR if v is None else v for v in state["floor"]),
        ]  # fmt: skip
        if len(values) != _STATE_SIZE:
            raise ValueError(f"latency model state has {len(values)} numbers, expected {_STATE_SIZE}")
        self._set_numbers(0, [*map(float, values), float(int(state["n_learned"]))])
