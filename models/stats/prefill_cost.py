"""A model's prefill time as a fixed cost per request plus a cost per uncached prompt token.

An engine spends some time on every prefill whatever its length (scheduling, one forward
pass at least), then time per token the prefix cache did not serve. Read as seconds per
uncached token, an interval of short or mostly cached prompts therefore looks slow: at
500 uncached tokens a request, a fixed cost worth 170 tokens reads 1.34x. From scrapes an
engine's interval holds a handful of requests, so one engine served the short ones for a
minute reads as a slow replica while its peers served long ones.

``PrefillCost`` fits ``prefill = a + b * uncached`` over the model's recent intervals (their
mean prefill and mean uncached tokens per request, each weighed by its requests, older ones
fading with ``halflife`` intervals), and gives the fixed cost in tokens' worth (``a / b``):
``prefill / (uncached + overhead_tokens)`` is then the same for short and long prompts. The
fit is of seconds per token on the inverse of the tokens (``prefill / uncached = b + a /
uncached``, least squares): prefill times jitter in proportion to their length, so their
own least squares would be led by the few longest prompts, while per token the noise is
alike at every length. A slower engine scales both parts alike, so its ratio to its peers
is kept. Until ``min_intervals`` were seen, or while the fit says nothing sensible (no spread
of lengths, a slope that is not positive), the overhead is 0: plain seconds per token.

>>> import numpy as np
>>> rng = np.random.default_rng(3)
>>> cost = PrefillCost()
>>> for _ in range(200):
...     n = 5
...     uncached = rng.lognormal(7.5, 1.0, n)
...     prefill = 0.02 + 1.2e-4 * uncached * rng.lognormal(0.0, 0.1, n)
...     cost.learn(float(uncached.mean()), float(prefill.mean()), n)
>>> 140 < cost.overhead_tokens < 190  # 0.02 s at 1.2e-4 s a token: 167 tokens
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: The spread of intervals' inverse lengths (as a squared coefficient of variation) below
#: which they are taken as alike: rounding in the fading sums is far below it.
MIN_RELATIVE_VARIANCE = 1e-6


@dataclass
class PrefillCost:
    """Least squares of mean prefill seconds per uncached token on the inverse of the mean
    uncached tokens per request, over intervals weighed by their requests and faded by
    ``halflife`` intervals."""

    halflife: float = 300.0
    min_intervals: int = 30
    #: Weighted sums of x = 1 / tokens and y = seconds per token: weights, x, y, x squared, x times y.
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)
    intervals: int = 0

    def learn(self, uncached: float, prefill_s: float, requests: float) -> None:
        if uncached < 1.0 or requests <= 0 or not prefill_s > 0:
            return
        fade = 0.5 ** (1.0 / self.halflife)
        x, y, w = 1.0 / uncached, prefill_s / uncached, requests
        for i, value in enumerate((w, w * x, w * y, w * x * x, w * x * y)):
            self.sums[i] = self.sums[i] * fade + value
        self.intervals += 1

    @property
    def overhead_tokens(self) -> float:
        """The fixed cost per request in uncached tokens' worth; 0 until the fit is known."""
        w, sx, sy, sxx, sxy = self.sums
        if self.intervals < self.min_intervals or w <= 0:
            return 0.0
        mean_x, mean_y = sx / w, sy / w
        var_x, cov = sxx / w - mean_x**2, sxy / w - mean_x * mean_y
        if var_x <= MIN_RELATIVE_VARIANCE * mean_x**2 or cov <= 0:
            return 0.0  # lengths alike (or rounding): nothing to tell a fixed cost from
        fixed = cov / var_x  # seconds per request
        per_token = mean_y - fixed * mean_x
        if not (math.isfinite(fixed) and per_token > 0):
            return 0.0
        # Never more than the usual request's own tokens: beyond that the fit is the noise.
        return min(fixed / per_token, 1.0 / mean_x)

    def state(self) -> list[float]:
        return [*(round(s, 9) for s in self.sums), float(self.intervals)]

    @classmethod
    def from_state(cls, saved: list[float]) -> PrefillCost:
        *sums, intervals = map(float, saved)
        if len(sums) != 5:
            raise ValueError("a prefill cost is five sums and a count")
        return cls(sums=list(sums), intervals=int(intervals))
