"""A ``ChangeReport`` as a text table (``servewatch compare``, ``servewatch changes``, the demo)."""

from __future__ import annotations

import math
from datetime import UTC, datetime

from servewatch.schemas.change_report import ChangeReport, SignalChange

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


def _change(row: SignalChange) -> str:
    if row.change is None or row.ci_low is None or row.ci_high is None:
        return "-"
    if row.kind == "points":
        return f"{row.change:+.2f} pt [{row.ci_low:+.2f}, {row.ci_high:+.2f}]"

    def pct(ratio: float) -> str:
        return f"{100 * (ratio - 1):+.1f}" if math.isfinite(ratio) else "?"

    return f"{pct(row.change)} % [{pct(row.ci_low)}, {pct(row.ci_high)}]"


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
        rows.append((row.signal, _value(row, row.before), _value(row, row.after), _change(row), row.verdict, coverage))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([head, *lines])
