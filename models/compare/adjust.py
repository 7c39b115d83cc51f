"""What the traffic left inside the strata could explain: a regression adjustment.

Strata hold the load and the prompt length fixed only to within a band (half an octave of
load, an octave of prompt). Near saturation latency moves steeply within a band, so a
quieter period after can still look faster, and a period after whose prompts sit higher in
their octave can look slower. The period before shows how the signal moves with both inside
its strata (least squares, each stratum centred on its own mean); the period after's
remaining difference in them, weighted to the before mix, times those slopes is the part of
the change the traffic explains. A verdict must hold on what is left (``report``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from servewatch.models.compare.mix import Mix


def _centred(stratum: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``values`` (rows x columns) less the mean of their stratum."""
    _, inverse, counts = np.unique(stratum, return_inverse=True, return_counts=True)
    sums = np.zeros((len(counts), values.shape[1]))
    np.add.at(sums, inverse, values)
    return values - (sums / counts[:, None])[inverse]


def _mix_mean(stratum: np.ndarray, x: np.ndarray, mix: Mix) -> np.ndarray:
    """The mean of ``x`` per used stratum, weighted by the before shares."""
    out = np.zeros(x.shape[1])
    for segment, share in zip(mix.used, mix.share, strict=True):
        rows = x[stratum == segment]
        if len(rows):
            out += share * rows.mean(axis=0)
    return out


def _slope(x: np.ndarray, y: np.ndarray, quantile: float | None) -> float:
    """How the statistic of ``y`` (a quantile, else the mean) moves per unit of ``x``, both
    centred within their strata: the statistic among the rows above their stratum's mean
    against the rows at or below it. A split rather than least squares because the tail is
    what moves most: near saturation a little more load stretches TTFT p95 far more than
    its mean."""
    high = x > 0
    if high.sum() < 2 or (~high).sum() < 2:
        return 0.0
    run = float(x[high].mean() - x[~high].mean())
    if run <= 0:
        return 0.0
    if quantile is None:
        rise = float(y[high].mean() - y[~high].mean())
    else:
        rise = float(np.quantile(y[high], quantile) - np.quantile(y[~high], quantile))
    return rise / run


@dataclass(frozen=True)
class TrafficEffect:
    """``slopes``: how the statistic moves per unit of each covariate within the strata of
    the period before; ``shift``: how much of the change the covariates' remaining
    difference between the periods explains at those slopes."""

    shift: float
    slopes: np.ndarray


def explained_shift(
    before: tuple[np.ndarray, np.ndarray, np.ndarray],
    after: tuple[np.ndarray, np.ndarray],
    mix: Mix,
    quantile: float | None = None,
) -> TrafficEffect:
    """The change in the statistic (``quantile`` of the response, else its mean) that the
    covariates' remaining difference explains.

    ``before`` is (stratum, covariates rows x k, response), ``after`` (stratum, covariates):
    the valid requests of each period. The slopes come from the period before alone (its
    pace is the usual one), within the strata ``mix`` uses, one covariate at a time.

    >>> rng = np.random.default_rng(1)
    >>> x = rng.uniform(0, 1, (400, 1)); y = 2.0 * x[:, 0] + rng.normal(0, 0.01, 400)
    >>> mix = Mix(np.array([0]), np.array([1.0]), 1.0, 1.0)
    >>> effect = explained_shift((np.zeros(400, int), x, y), (np.zeros(400, int), x + 0.1), mix)
    >>> round(effect.shift, 2), effect.slopes.round(1).tolist()
    (0.2, [2.0])
    """
    stratum_b, x_b, y_b = before
    stratum_a, x_a = after
    keep_b = np.isin(stratum_b, mix.used) & np.isfinite(x_b).all(axis=1) & np.isfinite(y_b)
    keep_a = np.isin(stratum_a, mix.used) & np.isfinite(x_a).all(axis=1)
    if not keep_b.any() or not keep_a.any():
        return TrafficEffect(0.0, np.zeros(x_b.shape[1]))
    xc = _centred(stratum_b[keep_b], x_b[keep_b])
    slopes = np.array([_slope(xc[:, k], y_b[keep_b], quantile) for k in range(x_b.shape[1])])
    difference = _mix_mean(stratum_a[keep_a], x_a[keep_a], mix) - _mix_mean(stratum_b[keep_b], x_b[keep_b], mix)
    return TrafficEffect(float(difference @ slopes), slopes)
