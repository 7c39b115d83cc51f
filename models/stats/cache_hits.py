"""The prefix-cache hit rate, judged as a share and request by request.

A window's hit rate (cached prompt tokens over prompt tokens) is a noisy share: a few long
prompts with or without a hit swing it, so a collapse takes a window or two of evidence
(``ShareLevel``). The requests themselves say more. One that reuses a prompt prefix the
worker has seen before (its ``prefix_hash``) and still gets no cached token is a miss the
cache should not make; a working cache makes few of them (evictions, an instance that has
not seen the prefix), a disabled one makes nothing else. So the model also keeps a Beta
belief of the share of such misses, and judges a window's ``k`` misses out of ``n`` reusing
requests against it (beta-binomial, as ``models.stats.rates``): 17 misses out of 23 against a
usual 1 % is decisive in the first window the fault touches, where the hit rate has only
begun to move.

The window's score is the larger of the two looks, less ``log10(2)`` for having looked
twice (as ``models.stats.latency`` does), so that two looks cost no calibration.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

from river import base

from servewatch.models.stats.compact import number
from servewatch.models.stats.params import param, shared
from servewatch.models.stats.rates import beta_binomial_surprise
from servewatch.models.stats.share import ShareLevel
from servewatch.models.stats.tails import TWO_LOOKS


class _CacheParams(NamedTuple):
    tail: str
    halflife: float
    min_spread: float
    grace_windows: int
    reuse_halflife: float
    max_strength: float
    prior_miss: float
    prior_strength: float


class CacheHitRate(ShareLevel):
    """The prefix-cache hit rate ``y`` over ``x["trials"]`` requests; where prefix hashes
    are logged, ``x["reused"]`` requests reused a prefix seen before and ``x["reused_missed"]``
    of them got no cached token.

    Parameters
    ----------
    halflife, min_spread, grace_windows
        As ``ShareLevel`` (the hit rate's level and wobble; a drop is anomalous).
    reuse_halflife
        Windows over which the belief about misses among reusing requests forgets.
    max_strength
        Cap on the pseudo-requests behind that belief: windows differ more than a fixed
        binomial allows (an instance restarts with an empty cache, a burst evicts).
    prior_miss, prior_strength
        The miss share a new segment starts from, and how many requests that is worth.

    Examples
    --------
    >>> import random
    >>> rng = random.Random(11)
    >>> model = CacheHitRate()
    >>> for _ in range(60):
    ...     reused = rng.randint(15, 30)
    ...     missed = sum(rng.random() < 0.02 for _ in range(reused))
    ...     model.learn_one({"trials": reused, "reused": reused, "reused_missed": missed}, rng.uniform(0.3, 0.5))
    >>> # The first window with the cache off: the hit rate has only halved, yet 17 of 23
    >>> # requests that reuse a known prefix got nothing from the cache.
    >>> model.score_one({"trials": 23, "reused": 23, "reused_missed": 17}, 0.2) > 8
    True
    >>> model.score_one({"trials": 23}, 0.2) < 4                   # the hit rate alone: not yet
    True
    >>> model.score_one({"trials": 23, "reused": 23, "reused_missed": 1}, 0.4) < 2   # an eviction
    True
    """

    # Learned state: ``ShareLevel``'s three doubles, then the discounted pseudo-counts of
    # reusing requests that missed and that hit.
    __slots__ = ()
    STATE_SIZE = 5
    missed = number(3)
    served = number(4)
    reuse_halflife = param("reuse_halflife")
    max_strength = param("max_strength")
    prior_miss = param("prior_miss")
    prior_strength = param("prior_strength")

    def __init__(
        self,
        halflife: float = 100.0,
        min_spread: float = 0.15,
        grace_windows: int = 6,
        reuse_halflife: float = 360.0,
        max_strength: float = 500.0,
        prior_miss: float = 0.2,
        prior_strength: float = 10.0,
    ) -> None:
        if not 0.0 < prior_miss < 1.0:
            raise ValueError("prior_miss must be in (0, 1)")
        if max_strength <= 0 or prior_strength <= 0:
            raise ValueError("strengths are counts of requests: positive")
        self._params = shared(
            _CacheParams, "lower", halflife, min_spread, grace_windows, reuse_halflife, max_strength, prior_miss,
            prior_strength,
        )  # fmt: skip
        self._own([0.0, min_spread**2, 0.0, prior_miss * prior_strength, (1.0 - prior_miss) * prior_strength])

    @property
    def expected_miss(self) -> float:
        """The usual share of reusing requests that get no cached token."""
        return self.missed / (self.missed + self.served)

    def learn_one(self, x: dict[Hashable, Any], y: base.typing.Target) -> None:
        super().learn_one(x, y)
        reused, missed = int(x.get("reused", 0)), int(x.get("reused_missed", 0))
        if reused <= 0:
            return
        decay, cap = 0.5 ** (1.0 / self.reuse_halflife), self.max_strength
        a, b = decay * self.missed + missed, decay * self.served + (reused - missed)
        if (strength := a + b) > cap:
            a, b = a * cap / strength, b * cap / strength
        self.missed, self.served = a, b

    def score_one(self, x: dict[Hashable, Any], y: base.typing.Target) -> float:
        """Surprise of hit rate ``y`` and, where logged, of the window's misses among reusing requests."""
        share = super().score_one(x, y)
        reused = int(x.get("reused", 0))
        if reused <= 0 or self.n_learned < self.grace_windows:
            return share
        misses = beta_binomial_surprise(int(x.get("reused_missed", 0)), reused, self.missed, self.served)
        return max(max(share, misses) - TWO_LOOKS, 0.0)

    def adopt(self, share: float) -> None:
        """A lasting change was accepted as the new normal: the misses restart from the prior."""
        super().adopt(share)
        self.missed, self.served = self.prior_miss * self.prior_strength, (1.0 - self.prior_miss) * self.prior_strength

    def state(self) -> dict[str, Any]:
        return {**super().state(), "missed": self.missed, "served": self.served}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self._set_numbers(3, [float(state["missed"]), float(state["served"])])
