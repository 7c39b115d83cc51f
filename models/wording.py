"""How events read: the segment, the values and one sentence a person reads first."""

from __future__ import annotations

import hashlib
import math

from models.signal_detector import Verdict
from models.signals import Reading, SignalSpec
from schemas.anomaly import Hint


def segment_phrase(labels: dict[str, str]) -> str:
    rest = [
        f"{name.replace('_band', '')} {value}" for name, value in labels.items() if name != "model" and value != "-"
    ]
    return f"model {labels.get('model', 'other')}" + (f" ({', '.join(rest)})" if rest else "")


def event_id(fp: str, status: str, window_start: float) -> str:
    return hashlib.blake2b(f"{fp}|{status}|{window_start:.3f}".encode(), digest_size=12).hexdigest()


def describe(value: float, unit: str) -> str:
    if unit == "":  # a share: enough digits that a small usual rate is not shown as 0
        return f"{value:.3%}" if 0 < value < 0.001 else f"{value:.2%}"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
    return f"{value:,.1f} {unit}"


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
            f"{who} is {observed} against a usual {describe(verdict.usual, spec.unit)}, in line with load: "
            f"{demand} ({load['requests_per_s']:.1f} req/s); explained by load, not paging."
        )
    return (
        f"{who} is {observed} against {expected} expected at this load "
        f"({load['requests_per_s']:.1f} req/s, {demand}); not explained by load{why}."
    )
