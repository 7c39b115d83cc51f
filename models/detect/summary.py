"""The one sentence a person reads first about a judged window (an event's ``summary``)."""

from __future__ import annotations

import math

from servewatch.models.detect.signal_detector import Verdict
from servewatch.models.detect.signals import Reading, SignalSpec
from servewatch.models.explain.wording import with_unit
from servewatch.schemas.anomaly import Hint


def window_summary(
    spec: SignalSpec,
    who: str,
    observed: str,
    expected: str,
    reading: Reading,
    verdict: Verdict,
    load: dict[str, float],
    demand_ratio: float,
    hints: list[Hint],
) -> str:
    demand = f"demand {demand_ratio:.1f}x usual" if math.isfinite(demand_ratio) else "demand as usual"
    why = f"; {hints[0].message}" if hints else ""
    who = who[:1].upper() + who[1:]  # the sentence a person reads first
    if spec.kind == "rate":
        return f"{who} is {observed} ({reading.bad:,} of {reading.n:,} requests) against a usual {expected}{why}."
    if spec.kind == "share":
        return f"{who} is {observed} against a usual {expected} over {reading.n:,} requests{why}."
    if verdict.explained:
        return (
            f"{who} is {observed} against a usual {with_unit(verdict.usual, spec.unit)}, in line with load: "
            f"{demand} ({load['requests_per_s']:.1f} req/s); explained by load, not paging."
        )
    return (
        f"{who} is {observed} against {expected} expected at this load "
        f"({load['requests_per_s']:.1f} req/s, {demand}); not explained by load{why}."
    )
