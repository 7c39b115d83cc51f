"""Inline SVG charts: a signal against its expected band, the load beneath, sparklines.

"Not explained by load" should be visible at a glance: the signal's line leaving its band
(shaded windows where it was anomalous or an incident was open) while the load panel
under it, on the same time axis, stays flat. Drawn on the server as plain SVG: no script,
no chart library, nothing fetched, and printable. Every text (titles, labels) is escaped.
Changes (deploys, config flips) are vertical lines across both, labelled on the signal's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape

from servewatch.schemas.series import SeriesPoint

WIDTH, LEFT, RIGHT = 760, 56, 64
SIGNAL_HEIGHT, LOAD_HEIGHT, TOP, BOTTOM = 236, 146, 26, 24  # the legend sits above the plot
#: Characters of a change's label on a chart (its tooltip has it all).
MARK_LABEL = 32
LOAD_LINES = (("requests_per_s", "requests/s", "load-requests", "left"),
              ("prompt_tokens_per_s", "prompt tokens/s", "load-prompt", "right"),
              ("output_tokens_per_s", "output tokens/s", "load-output", "right"))  # fmt: skip


def fmt(value: float) -> str:
    """A number short enough for an axis or a table cell: 3 significant digits, whole from 100.

    >>> fmt(0.5512), fmt(38000.0), fmt(2.5e9)
    ('0.551', '38,000', '2.50e+09')
    """
    if not math.isfinite(value):
        return "–"
    if value != 0 and (abs(value) >= 1e7 or abs(value) < 0.001):
        return f"{value:.2e}"
    if abs(value) >= 100:  # token counts and rates: whole numbers read better than 3.8e+04
        return f"{value:,.0f}"
    return f"{value:.3g}"


def clock(seconds: float, span: float = 0.0) -> str:
    stamp = datetime.fromtimestamp(seconds, UTC)
    return stamp.strftime("%m-%d %H:%M" if span > 86_400 else "%H:%M:%S" if span < 600 else "%H:%M")


@dataclass(frozen=True)
class Mark:
    """A change drawn on a chart: when (event time), a short label and a tooltip."""

    at: float
    label: str
    title: str


@dataclass(frozen=True)
class Axis:
    """Maps a value range onto pixels (y grows downwards)."""

    low: float
    high: float
    start: float
    end: float

    def __call__(self, value: float) -> float:
        span = self.high - self.low or 1.0
        return round(self.start + (value - self.low) / span * (self.end - self.start), 1)


def value_axis(values: Sequence[float], top: float, bottom: float) -> Axis:
    finite = [v for v in values if math.isfinite(v)]
    low, high = (min(0.0, *finite), max(finite)) if finite else (0.0, 1.0)
    high = high + 0.08 * (high - low) if high > low else high + 1.0
    return Axis(low, high, bottom, top)


def runs(points: Sequence[SeriesPoint], has: Callable[[SeriesPoint], bool]) -> list[list[SeriesPoint]]:
    """Consecutive points for which ``has`` holds; a gap of over 3 windows breaks a run."""
    out: list[list[SeriesPoint]] = []
    for point in points:
        if not has(point):
            out.append([])
            continue
        current = out[-1] if out else []
        width = point.window_end - point.window_start
        if not current or point.window_start - current[-1].window_end > 3 * width:
            out.append(current := [])
        current.append(point)
    return [run for run in out if run]


def mid(point: SeriesPoint) -> float:
    return (point.window_start + point.window_end) / 2


def polyline(xy: Sequence[tuple[float, float]], css: str) -> str:
    return f'<polyline class="{css}" points="{" ".join(f"{x},{y}" for x, y in xy)}"/>'


def frame(height: int, y: Axis, x: Axis, t0: float, t1: float, right: Axis | None = None) -> list[str]:
    """Axes, grid lines and tick labels."""
    parts = [f'<line class="axis" x1="{LEFT}" y1="{height - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{height - BOTTOM}"/>']
    for i in range(4):
        value = y.low + (y.high - y.low) * i / 3
        parts.append(f'<line class="grid" x1="{LEFT}" y1="{y(value)}" x2="{WIDTH - RIGHT}" y2="{y(value)}"/>')
        parts.append(f'<text class="tick" x="{LEFT - 4}" y="{y(value) + 4}" text-anchor="end">{fmt(value)}</text>')
        if right is not None:
            other = right.low + (right.high - right.low) * i / 3
            parts.append(f'<text class="tick" x="{WIDTH - RIGHT + 4}" y="{right(other) + 4}">{fmt(other)}</text>')
    for i in range(5):
        t = t0 + (t1 - t0) * i / 4
        parts.append(f'<text class="tick" x="{x(t)}" y="{height - 6}" text-anchor="middle">'
                     f"{escape(clock(t, t1 - t0))}</text>")  # fmt: skip
    return parts


def shade(x: Axis, start: float, end: float, height: int, css: str, title: str) -> str:
    left, right = max(x(start), LEFT), min(x(end), WIDTH - RIGHT)
    width = max(right - left, 2.0)
    return (f'<rect class="{css}" x="{left}" y="{TOP}" width="{width:.1f}" height="{height - TOP - BOTTOM}">'
            f"<title>{escape(title)}</title></rect>")  # fmt: skip


def marks_drawn(x: Axis, marks: Sequence[Mark], height: int, *, labelled: bool) -> list[str]:
    """A vertical line per change within the time axis, its label (staggered) beside it."""
    parts = []
    shown = sorted((m for m in marks if x.low <= m.at <= x.high), key=lambda m: m.at)
    for i, mark in enumerate(shown):
        at = x(mark.at)
        parts.append(f'<g class="change-mark"><title>{escape(mark.title)}</title>'
                     f'<line class="change-line" x1="{at}" y1="{TOP}" x2="{at}" y2="{height - BOTTOM}"/>')  # fmt: skip
        if labelled:
            text = mark.label if len(mark.label) <= MARK_LABEL else mark.label[: MARK_LABEL - 1] + "…"
            side, shift = ("end", -3) if at > WIDTH - RIGHT - 180 else ("start", 3)
            parts.append(f'<text class="change-label" x="{at + shift}" y="{TOP + 10 + 11 * (i % 3)}" '
                         f'text-anchor="{side}">{escape(text)}</text>')  # fmt: skip
        parts.append("</g>")
    return parts


def signal_chart(
    points: Sequence[SeriesPoint],
    signal: str,
    t0: float,
    t1: float,
    *,
    label: str,
    incident: tuple[float, float] | None = None,
    marks: Sequence[Mark] = (),
) -> str:
    """``signal`` of one segment over [t0, t1]: observed, expected, the band, anomalous windows, changes."""
    mine = [p for p in points if signal in p.signals and t0 <= mid(p) <= t1]
    # The axis follows what was seen and expected; the band may widen it to twice that, no
    # more: a young segment's band spans decades and would flatten every line to the floor.
    seen = [v for p in mine for v in (p.signals[signal].observed, p.signals[signal].expected) if math.isfinite(v)]
    cap = 2.0 * max(seen, default=1.0)
    bounds = [v for p in mine for v in (p.signals[signal].low, p.signals[signal].high) if v is not None]
    h = SIGNAL_HEIGHT
    x = Axis(t0, t1 if t1 > t0 else t0 + 1, LEFT, WIDTH - RIGHT)
    y = value_axis([*seen, *(min(v, cap) for v in bounds if math.isfinite(v))], TOP, h - BOTTOM)
    name = f"{signal} of {label}"
    parts = [
        f'<svg class="chart signal-chart" viewBox="0 0 {WIDTH} {h}" role="img" aria-label="{escape(name)}">'
        f"<title>{escape(name)}: observed, expected and normal band</title>"
    ]
    if incident is not None:
        parts.append(shade(x, *incident, h, "incident-window", f"incident of {name} from {clock(incident[0])}"))
    for run in runs(mine, lambda p: p.signals[signal].anomalous or p.signals[signal].firing):
        state = "anomalous" if any(p.signals[signal].anomalous for p in run) else "incident open"
        parts.append(shade(x, run[0].window_start, run[-1].window_end, h, "anomaly-window",
                           f"{name}: {state} {clock(run[0].window_start)}–{clock(run[-1].window_end)}"))  # fmt: skip
    banded = runs(mine, lambda p: p.signals[signal].low is not None or p.signals[signal].high is not None)
    for run in banded:  # a one-sided band reaches the plot's edge on its open side
        top = [(x(mid(p)), y(_within(_or(p.signals[signal].high, y.high), y))) for p in run]
        low = [(x(mid(p)), y(_within(_or(p.signals[signal].low, y.low), y))) for p in run]
        corners = " ".join(f"{a},{b}" for a, b in [*top, *reversed(low)])
        parts.append(f'<polygon class="band" points="{corners}"><title>normal band of {escape(name)}</title></polygon>')
    parts += frame(h, y, x, t0, t1)
    for run in runs(mine, lambda p: True):
        parts.append(polyline([(x(mid(p)), y(p.signals[signal].expected)) for p in run], "expected"))
        parts.append(polyline([(x(mid(p)), y(p.signals[signal].observed)) for p in run], "observed"))
    parts += marks_drawn(x, marks, h, labelled=True)
    if not mine:
        parts.append(f'<text class="empty" x="{WIDTH / 2}" y="{h / 2}" text-anchor="middle">no judged windows of '
                     "this segment in range yet</text>")  # fmt: skip
    parts.append(legend([("observed", "observed"), ("expected", "expected"), ("band", "normal band"),
                         ("anomaly-window", "anomalous / open")]))  # fmt: skip
    return "".join([*parts, "</svg>"])


def _within(value: float, axis: Axis) -> float:
    """``value`` clipped to the plot: a band wider than the axis runs along its edge."""
    return min(max(value, axis.low), axis.high) if math.isfinite(value) else axis.high


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def legend(items: Sequence[tuple[str, str]], y: int = 6) -> str:
    parts = []
    for i, (css, text) in enumerate(items):
        left = LEFT + i * 170
        parts.append(f'<rect class="{css} key" x="{left}" y="{y}" width="12" height="8"/>'
                     f'<text class="legend" x="{left + 16}" y="{y + 8}">{escape(text)}</text>')  # fmt: skip
    return "".join(parts)


def load_chart(
    points: Sequence[SeriesPoint],
    t0: float,
    t1: float,
    incident: tuple[float, float] | None = None,
    marks: Sequence[Mark] = (),
) -> str:
    """Requests/s (left axis) and prompt and output tokens/s (right axis), on the signal chart's time axis."""
    mine = [p for p in points if t0 <= mid(p) <= t1]
    h = LOAD_HEIGHT
    x = Axis(t0, t1 if t1 > t0 else t0 + 1, LEFT, WIDTH - RIGHT)
    axes = {
        "left": value_axis([p.load.get("requests_per_s", math.nan) for p in mine], TOP, h - BOTTOM),
        "right": value_axis([p.load.get(k, math.nan) for p in mine for k, *_ in LOAD_LINES[1:]], TOP, h - BOTTOM),
    }
    parts = [f'<svg class="chart load-chart" viewBox="0 0 {WIDTH} {h}" role="img" aria-label="load">'
             "<title>load: requests/s (left axis), prompt and output tokens/s (right axis)</title>"]  # fmt: skip
    if incident is not None:
        parts.append(shade(x, *incident, h, "incident-window", "the incident"))
    parts += frame(h, axes["left"], x, t0, t1, right=axes["right"])
    for field, _, css, side in LOAD_LINES:
        for run in runs(mine, has_load(field)):
            parts.append(polyline([(x(mid(p)), axes[side](p.load[field])) for p in run], css))
    parts += marks_drawn(x, marks, h, labelled=False)
    parts.append(legend([(css, f"{text} ({side})") for _, text, css, side in LOAD_LINES]))
    return "".join([*parts, "</svg>"])


def has_load(field: str) -> Callable[[SeriesPoint], bool]:
    return lambda point: field in point.load


def sparkline(values: Sequence[float], title: str) -> str:
    """A 100×24 line of recent values."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return ""
    low, high = min(finite), max(finite)
    span = high - low or 1.0
    step = 100 / (len(finite) - 1)
    xy = [(round(i * step, 1), round(22 - (v - low) / span * 20, 1)) for i, v in enumerate(finite)]
    return (f'<svg class="spark" viewBox="0 0 100 24" role="img"><title>{escape(title)}</title>'
            f"{polyline(xy, 'observed')}</svg>")  # fmt: skip
