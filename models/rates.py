"""Rates of bad outcomes (truncations, leaks, errors): count-aware, so 1 in 3 is not 30 in 1,000.

A window's ``k`` bad requests out of ``n`` are judged against a beta-binomial predictive
distribution: the segment's usual rate is a Beta belief (discounted pseudo-counts of the
windows learned), and the window is ``n`` draws at a rate drawn from that belief. Its upper
tail probability is exact for small windows and knows that a high share of a handful of
requests is weak evidence, while a modest rise over thousands of requests is strong.

The Beta's strength is capped (``max_strength`` pseudo-requests): real rates wander from
window to window more than a fixed binomial allows, and an uncapped belief built from
millions of requests would page on every wobble. Windows judged anomalous are not learned.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, NamedTuple

from river import base

from models.compact import CompactState, count, number
from models.params import param, shared

_LN10 = math.log(10.0)


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def beta_binomial_surprise(k: int, n: int, alpha: float, beta: float, max_terms: int = 20_000) -> float:
    """``-log10 P(K >= k)`` for ``K ~ BetaBinomial(n, alpha, beta)``; 0 when ``k`` is not above the mean.

    Sums the upper tail in log space from ``k`` on; past the mode the terms fall at least
    geometrically, so a few hundred terms suffice even for large ``n``.

    >>> round(beta_binomial_surprise(1, 3, 1.0, 999.0), 2)     # 1 in 3 at a 0.1 % baseline
    2.52
    >>> beta_binomial_surprise(30, 1000, 2.0, 1998.0) > 10      # 30 in 1,000 at 0.1 %
    True
    """
    if n <= 0 or k <= 0 or k <= n * alpha / (alpha + beta):
        return 0.0
    k = min(k, n)
    const = math.lgamma(n + 1) - _log_beta(alpha, beta)

    def log_pmf(j: int) -> float:
        return const - math.lgamma(j + 1) - math.lgamma(n - j + 1) + _log_beta(j + alpha, n - j + beta)

    first = log_pmf(k)
    total = 1.0  # terms relative to the first
    for j in range(k + 1, min(n, k + max_terms) + 1):
        term = math.exp(log_pmf(j) - first)
        total += term
        if term < 1e-17 * total:
            break
    return max(-(first + math.log(total)) / _LN10, 0.0)


class _RateParams(NamedTuple):
    prior_rate: float
    prior_strength: float
    halflife: float
    max_strength: float
    grace_windows: int


class BetaBinomialRate(CompactState, base.SupervisedAnomalyDetector):
    """Share of requests with a bad outcome. ``x["trials"]`` is the window's requests (the
    denominator), ``y`` the bad ones among them.

    Parameters
    ----------
    prior_rate
        The rate a new segment is assumed to have until it has its own (the detector bank
        replaces it with the model-level rate when one is known).
    prior_strength
        How many requests that prior is worth.
    halflife
        Windows over which old windows' counts lose half their weight.
    max_strength
        Cap on the pseudo-requests behind the belief (window-to-window overdispersion).
    grace_windows
        Windows learned before ``score_one`` says anything but 0.

    Examples
    --------
    >>> import random
    >>> rng = random.Random(3)
    >>> model = BetaBinomialRate()
    >>> for _ in range(100):
    ...     n = rng.randint(800, 1200)
    ...     model.learn_one({"trials": n}, sum(rng.random() < 0.001 for _ in range(n)))
    >>> model.score_one({"trials": 3}, 1) < 4          # 1 in 3: not enough to page
    True
    >>> model.score_one({"trials": 1000}, 30) > 10     # 30 in 1,000 against 0.1 %: page
    True
    >>> round(model.expected_rate, 4)
    0.0007
    """

    # Learned state: three doubles, alone or in a segment's buffer (``models.compact``);
    # constructor arguments shared (``models.params``).
    __slots__ = ()
    STATE_SIZE = 3
    alpha = number(0)
    beta = number(1)
    n_learned = count(2)
    prior_rate = param("prior_rate")
    prior_strength = param("prior_strength")
    halflife = param("halflife")
    max_strength = param("max_strength")
    grace_windows = param("grace_windows")

    def __init__(
        self,
        prior_rate: float = 0.005,
        prior_strength: float = 20.0,
        halflife: float = 360.0,
        max_strength: float = 5_000.0,
        grace_windows: int = 6,
    ) -> None:
        if not 0.0 < prior_rate < 1.0:
            raise ValueError("prior_rate must be in (0, 1)")
        self._params = shared(_RateParams, prior_rate, prior_strength, halflife, max_strength, grace_windows)
        self._own([prior_rate * prior_strength, (1.0 - prior_rate) * prior_strength, 0.0])

    @property
    def expected_rate(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    def borrow(self, rate: float, strength: float) -> None:
        """Start from another baseline (the model-level rate) while this one is young."""
        if self.n_learned == 0 and 0.0 < rate < 1.0:
            self.alpha, self.beta = rate * strength, (1.0 - rate) * strength

    def learn_one(self, x: dict[Hashable, Any], y: base.typing.Target) -> None:
        n, k = int(x["trials"]), int(y)
        if n <= 0:
            return
        decay = 0.5 ** (1.0 / self.halflife)
        alpha, beta = decay * self.alpha + k, decay * self.beta + (n - k)
        strength = alpha + beta
        if strength > self.max_strength:
            alpha, beta = alpha * self.max_strength / strength, beta * self.max_strength / strength
        self.alpha, self.beta = alpha, beta
        self.n_learned += 1

    def score_one(self, x: dict[Hashable, Any], y: base.typing.Target) -> float:
        """Surprise (-log10 of the upper-tail probability) of ``y`` bad out of ``x["trials"]``."""
        if self.n_learned < self.grace_windows:
            return 0.0
        return beta_binomial_surprise(int(y), int(x["trials"]), self.alpha, self.beta)

    def adopt(self, rate: float) -> None:
        """A lasting change was accepted as the new normal: restart the belief at ``rate``."""
        rate = min(max(rate, 1e-6), 1 - 1e-6)
        strength = min(self.alpha + self.beta, self.max_strength / 10)
        self.alpha, self.beta = rate * strength, (1.0 - rate) * strength

    def state(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "beta": self.beta, "n_learned": self.n_learned}

    def load_state(self, state: dict[str, Any]) -> None:
        self._set_numbers(0, [float(state["alpha"]), float(state["beta"]), float(int(state["n_learned"]))])
