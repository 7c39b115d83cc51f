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
    warning = load_warning(report)
    if warning:
        lines.append(warning)
    return "\n".join([head, *lines])


#: Request rates this far apart (either way) make the latency verdicts partly the load's.
LOAD_RATIO = 1.5


def request_rate(period: Period) -> float | None:
    """Requests per second over a period (None for an empty or instantaneous one)."""
    if period.first is None or period.last is None or period.last <= period.first:
        return None
    return period.requests / (period.last - period.first)


def load_warning(report: ChangeReport) -> str | None:
    """A line saying the two periods ran at different request rates, when they did.

    The comparison holds the request *mix* fixed, not the load: at 3x the arrival rate a
    model queues more whatever changed, and a closed-loop load test at another concurrency
    shows the same. The reader is told rather than the latency verdicts silently trusted.

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
