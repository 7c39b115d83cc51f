"""Rates of bad outcomes (truncations, leaks, errors): count-aware, and sequential.

A window's ``k`` bad requests out of ``n`` are judged two ways, and the window's surprise is
the larger (less ``log10(2)`` for looking twice):

* **alone**, against a beta-binomial predictive: the segment's usual rate is a Beta belief
  (discounted pseudo-counts of the windows learned), and the window is ``n`` draws at a rate
  drawn from it. Exact for small windows: 1 bad in 3 is weak evidence, 30 in 1,000 strong.
* **with the windows before it**, by a CUSUM of the log-likelihood ratio of a raised rate
  against the usual one (Page's test; the raised rate is estimated from the windows since
  the CUSUM last stood at 0, before the current one, as Lorden and Pollak's adaptive CUSUM
  does). A 5 % error rate in segments of 20 requests gives 1 bad request a window: no
  window alone can page against a 0.2 % baseline, a few together can. Under the usual
  rate the CUSUM exceeds ``h`` nats with probability at most ``e^-h``, so ``h / ln 10`` is
  a surprise on the same scale as every other signal's.

Overdispersion is learned, not assumed: real rates wander from window to window more than a
binomial allows, by an intra-class correlation ``icc`` estimated from the segment's normal
windows (Pearson's statistic): a window's rate is drawn from a Beta no stronger than
``1 / icc - 1``, and each window's log-likelihood ratio is divided by its variance inflation
``1 + (n - 1) icc``. The CUSUM weighs against the usual rate one standard error high, so a
usual rate learned a little low does not add up to a page.

Inside an incident nothing is learned, and the incident lasts until the evidence favours the
usual rate over the incident's own (a second CUSUM, the other way round), not merely until
a few windows with 0 or 1 bad requests, which a 5 % rate over 20 requests often gives.

The usual rate is no surer than the requests seen allow. It is a Beta of two parts: the
segment's own windows (discounted, as above) and a prior that is never discounted, at the
rate of the segment's model (``borrow``: the model's segments pooled) or, before the model
has one, at ``prior_rate``. The prior holds at least half a bad request (Jeffreys' Beta(1/2,
1/2) in the count of bad ones), so a segment that has served thousands of requests without
one keeps a usual rate of about half a bad request over the requests it has seen, never ~0:
a Beta whose bad pseudo-count is near 0 puts nearly all its weight on a rate of 0, and then
one bad request looks like thousands of times the usual. ``impact`` says how many bad
requests the evidence rests on, and how many a minute beyond the usual rate: the detector
pages on a handful, not on one (``models.detect.signal_detector``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, NamedTuple

from river import base

from servewatch.models.stats.compact import CompactState, count, number
from servewatch.models.stats.params import param, shared
from servewatch.models.stats.tails import TWO_LOOKS

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


def log_likelihood_ratio(k: int, n: int, p1: float, p0: float) -> float:
    """``log`` of how much likelier ``k`` bad out of ``n`` is at rate ``p1`` than at ``p0``.

    >>> round(log_likelihood_ratio(1, 20, 0.05, 0.002), 2)     # one error in 20: 25x likelier
    2.28
    """
    return k * math.log(p1 / p0) + (n - k) * math.log((1.0 - p1) / (1.0 - p0))


class Looks(NamedTuple):
    """A rate window's surprises (``BetaBinomialRate.looks``)."""

    alone: float
    together: float
    sustained: bool  # the evidence spans windows: no single one counts for more than half


class Impact(NamedTuple):
    """What a rate's evidence rests on (``BetaBinomialRate.impact``)."""

    bad: int  # bad requests in the windows the evidence spans
    excess_share: float  # their share of those windows' requests, less the usual rate
    per_minute: float  # bad requests a minute beyond the usual rate, at the window's traffic


#: The least bad pseudo-count a prior holds: Jeffreys' prior for a rate, Beta(1/2, 1/2), in
#: the count of bad requests. Below it a Beta piles its weight on a rate of 0.
JEFFREYS_BAD = 0.5
#: Seconds a window spans when its reading does not say (``x["seconds"]``).
WINDOW_S = 10.0


def prior_counts(rate: float, least: float, most: float) -> tuple[float, float]:
    """(bad, good) pseudo-counts of a prior at ``rate``: worth as few requests as still hold
    ``JEFFREYS_BAD`` bad ones, but ``least`` at least and ``most`` at most. Capped, it holds
    half a bad request all the same (its mean is then above ``rate``: the safe side).

    >>> prior_counts(0.05, 20.0, 200.0)          # half a bad request in 10: 20 at least
    (1.0, 19.0)
    >>> prior_counts(0.005, 20.0, 200.0)         # half a bad request in 100
    (0.5, 99.5)
    >>> prior_counts(0.0001, 20.0, 200.0)        # 5,000 would be needed: 200, with half of one
    (0.5, 199.98)
    """
    strength = min(max(JEFFREYS_BAD / rate, least), most)
    return max(rate * strength, JEFFREYS_BAD), (1.0 - rate) * strength


class _RateParams(NamedTuple):
    prior_rate: float
    prior_strength: float
    max_prior_strength: float
    halflife: float
    max_strength: float
    grace_windows: int
    min_ratio: float
    prior_ratio: float
    prior_weight: float
    recovery: float


#: Where a rate's own and its prior's counts sit in its state (``expected_rate`` reads them at once).
_ALPHA, _BETA, _PRIOR_ALPHA, _PRIOR_BETA = 0, 1, 8, 9


class BetaBinomialRate(CompactState, base.SupervisedAnomalyDetector):
    """Share of requests with a bad outcome. ``x["trials"]`` is the window's requests (the
    denominator), ``y`` the bad ones among them.

    ``learn_one`` teaches the usual rate (windows that are normal, outside incidents);
    ``score_one`` is a window's surprise, alone and with the windows before it; ``step``
    moves the sequential evidence on by one judged window, whatever its verdict.

    Parameters
    ----------
    prior_rate
        The rate a new segment is assumed to have until its model's is known (``borrow``).
        The prior stays, undiscounted, beside the segment's own windows.
    prior_strength
        The fewest requests a prior is worth. It is worth more where half a bad request at
        its rate takes more (``JEFFREYS_BAD``), up to ``max_prior_strength``.
    max_prior_strength
        Cap on the requests a prior is worth: the model's rate is a guess about this
        segment, and segments of one model differ (answers of 1,000 tokens and more hit the
        length limit far more often than the model's average), so the segment's own windows
        must outweigh it within a minute or two at a few requests a second. Capped, it still
        holds half a bad request: its mean is then above the model's rate, the safe side.
    halflife
        Windows over which old windows' counts (and the overdispersion) lose half their weight.
    max_strength
        Cap on the pseudo-requests behind the usual rate's estimate (a window's own rate
        wanders more: see ``icc``).
    grace_windows
        Windows learned before ``score_one`` says anything but 0.
    min_ratio
        The raised rate the CUSUM looks for is at least this multiple of the usual one.
    prior_ratio, prior_weight
        The raised rate it starts from (a multiple of the usual), and how many requests that
        guess is worth against the windows since the CUSUM last stood at 0.
    recovery
        Surprise (log10) with which the evidence must favour the usual rate over the
        incident's before an incident's windows count as normal again.

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
    0.001
    >>> # One bad request in 20 per window, window after window (5 %): no window alone says
    >>> # much against 0.1 %, a few together do.
    >>> scores = []
    >>> for _ in range(5):
    ...     scores.append(round(model.score_one({"trials": 20}, 1), 1))
    ...     model.step({"trials": 20}, 1)
    >>> scores
    [1.4, 1.4, 2.5, 3.7, 4.9]
    """

    # Learned state: ten doubles, alone or in a segment's buffer (``models.stats.compact``);
    # constructor arguments shared (``models.stats.params``).
    __slots__ = ()
    STATE_SIZE = 10
    alpha = number(_ALPHA)  # the segment's own windows' bad and good requests (discounted)
    beta = number(_BETA)
    n_learned = count(2)
    icc = number(3)  # intra-class correlation of the bad outcomes within a window (overdispersion)
    cusum = number(4)  # nats of evidence for a raised rate, over the windows since it stood at 0
    run_bad = number(5)  # bad outcomes and requests of those windows: the raised rate's estimate
    run_trials = number(6)
    recovery_evidence = number(7)  # inside an incident: nats of evidence for the usual rate
    prior_alpha = number(_PRIOR_ALPHA)  # the prior's bad and good pseudo-requests (never discounted)
    prior_beta = number(_PRIOR_BETA)
    prior_rate = param("prior_rate")
    prior_strength = param("prior_strength")
    max_prior_strength = param("max_prior_strength")
    halflife = param("halflife")
    max_strength = param("max_strength")
    grace_windows = param("grace_windows")
    min_ratio = param("min_ratio")
    prior_ratio = param("prior_ratio")
    prior_weight = param("prior_weight")
    recovery = param("recovery")

    def __init__(
        self,
        prior_rate: float = 0.005,
        prior_strength: float = 20.0,
        max_prior_strength: float = 200.0,
        halflife: float = 360.0,
        max_strength: float = 100_000.0,
        grace_windows: int = 6,
        min_ratio: float = 2.0,
        prior_ratio: float = 4.0,
        prior_weight: float = 50.0,
        recovery: float = 4.0,
    ) -> None:
        if not 0.0 < prior_rate < 1.0:
            raise ValueError("prior_rate must be in (0, 1)")
        if min_ratio <= 1.0 or prior_ratio < min_ratio:
            raise ValueError("need 1 < min_ratio <= prior_ratio: the CUSUM looks for a raised rate")
        if prior_strength <= 0.0 or max_prior_strength < prior_strength:
            raise ValueError("need 0 < prior_strength <= max_prior_strength")
        self._params = shared(
            _RateParams, prior_rate, prior_strength, max_prior_strength, halflife, max_strength, grace_windows,
            min_ratio, prior_ratio, prior_weight, recovery,
        )  # fmt: skip
        self._own([0.0] * 8 + list(prior_counts(prior_rate, prior_strength, max_prior_strength)))

    @property
    def expected_rate(self) -> float:
        """The usual rate: the segment's own windows and the prior, together."""
        # Read from the buffer at once (``alpha``, ``beta``, ``prior_alpha``, ``prior_beta``):
        # asked several times per judged window, four property reads cost more than the sum.
        buf, at = self._buf, self._at
        alpha, beta = buf[at + _ALPHA], buf[at + _BETA]
        prior_alpha, prior_beta = buf[at + _PRIOR_ALPHA], buf[at + _PRIOR_BETA]
        return (alpha + prior_alpha) / (alpha + beta + prior_alpha + prior_beta)

    @property
    def strength(self) -> float:
        """Requests behind the usual rate: the own windows' (discounted) and the prior's."""
        buf, at = self._buf, self._at
        return buf[at + _ALPHA] + buf[at + _BETA] + buf[at + _PRIOR_ALPHA] + buf[at + _PRIOR_BETA]

    def _hypotheses(self, n: int) -> tuple[float, float]:
        """The usual rate and the raised one the CUSUM weighs a window of ``n`` between.

        The usual rate is taken one standard error above its estimate, so that a usual rate
        learned a little low does not add up to a page (the requests behind the estimate
        count for less where windows of ``n`` wander: overdispersion). The raised rate is
        what the windows since the CUSUM last stood at 0 showed, with ``prior_weight``
        requests' worth of ``prior_ratio`` times the usual."""
        p, strength = self.expected_rate, self.strength / self._inflation(n)
        usual = min(p + math.sqrt(p * (1.0 - p) / (strength + 1.0)), 0.5)
        guess = (self.run_bad + self.prior_ratio * usual * self.prior_weight) / (self.run_trials + self.prior_weight)
        return usual, min(max(guess, self.min_ratio * usual), 0.5 + 0.5 * usual)

    def _evidence(self, n: int, k: int) -> tuple[float, float, float]:
        """(usual, raised, nats a window of ``k`` bad out of ``n`` adds for the raised rate)."""
        usual, raised = self._hypotheses(n)
        return usual, raised, log_likelihood_ratio(k, n, raised, usual) / self._inflation(n)

    @property
    def recovered(self) -> bool:
        """Inside an incident: whether the evidence now favours the usual rate (by ``recovery``)."""
        return self.recovery_evidence >= self.recovery * _LN10

    def _inflation(self, n: int) -> float:
        return 1.0 + max(n - 1, 0) * self.icc

    def borrow(self, rate: float, strength: float) -> None:
        """Take the prior from another baseline (the model's segments pooled) known from
        ``strength`` requests. It is worth as few requests as still hold half a bad request
        at ``rate`` (the model's rate is a guess about this segment), at least
        ``prior_strength``, and no more than the lender knows nor ``max_prior_strength``.
        The segment's own windows are kept: the prior sits beside them, so borrowing again
        (the model's rate moved) changes the usual rate only as much as the prior weighs.

        >>> young = BetaBinomialRate()
        >>> young.borrow(0.01, 50_000.0)         # a model that fails 1 request in 100
        >>> young.prior_alpha, young.prior_beta, round(young.expected_rate, 4)
        (0.5, 49.5, 0.01)
        >>> young.borrow(0.0005, 50_000.0)       # 1 in 2,000: capped, and on the safe side
        >>> young.prior_alpha, round(young.prior_beta, 1), round(young.expected_rate, 4)
        (0.5, 199.9, 0.0025)
        """
        if 0.0 < rate < 1.0:
            most = min(strength, self.max_prior_strength)
            self.prior_alpha, self.prior_beta = prior_counts(rate, self.prior_strength, most)

    def learn_one(self, x: dict[Hashable, Any], y: base.typing.Target) -> None:
        n, k = int(x["trials"]), int(y)
        if n <= 0:
            return
        p = self.expected_rate
        decay = 0.5 ** (1.0 / self.halflife)
        if n > 1 and self.n_learned >= self.grace_windows:
            # Pearson's statistic: 1 on average for binomial windows, 1 + (n - 1) icc beyond.
            pearson = (k - n * p) ** 2 / (n * p * (1.0 - p))
            sample = min(max((pearson - 1.0) / (n - 1), -1.0), 1.0)
            self.icc = max(self.icc + (sample - self.icc) * (1.0 - decay), 0.0)
        alpha, beta = decay * self.alpha + k, decay * self.beta + (n - k)
        strength = alpha + beta
        if strength > self.max_strength:
            alpha, beta = alpha * self.max_strength / strength, beta * self.max_strength / strength
        self.alpha, self.beta = alpha, beta
        self.n_learned += 1

    def _window_belief(self) -> tuple[float, float]:
        """The Beta a window's rate is drawn from: the usual rate, as sure as the windows
        learned make it, but no surer than the rate's own wander from window to window."""
        strength = self.strength
        if self.icc > 0:
            strength = min(strength, max(1.0 / self.icc - 1.0, 10.0))
        p = self.expected_rate
        return p * strength, (1.0 - p) * strength

    def score_one(self, x: dict[Hashable, Any], y: base.typing.Target) -> float:
        """Surprise (-log10 of the upper-tail probability) of ``y`` bad out of ``x["trials"]``:
        the window alone, or with the windows before it (the CUSUM after this one)."""
        looks = self.looks(x, y)
        return max(looks.alone, looks.together)

    def looks(self, x: dict[Hashable, Any], y: base.typing.Target, threshold: float = math.inf) -> Looks:
        """The window's surprise alone and with the windows before it, each less what looking
        twice costs (0 while the model is young), and whether the windows up to this one reach
        ``threshold`` with none counting for more than half of it: evidence that spans
        windows, which one wild window cannot give."""
        n, k = int(x["trials"]), int(y)
        if self.n_learned < self.grace_windows or n <= 0:
            return Looks(0.0, 0.0, False)
        alone = beta_binomial_surprise(k, n, *self._window_belief())
        llr = self._evidence(n, k)[2]
        together = max(self.cusum + llr, 0.0) / _LN10 - TWO_LOOKS
        spread = self.cusum + min(llr, threshold * _LN10 / 2.0)
        return Looks(max(alone - TWO_LOOKS, 0.0), max(together, 0.0), spread / _LN10 - TWO_LOOKS >= threshold)

    def step(self, x: dict[Hashable, Any], y: base.typing.Target, *, incident: bool = False) -> None:
        """Move the sequential evidence on by one judged window. Inside an ``incident`` it
        also weighs the usual rate against the incident's own, for ``recovered``."""
        if self.n_learned < self.grace_windows:
            return
        n, k = int(x["trials"]), int(y)
        if n <= 0:
            return
        usual, raised, llr = self._evidence(n, k)
        if incident:
            favour = log_likelihood_ratio(k, n, usual, raised) / self._inflation(n)
            self.recovery_evidence = max(self.recovery_evidence + favour, 0.0)
        cusum = max(self.cusum + llr, 0.0)
        if cusum <= 0.0:
            self._set_numbers(4, [0.0, 0.0, 0.0])
        else:
            self._set_numbers(4, [cusum, self.run_bad + k, self.run_trials + n])

    def impact(self, x: dict[Hashable, Any], y: base.typing.Target) -> Impact:
        """What the evidence rests on once ``step`` has taken this window: the windows since
        the CUSUM last stood at 0 (this one among them), or this window alone when the CUSUM
        stands at 0. Per minute is the evidence's share beyond the usual rate at this
        window's traffic (``x["seconds"]`` long): the users it hurts, not one window's luck.

        >>> model = BetaBinomialRate(grace_windows=0)
        >>> for _ in range(10):
        ...     model.learn_one({"trials": 1000}, 1)
        >>> for bad in (3, 4):
        ...     model.step({"trials": 100, "seconds": 10.0}, bad)
        >>> bad, share, per_minute = model.impact({"trials": 100, "seconds": 10.0}, 4)
        >>> bad, round(share, 3), round(per_minute, 1)        # 7 in 200 against 0.1 %, 600 a minute
        (7, 0.034, 20.4)
        """
        n, k = int(x["trials"]), int(y)
        bad, trials = (int(self.run_bad), self.run_trials) if self.cusum > 0.0 else (k, n)
        if trials <= 0:
            return Impact(bad, 0.0, 0.0)
        excess = max(bad / trials - self.expected_rate, 0.0)
        return Impact(bad, excess, excess * n * 60.0 / float(x.get("seconds", WINDOW_S)))

    def incident_over(self) -> None:
        """The incident resolved: its evidence goes with it (the next one starts afresh)."""
        if self.recovery_evidence > 0.0:
            self._set_numbers(4, [0.0, 0.0, 0.0, 0.0])

    def adopt(self, rate: float) -> None:
        """A lasting change was accepted as the new normal: restart the belief at ``rate``."""
        rate = min(max(rate, 1e-6), 1 - 1e-6)
        strength = min(self.alpha + self.beta, self.max_strength / 10)
        self.alpha, self.beta = rate * strength, (1.0 - rate) * strength
        self._set_numbers(4, [0.0, 0.0, 0.0, 0.0])

    def state(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha, "beta": self.beta, "n_learned": self.n_learned, "icc": self.icc,
            "cusum": [self.cusum, self.run_bad, self.run_trials, self.recovery_evidence],
            "prior": [self.prior_alpha, self.prior_beta],
        }  # fmt: skip

    def load_state(self, state: dict[str, Any]) -> None:
        learned = [float(state["alpha"]), float(state["beta"]), float(int(state["n_learned"]))]
        sequential = [float(v) for v in state.get("cusum", [0.0] * 4)]
        # A state from before the prior was kept apart has it inside alpha and beta, discounted
        # with the windows: it takes the generic prior beside them (the bank borrows the
        # model's at the next window).
        generic = prior_counts(self.prior_rate, self.prior_strength, self.max_prior_strength)
        prior = [float(v) for v in state.get("prior", generic)]
        self._set_numbers(0, [*learned, float(state.get("icc", 0.0)), *sequential, *prior])
