"""A ``ChangeReport`` as a text table (``servewatch compare``, ``servewatch changes``, the demo)."""

from __future__ import annotations

from datetime import UTC, datetime

from servewatch.models.compare.rollback import describe_change
from servewatch.schemas.change_report import ChangeReport, Period, SignalChange

#: How each signal's values read in the table: a unit suffix and a scale.
_UNITS = {"tokens_per_s_p50": (" tok/s", 1.0, 1)}


def _when(stamp: float | None) -> str:
    return "-" if stamp is None else datetime.fromtimestamp(stamp, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _value(row: SignalChange, value: float | None) -> str:
    if value is None:
        return "-"
    if row.kind == "points":
        return f"{100 * value:.2f} %"
    unit, scale, digits = _UNITS.get(row.signal, (" s", 1.0, 3))
    return f"{value * scale:.{digits}f}{unit}"


def render(report: ChangeReport) -> str:
    """A model's report as a table: signal, before, after, change with its CI, verdict."""
    b, a = report.before, report.after
    head = (
        f"model {report.model}: before {_when(b.first)} .. {_when(b.last)} ({b.requests:,} requests), "
        f"after {_when(a.first)} .. {_when(a.last)} ({a.requests:,} requests); {report.segments} segments, "
        f"{report.confidence:.0%} CI{'s holding together over its signals' if report.simultaneous else ''} from "
        f"{report.resamples} resamples, mix of the period before"
    )
    if report.change:
        head = f"change {report.change} ('{report.description}'), {'final' if report.final else 'interim'}: {head}"
    rows = [("signal", "before", "after", "change [CI]", "verdict", "segments (coverage)")]
    for row in report.signals:
        coverage = f"{row.segments_used} ({row.coverage_before:.0%} / {row.coverage_after:.0%})"
        change = describe_change(row.kind, row.change, row.ci_low, row.ci_high, missing="-")
        rows.append((row.signal, _value(row, row.before), _value(row, row.after), change, row.verdict, coverage))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.extend(notes(report))
    return "\n".join([head, *lines])


def notes(report: ChangeReport) -> list[str]:
    """The lines under a report's table: the traffic it held fixed, and why each inconclusive
    verdict is one (signals with the same reason share a line).

    >>> from servewatch.schemas.change_report import TrafficMix
    >>> report = ChangeReport(model="m", before=Period(requests=1), after=Period(requests=1), segments=1,
    ...     confidence=0.95, resamples=10, min_requests=1, signals=[],
    ...     traffic=TrafficMix(rate_before=4.6, rate_after=2.7, eligible_before=0.62, eligible_after=0.45))
    >>> notes(report)
    ['traffic held fixed: 4.6 req/s before, 2.7 after; cache-eligible 62 % before, 45 % after']
    """
    traffic = report.traffic
    if traffic is None:
        warning = load_warning(report)
        return [warning] if warning else []
    said = f"traffic held fixed: {_rate(traffic.rate_before)} req/s before, {_rate(traffic.rate_after)} after"
    if traffic.eligible_before is not None or traffic.eligible_after is not None:
        said += f"; cache-eligible {_share(traffic.eligible_before)} before, {_share(traffic.eligible_after)} after"
    reasons: dict[str, list[str]] = {}
    for row in report.signals:
        if row.verdict == "inconclusive" and row.reason:
            reasons.setdefault(row.reason, []).append(row.signal)
    return [said, *(f"inconclusive ({', '.join(signals)}): {reason}" for reason, signals in reasons.items())]


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


#: Request rates this far apart (either way) make the latency verdicts partly the load's.
LOAD_RATIO = 1.5


def request_rate(period: Period) -> float | None:
    """Requests per second over a period (None for an empty or instantaneous one)."""
    if period.first is None or period.last is None or period.last <= period.first:
        return None
    return period.requests / (period.last - period.first)


def load_warning(report: ChangeReport) -> str | None:
    """A line saying the two periods ran at different request rates, when they did: for a
    report that did not hold the traffic fixed (``traffic`` is None), whose latency verdicts
    then include the load's effect.

    >>> report = ChangeReport(model="m", before=Period(first=0.0, last=100.0, requests=100),
    ...     after=Period(first=200.0, last=300.0, requests=300), segments=1, confidence=0.95,
    ...     resamples=10, min_requests=1, signals=[])
    >>> load_warning(report)
    'load differs: 1.0 req/s before, 3.0 after (x3.0); latency verdicts include its effect'
    """
    before, after = request_rate(report.before), request_rate(report.after)
    if not before or not after:
        return None
    ratio = after / before
    if 1 / LOAD_RATIO <= ratio <= LOAD_RATIO:
        return None
    return (
        f"load differs: {before:.1f} req/s before, {after:.1f} after (x{ratio:.1f}); "
        "latency verdicts include its effect"
    )
