"""Changes on the triage page: markers, the reports verifying them, and incidents after one.

A change marker (a deploy, a config flip) is drawn on an incident's charts as a vertical line,
an incident the worker found to start soon after one says so at its top, and ``/changes``
lists the markers newest first, each with its latest ``ChangeReport``: per signal the period
after against the period before on the same request mix, the change with its confidence
interval and a verdict, and the rollback conditions declared for it. Descriptions and labels
are whatever the poster typed: every one goes through ``esc`` / ``attrs`` as in ``render``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol
from urllib.parse import quote

from servewatch.models.explain.event_text import utc
from servewatch.pipeline.web.charts import Mark, clock, fmt
from servewatch.pipeline.web.render import anomaly_href, attrs, badge, esc, page, segment_label
from servewatch.pipeline.web.store import Change
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.change_marker import ChangeMarker, ChangeRef
from servewatch.schemas.change_report import ChangeReport, SignalChange

#: Incidents listed under a change on ``/changes`` (its own page lists all held).
LISTED_INCIDENTS = 5
#: Shown by ``app.js`` when a change record arrives while the page is open.
UPDATED = (
    '<p id="changes-updated" class="note" role="status" hidden>New change records arrived: <a href="">reload</a>.</p>'
)

IncidentsOf = Callable[[str], Sequence[AnomalyEvent]]


class ChangeSource(Protocol):
    """What the detail views ask about changes (``TriageStore`` answers)."""

    def markers(self, model: str | None = None) -> list[ChangeMarker]: ...

    def change(self, change_id: str) -> Change | None: ...


def change_href(change_id: str) -> str:
    return f"/changes/{quote(change_id, safe='')}"


# -- on an incident -------------------------------------------------------------------------------


def chart_marks(markers: Sequence[ChangeMarker], ref: ChangeRef | None) -> list[Mark]:
    """The model's markers as chart marks, and the one the incident names even if no longer held."""
    marks = [Mark(m.at, m.description, f"change {m.id} at {clock(m.at)} UTC: {m.description}"
                  + (f" (by {m.by})" if m.by else "")) for m in markers]  # fmt: skip
    if ref is not None and all(m.id != ref.id for m in markers):
        marks.append(Mark(ref.at, ref.description, f"change {ref.id} at {clock(ref.at)} UTC: {ref.description}"))
    return marks


def _windows(count: int) -> str:
    return f"{count} window" if count == 1 else f"{count} windows"


def report_gist(report: ChangeReport) -> str:
    """A report in a few words: its state, verdict counts, and any rollback condition that holds.

    >>> from servewatch.schemas.change_report import Period
    >>> empty = ChangeReport(model="m", before=Period(requests=0), after=Period(requests=0), segments=0,
    ...                      confidence=0.95, resamples=100, min_requests=50, signals=[], final=False)
    >>> report_gist(empty)
    'report (interim): no signals yet'
    """
    counts: dict[str, int] = {}
    for row in report.signals:
        counts[row.verdict] = counts.get(row.verdict, 0) + 1
    order = ("regressed", "improved", "inconclusive", "no change", "insufficient data")
    verdicts = ", ".join(f"{counts[v]} {v}" for v in order if v in counts) or "no signals yet"
    held = sum(check.holds for check in report.rollback)
    rollback = f"; {held} rollback condition{'s' if held > 1 else ''} HOLD{'' if held > 1 else 'S'}" if held else ""
    return f"report ({'final' if report.final else 'interim'}): {verdicts}{rollback}"


def change_note(event: AnomalyEvent, source: ChangeSource | None) -> str:
    """'Started N windows after change c1: ...' at the top of an incident that follows a change."""
    ref = event.change
    if ref is None:
        return ""
    held = source.change(ref.id) if source is not None else None
    gist = f" · <a{attrs(href=change_href(ref.id))}>{esc(report_gist(held.report))}</a>" if held and held.report else ""
    return (
        f'<p class="change-note" role="note">Started {_windows(ref.windows_after)} after change '
        f"<a{attrs(href=change_href(ref.id))}><code>{esc(ref.id)}</code></a>: '{esc(ref.description)}' "
        f'<span class="when">(at {esc(utc(ref.at))})</span>{gist}</p>'
    )


# -- a report -----------------------------------------------------------------------------------------


def value_text(row: SignalChange, value: float | None) -> str:
    """A side's value: shares as percentages, throughput in tok/s, latencies in seconds."""
    if value is None or not math.isfinite(value):
        return "–"
    if row.kind == "points":
        return f"{100 * value:.2f} %"
    return fmt(value) + (" tok/s" if "tokens_per_s" in row.signal else " s")


def change_text(kind: str, change: float | None, low: float | None = None, high: float | None = None) -> str:
    """A change with its CI: ratios as +x.x %, shares as +x.xx pt.

    >>> change_text("ratio", 1.1, 1.05, 1.2), change_text("points", -0.5, -0.9, -0.1)
    ('+10.0 % [+5.0, +20.0 %]', '-0.50 pt [-0.90, -0.10 pt]')
    """
    if change is None or not math.isfinite(change):
        return "–"

    def shown(value: float) -> str:
        return f"{value:+.2f}" if kind == "points" else f"{100 * (value - 1):+.1f}"

    unit = " pt" if kind == "points" else " %"
    ci = ""
    if low is not None and high is not None and math.isfinite(low) and math.isfinite(high):
        ci = f" [{shown(low)}, {shown(high)}{unit}]"
    return f"{shown(change)}{unit}{ci}"


def _period(name: str, first: float | None, last: float | None, requests: int) -> str:
    span = f"{utc(first)} – {utc(last)}" if first is not None and last is not None else "no requests yet"
    return f"{name} <strong>{esc(span)}</strong> ({requests:,} requests)"


def signals_table(report: ChangeReport) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("signal", "before", "after", "change [CI]", "verdict",
                                              "segments used (coverage before / after)"))  # fmt: skip
    rows = []
    for row in report.signals:
        slug = row.verdict.replace(" ", "-")
        coverage = f"{row.segments_used} ({row.coverage_before:.0%} / {row.coverage_after:.0%})"
        rows.append(
            f"<tr{attrs(data_signal=row.signal, data_verdict=row.verdict)}><td><code>{esc(row.signal)}</code>"
            f' <span class="better">({esc(row.better)} is better)</span></td>'
            f'<td class="num">{esc(value_text(row, row.before))}</td><td class="num">{esc(value_text(row, row.after))}'
            f'</td><td class="num">{esc(change_text(row.kind, row.change, row.ci_low, row.ci_high))}</td>'
            f'<td class="outcome outcome-{esc(slug)}"{attrs(title=row.reason)}>{esc(row.verdict)}</td>'
            f'<td class="num">{esc(coverage)}</td></tr>'
        )
    return f'<table class="report"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def rollback_table(report: ChangeReport) -> str:
    if not report.rollback:
        return ""
    kinds = {row.signal: row.kind for row in report.signals}
    head = "".join(f"<th>{h}</th>" for h in ("rollback condition", "result", "where", "change [CI]", "detail"))
    rows = []
    for check in report.rollback:
        kind = kinds.get(check.condition.split(" ", 1)[0], "ratio")
        result = "<strong>HOLDS</strong>" if check.holds else "does not hold"
        rows.append(
            f'<tr class="{"holds" if check.holds else "clear"}"><td>{esc(check.condition)}</td><td>{result}</td>'
            f"<td>{esc(check.where or '')}</td>"
            f'<td class="num">{esc(change_text(kind, check.change, check.ci_low, check.ci_high))}</td>'
            f"<td>{esc(check.detail)}</td></tr>"
        )
    return f'<table class="rollback"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def report_section(report: ChangeReport | None) -> str:
    if report is None:
        return ('<p class="empty">No report yet: the worker verifies a change once requests after it '
                "arrive (SERVEWATCH_WATCH_CHANGES).</p>")  # fmt: skip
    state = (
        '<span class="badge report-final">final</span>'
        if report.final
        else '<span class="badge report-interim">interim</span> the period after is still filling'
    )
    b, a = report.before, report.after
    ci = f"{report.confidence:.0%} CI from {report.resamples:,} resamples"
    ci += ", simultaneous over the signals" if report.simultaneous else ""
    return (
        f'<div class="report-head"{attrs(data_final=str(report.final).lower())}><p>{state} · '
        f"{_period('before', b.first, b.last, b.requests)} · {_period('after', a.first, a.last, a.requests)}</p>"
        f'<p class="note">{report.segments} segments; after weighted to the before period\'s mix; {esc(ci)}; '
        f"at least {report.min_requests:,} requests per segment and side</p></div>"
        + signals_table(report)
        + rollback_table(report)
    )


# -- the changes view -----------------------------------------------------------------------------------


def _incidents(events: Sequence[AnomalyEvent], limit: int | None) -> str:
    if not events:
        return ""
    items = [
        f"<li><a{attrs(href=anomaly_href(e.id))}>{esc(e.signal.value)} · {esc(segment_label(e.segment))}</a> "
        f"{badge('st', e.status.value)} {badge('sev', e.severity.value)} {esc(utc(e.window_start))}</li>"
        for e in events[:limit]
    ]
    more = f"<li>and {len(events) - limit} more</li>" if limit is not None and len(events) > limit else ""
    return f'<h4>Incidents that started soon after it</h4><ul class="after-change">{"".join(items)}{more}</ul>'


def change_section(change: Change, incidents: Sequence[AnomalyEvent], limit: int | None = LISTED_INCIDENTS) -> str:
    marker = change.marker
    facts = [f"model <strong>{esc(marker.model)}</strong>", f"at {esc(utc(marker.at))}"]
    facts += [f"instance <strong>{esc(marker.instance)}</strong>"] if marker.instance else []
    facts += [f"by {esc(marker.by)}"] if marker.by else []
    facts += [f"via {esc(marker.source)}", f"id <code>{esc(marker.id)}</code>"]
    facts += [" ".join(f'<code class="label">{esc(k)}={esc(v)}</code>' for k, v in marker.labels.items())]
    return (
        f'<section class="change"{attrs(id=f"change-{marker.id}", data_change=marker.id, data_model=marker.model)}>'
        f"<h2><a{attrs(href=change_href(marker.id))}>{esc(marker.description)}</a></h2>"
        f'<p class="change-facts">{" · ".join(f for f in facts if f)}</p>'
        + report_section(change.report)
        + _incidents(incidents, limit)
        + "</section>"
    )


def _model_filter(models: Sequence[str], chosen: str | None) -> str:
    options = [f'<option value=""{" selected" if chosen is None else ""}>any</option>']
    options += [f"<option{attrs(value=m)}{' selected' if m == chosen else ''}>{esc(m)}</option>" for m in models]
    return (
        '<form id="filters" class="filters" method="get" action="/changes"><label>model '
        f'<select name="model" id="filter-model">{"".join(options)}</select></label>'
        '<button type="submit">filter</button></form>'
    )


def changes_page(
    changes: Sequence[Change], models: Sequence[str], chosen: str | None, incidents_of: IncidentsOf, csrf: str
) -> str:
    sections = "".join(change_section(c, incidents_of(c.marker.id)) for c in changes)
    body = (
        '<h1>Changes</h1><p class="lead">Change markers, newest first, each with its latest report: the '
        "requests after it against those before, on the period before's request mix.</p>"
        + UPDATED
        + _model_filter(models, chosen)
        + (sections or '<p class="empty">No change markers (post them with <code>servewatch mark</code>).</p>')
    )
    return page("changes", body, csrf=csrf, name="changes")


def change_page(change: Change, incidents: Sequence[AnomalyEvent], csrf: str) -> str:
    crumbs = '<p class="crumbs"><a href="/changes">changes</a> › change</p>'
    body = crumbs + UPDATED + change_section(change, incidents, None)
    return page(f"change {change.marker.description}", body, csrf=csrf, name="change", change=change.marker.id)


def change_json(change: Change, incidents: Sequence[AnomalyEvent]) -> dict[str, Any]:
    """A change as the API shows it: the marker, its latest report, the incidents that named it."""
    report = change.report.model_dump(mode="json") if change.report is not None else None
    return {"marker": change.marker.model_dump(mode="json"), "report": report, "incidents": [e.id for e in incidents]}
