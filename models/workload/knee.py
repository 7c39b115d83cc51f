"""Where latency bends: the capacity a concurrency ramp finds.

``servewatch loadgen --ramp`` holds each concurrency level for a while (a closed loop: each
of ``c`` clients sends its next request when the last one ends) and summarises the step.
Below a server's capacity, more concurrency buys throughput at flat latency; past it,
requests queue and TTFT climbs while throughput stalls. The knee is the highest level
before p95 TTFT (or p50 inter-token latency, for servers that batch everything at once and
slow every stream instead of queueing) rises more than ``factor`` times above the lowest
level's: the concurrency the latency models can count on.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: A step bends when p95 TTFT or p50 ITL exceeds this multiple of the first step's.
KNEE_FACTOR = 2.0
#: Concurrency levels a ramp tries unless told otherwise.
DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class StepSummary:
    """One concurrency level: what it delivered and how fast (seconds; None without data)."""

    concurrency: int
    requests: int
    errors: int
    seconds: float
    output_tokens_per_s: float
    ttft_p50: float | None
    ttft_p95: float | None
    itl_p50: float | None


def summarise_step(
    concurrency: int,
    seconds: float,
    ttfts: Sequence[float] | np.ndarray,
    itls: Sequence[float] | np.ndarray,
    output_tokens: int,
    errors: int = 0,
) -> StepSummary:
    """A step's summary from its successful requests' TTFTs and every inter-token gap.

    >>> s = summarise_step(4, 2.0, [0.1, 0.1, 0.3, 0.3], [0.01] * 50, output_tokens=400, errors=1)
    >>> s.output_tokens_per_s, s.ttft_p50, s.itl_p50, s.requests
    (200.0, 0.2, 0.01, 5)
    """

    def q(values: Sequence[float] | np.ndarray, level: float) -> float | None:
        return float(np.quantile(values, level)) if len(values) else None

    return StepSummary(
        concurrency=concurrency,
        requests=len(ttfts) + errors,
        errors=errors,
        seconds=seconds,
        output_tokens_per_s=output_tokens / seconds if seconds > 0 else 0.0,
        ttft_p50=q(ttfts, 0.5),
        ttft_p95=q(ttfts, 0.95),
        itl_p50=q(itls, 0.5),
    )


def _bent(step: StepSummary, base: StepSummary, factor: float) -> bool:
    pairs = ((step.ttft_p95, base.ttft_p95), (step.itl_p50, base.itl_p50))
    if step.requests and step.errors == step.requests:
        return True  # nothing got through: well past any knee
    return any(now is not None and low is not None and now > factor * low for now, low in pairs)


def find_knee(steps: Sequence[StepSummary], factor: float = KNEE_FACTOR) -> int | None:
    """The highest concurrency before the first step that bends (``None``: no step bent, the
    knee is beyond the levels tried; or the first step itself failed).

    >>> def step(c, ttft, itl=0.02):
    ...     return StepSummary(c, 100, 0, 10.0, 100.0 * c, ttft, ttft, itl)
    >>> find_knee([step(1, 0.05), step(2, 0.05), step(4, 0.06), step(8, 0.2), step(16, 0.5)])
    4
    >>> find_knee([step(1, 0.05), step(2, 0.05), step(4, 0.05, itl=0.05)])  # streams slowed instead
    2
    >>> find_knee([step(1, 0.05), step(2, 0.06)]) is None
    True
    """
    ordered = sorted(steps, key=lambda s: s.concurrency)
    if not ordered or (ordered[0].requests and ordered[0].errors == ordered[0].requests):
        return None
    for previous, step in itertools.pairwise(ordered):
        if _bent(step, ordered[0], factor):
            return previous.concurrency
    return None
