"""Rollback conditions: declared limits a change must not cross, checked on the same mix.

A condition names a signal of the change report (``ttft_p95``, ``error_share``...), how much
worse it may not get (``worse_by``: a fraction for latencies and throughput, percentage
points for shares) and where: on the model as a whole, or on *any* segment (route and prompt
band) with at least ``min_requests`` requests on both sides. It holds only when the estimate
crossed the limit *and* the confidence interval excludes no change, so noise does not roll
back a good change. Over many segments one of them crosses by chance now and then, so the
segment scope's intervals are widened together (Bonferroni over the segments tested). A
comparison the traffic makes inconclusive (``report``) never rolls back: the condition is
then "not judged", and a firing one stays firing until a comparison says it no longer holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from servewatch.models.compare.report import ChangeVerifier
from servewatch.models.compare.signals import SIGNALS, SignalSpec, default_segment_of, extractors
from servewatch.schemas.change_report import RollbackCheck, SignalChange

Row = Mapping[str, Any]


@dataclass(frozen=True)
class RollbackCondition:
    """``signal`` worse by more than ``worse_by`` (ratio signals: 0.2 is +20 %; shares: points)
    on ``scope`` ("model" or "segment": any segment), counting segments (or the model) with at
    least ``min_requests`` requests on both sides.

    >>> RollbackCondition("ttft_p95", 0.2, scope="segment", min_requests=200).text
    'ttft_p95 +20 % on any segment with at least 200 requests'
    >>> RollbackCondition("error_share", 0.1).text
    'error_share +0.1 pt on the model with at least 200 requests'
    """

    signal: str
    worse_by: float
    scope: Literal["model", "segment"] = "model"
    min_requests: int = 200

    def __post_init__(self) -> None:
        if self.signal not in {spec.name for spec in SIGNALS}:
            raise ValueError(f"unknown signal {self.signal!r}; one of {', '.join(s.name for s in SIGNALS)}")
        if not self.worse_by > 0:
            raise ValueError(f"worse_by must be positive, got {self.worse_by}")

    @property
    def spec(self) -> SignalSpec:
        return next(spec for spec in SIGNALS if spec.name == self.signal)

    @property
    def text(self) -> str:
        spec = self.spec
        sign = "+" if spec.lower_is_better else "-"
        amount = f"{self.worse_by:g} pt" if spec.points else f"{100 * self.worse_by:g} %"
        where = "any segment" if self.scope == "segment" else "the model"
        return f"{self.signal} {sign}{amount} on {where} with at least {self.min_requests} requests"

    def crossed(self, row: SignalChange) -> bool:
        """Whether a report row crossed this limit, its interval excluding no change (never on an
        inconclusive row: the traffic, not the change, may have moved it)."""
        if row.verdict == "inconclusive" or row.change is None or row.ci_low is None or row.ci_high is None:
            return False
        spec = self.spec
        if spec.points:
            worse, bound, none, limit = (row.change, row.ci_low, 0.0, self.worse_by)
            if not spec.lower_is_better:
                worse, bound = -row.change, -row.ci_high
        else:
            worse, bound, none, limit = (row.change - 1.0, row.ci_low, 1.0, self.worse_by)
            if not spec.lower_is_better:
                worse, bound, none = 1.0 - row.change, 2.0 - row.ci_high, 1.0
        return worse >= limit and bound > none


def check(
    condition: RollbackCondition,
    before: Sequence[Row],
    after: Sequence[Row],
    verifier: ChangeVerifier | None = None,
    model: str = "model",
) -> RollbackCheck:
    """Evaluate ``condition`` on one model's rows of both periods; the worst crossing is named."""
    verifier = replace(verifier or ChangeVerifier(), signals=(condition.spec,), simultaneous=False)
    before, after = verifier.labelled(before, after)  # the load is the model's, whatever the scope
    if condition.scope == "model":
        scopes = {model: (list(before), list(after))}
    else:
        scopes = _by_segment(before, after, verifier)
    tested = {key: rows for key, rows in scopes.items() if min(map(len, rows)) >= condition.min_requests}
    if not tested:
        return RollbackCheck(condition=condition.text, holds=False, detail=_too_few(condition, scopes))
    confidence = 1.0 - (1.0 - verifier.confidence) / len(tested)
    verifier = replace(verifier, confidence=confidence, min_requests=min(verifier.min_requests,
                                                                          condition.min_requests))  # fmt: skip
    rng = np.random.default_rng(verifier.seed)
    rows = {key: verifier.report(model, b, a, rng=rng).signals for key, (b, a) in tested.items()}
    found = [(key, signals[0]) for key, signals in rows.items() if signals and condition.crossed(signals[0])]
    of = f"{len(tested)} {'segment' if condition.scope == 'segment' else 'scope'}{'s' * (len(tested) != 1)}"
    if not found:
        unjudged = [(key, s[0]) for key, s in rows.items() if s and s[0].verdict == "inconclusive" and s[0].reason]
        if unjudged:
            key, row = unjudged[0]
            where = "" if key == model else f" on {key}"
            detail = f"not judged: inconclusive on {len(unjudged)} of {of}; {row.reason}{where}"
            return RollbackCheck(condition=condition.text, holds=False, detail=detail)
        return RollbackCheck(condition=condition.text, holds=False,
                             detail=f"not crossed on any of {of} tested ({confidence:.1%} intervals)")  # fmt: skip
    worst_key, worst = max(found, key=lambda item: _badness(condition.spec, item[1]))
    return RollbackCheck(
        condition=condition.text,
        holds=True,
        where=worst_key,
        change=worst.change,
        ci_low=worst.ci_low,
        ci_high=worst.ci_high,
        detail=f"crossed on {len(found)} of {of} tested ({confidence:.1%} intervals); worst: {worst_key}, "
        f"{describe_change(worst.kind, worst.change, worst.ci_low, worst.ci_high)}",
    )


def describe_change(
    kind: str, change: float | None, low: float | None, high: float | None, missing: str = "no estimate"
) -> str:
    """A change with its interval, as every report and hint words it (``kind``: ratio or points).

    >>> describe_change("ratio", 1.342, 1.21, 1.489), describe_change("points", 1.2, 0.8, 1.6)
    ('+34.2 % [+21.0, +48.9]', '+1.20 pt [+0.80, +1.60]')
    """
    if change is None or low is None or high is None:
        return missing
    if kind == "points":
        return f"{change:+.2f} pt [{low:+.2f}, {high:+.2f}]"

    def pct(ratio: float) -> str:
        return f"{100 * (ratio - 1):+.1f}" if math.isfinite(ratio) else "?"

    return f"{pct(change)} % [{pct(low)}, {pct(high)}]"


def evidence(condition: RollbackCondition, after: Sequence[Row], where: str | None, count: int = 5) -> list[Row]:
    """Up to ``count`` requests of the period after that show the condition's signal at its
    worst, in the segment where it held: the bad finishes of a share, the slowest (or, for
    throughput, the slowest-streaming) requests of a latency."""
    spec = condition.spec
    key_of = default_segment_of()
    rows = [row for row in after if where in (None, "model") or key_of(row) == where]
    column = extractors()[spec.numerator]
    values = np.array([column(row) for row in rows], dtype=float)
    if spec.points and spec.denominator is None:
        return [row for row, value in zip(rows, values, strict=True) if value == 1.0][:count]
    finite = np.flatnonzero(np.isfinite(values))
    order = finite[np.argsort(values[finite], kind="stable")]
    return [rows[i] for i in (order[::-1] if spec.lower_is_better else order)[:count]]


def _by_segment(
    before: Sequence[Row], after: Sequence[Row], verifier: ChangeVerifier
) -> dict[str, tuple[list[Row], list[Row]]]:
    key_of = verifier.segment_of or default_segment_of()
    out: dict[str, tuple[list[Row], list[Row]]] = {}
    for which, rows in enumerate((before, after)):
        for row in rows:
            out.setdefault(key_of(row), ([], []))[which].append(row)
    return out


def _too_few(condition: RollbackCondition, scopes: Mapping[str, tuple[list[Row], list[Row]]]) -> str:
    most = max((min(len(b), len(a)) for b, a in scopes.values()), default=0)
    return f"not tested: no scope has {condition.min_requests} requests on both sides yet (at most {most})"


def _badness(spec: SignalSpec, row: SignalChange) -> float:
    change = row.change if row.change is not None else 0.0
    return change if spec.lower_is_better else -change
