"""Server-rendered HTML of the triage page: the layout, the group list, segments, login.

Pages are plain HTML that work without script; ``static/app.js`` adds live rows and the
feedback buttons. Everything shown comes from request logs in the end (model names,
routes, request ids, answer excerpts), so every data-derived string goes through ``esc``
(``html.escape`` with quotes) and every URL value through ``quote``: request content is
text on this page, never markup. No inline script or style (the Content-Security-Policy
forbids both); what the script needs rides on ``data-`` attributes and ``<meta>`` tags.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from html import escape
from urllib.parse import quote, urlencode

from servewatch.models.detect.lifecycle import SEVERITY_RANK
from servewatch.models.detect.signals import BY_SIGNAL
from servewatch.models.explain.event_text import utc
from servewatch.models.explain.wording import with_unit
from servewatch.pipeline.web.charts import fmt, sparkline
from servewatch.pipeline.web.links import LinkTemplates
from servewatch.pipeline.web.store import Filters, SegmentOverview
from servewatch.schemas.anomaly import Signal
from servewatch.schemas.feedback import Feedback
from servewatch.schemas.incident_group import IncidentGroup

#: Signals whose values are shares of requests (shown as percentages).
SIGNAL_NAMES = frozenset(signal.value for signal in Signal)
RATES = frozenset({"length_truncation", "error_rate", "reasoning_leak", "empty_response", "cache_hit_rate",
                   "preemptions"})  # fmt: skip
VERDICTS = (("expected", "expected"), ("not_expected", "not expected"), ("acknowledged", "acknowledge"))


def esc(value: object) -> str:
    """Any value as HTML text or attribute content."""
    return escape(str(value), quote=True)


def attrs(**values: object) -> str:
    """`` name="value"`` pairs, escaped; ``data_x`` becomes ``data-x``, ``class_`` ``class``."""
    return "".join(
        f' {name.rstrip("_").replace("_", "-")}="{esc(value)}"' for name, value in values.items() if value is not None
    )


def group_href(key: str) -> str:
    return f"/groups/{quote(key, safe='')}"


def anomaly_href(event_id: str) -> str:
    return f"/anomalies/{quote(event_id, safe='')}"


def segment_label(segment: dict[str, str]) -> str:
    """A segment's labels without the model and unset ones.

    >>> segment_label({"model": "m", "route": "chat", "tenant": "-", "prompt_band": "<4k"})
    'chat / <4k'
    """
    return " / ".join(v for k, v in segment.items() if k != "model" and v != "-") or "all"


def value_text(signal: str, value: float | None) -> str:
    """A signal's value with its unit, as events word it: ``850 ms``, ``2.10 s``, ``0.20%``,
    ``45.0 tokens/s``, ``3.0 requests``."""
    if value is None or not math.isfinite(value):
        return "–"
    spec = BY_SIGNAL.get(Signal(signal)) if signal in SIGNAL_NAMES else None
    if spec is None:  # a signal of a newer version: its number as it is
        return f"{value * 100:.1f}%" if signal in RATES else fmt(value)
    return with_unit(value, spec.unit)


def badge(kind: str, value: str) -> str:
    return f'<span class="badge {kind}-{esc(value)}">{esc(value)}</span>'


def page(title: str, body: str, *, csrf: str, name: str, **data: str | None) -> str:
    """A whole page; ``data`` lands on ``<body>`` for the script (``page``, ``group``...)."""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<meta name="csrf-token"{attrs(content=csrf)}><title>{esc(title)} · servewatch</title>'
        '<link rel="stylesheet" href="/static/app.css"><script src="/static/app.js" defer></script></head>'
        f"<body{attrs(data_page=name, **{f'data_{k}': v for k, v in data.items()})}>"
        '<header><a class="brand" href="/">servewatch</a><nav><a href="/">incidents</a>'
        '<a href="/segments">segments</a><a href="/replicas">replicas</a><a href="/changes">changes</a>'
        '<a href="/openapi.json">API</a></nav>'
        '<span id="live" class="live" role="status">static</span></header>'
        f"<main>{body}</main></body></html>"
    )


def select_box(name: str, label: str, options: Iterable[tuple[str, str]], chosen: str | None) -> str:
    items = [f'<option value=""{" selected" if chosen is None else ""}>any</option>']
    items += [f"<option{attrs(value=v)}{' selected' if v == chosen else ''}>{esc(t)}</option>" for v, t in options]
    return f"<label>{esc(label)} <select{attrs(name=name, id=f'filter-{name}')}>{''.join(items)}</select></label>"


def filter_form(filters: Filters, models: Sequence[str]) -> str:
    return (
        '<form id="filters" class="filters" method="get" action="/">'
        + select_box("model", "model", ((m, m) for m in models), filters.model)
        + select_box("signal", "signal", ((s.value, s.value) for s in Signal), filters.signal)
        + select_box("severity", "severity", ((s, f"≥ {s}") for s in SEVERITY_RANK), filters.severity)
        + select_box("status", "status", (("firing", "firing"), ("resolved", "resolved")), filters.status)
        + '<button type="submit">filter</button></form>'
    )


def group_row(group: IncidentGroup, feedback: Sequence[Feedback]) -> str:
    """One row of the group list; ``app.js`` builds the same from a live record."""
    members = "".join(
        f'<span class="member st-{esc(m.status.value)}">{esc(m.signal.value)} {esc(segment_label(m.segment))}</span>'
        for m in group.members
    )
    verdict = feedback[-1].verdict.replace("_", " ") if feedback else ""
    row = attrs(
        class_=f"group sev-{group.severity.value} st-{group.status.value}",
        data_key=group.group, data_model=group.model, data_signals=" ".join(s.value for s in group.signals),
        data_severity=group.severity.value, data_status=group.status.value, data_start=group.window_start,
    )  # fmt: skip
    return (
        f"<tr{row}><td>{esc(utc(group.window_start))}</td>"
        f"<td>{badge('st', group.status.value)}</td><td>{badge('sev', group.severity.value)}</td>"
        f'<td><a class="title"{attrs(href=group_href(group.group))}>{esc(group.title)}</a>'
        f'<div class="members">{members}</div></td><td>{esc(group.model)}</td><td>{esc(group.cause)}</td>'
        f"<td>{esc(', '.join(s.value for s in group.signals))}</td><td>{group.segments}</td>"
        f'<td class="verdict">{esc(verdict)}</td></tr>'
    )


def groups_page(
    groups: Sequence[tuple[IncidentGroup, Sequence[Feedback]]], filters: Filters, models: Sequence[str], csrf: str
) -> str:
    rows = "".join(group_row(g, f) for g, f in groups)
    head = "".join(f"<th>{h}</th>" for h in ("started (UTC)", "status", "severity", "group and its incidents",
                                              "model", "cause", "signals", "segments", "feedback"))  # fmt: skip
    body = (
        '<h1>Incident groups</h1><p class="lead">Firing and recently resolved, newest first; new ones appear '
        "as they arrive.</p>"
        + filter_form(filters, models)
        + f'<table id="groups" class="groups"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'
        + f'<p id="no-groups" class="empty"{" hidden" if rows else ""}>No firing or recently resolved groups.</p>'
    )
    return page("incidents", body, csrf=csrf, name="groups")


def _cell(overview: SegmentOverview, signal: str) -> str:
    point = overview.point.signals.get(signal)
    if point is None:
        return '<td class="num">–</td>'
    state = "firing" if point.firing else "anomalous" if point.anomalous else "normal"
    spark = sparkline(overview.sparklines.get(signal, []), f"{signal} of {overview.key}, recent windows")
    return (f'<td class="num {state}">{value_text(signal, point.observed)}'
            f'<span class="exp"> / {value_text(signal, point.expected)}</span>{spark}</td>')  # fmt: skip


def segments_page(overview: Sequence[SegmentOverview], links: LinkTemplates, csrf: str) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("segment", "last window (UTC)", "requests/s", "TTFT s (expected)",
                                              "ITL s (expected)", "throughput tok/s (expected)", "cache hit rate",
                                              "truncated", "errors", "dashboard"))  # fmt: skip
    bodies, model = [], None
    for item in overview:
        point = item.point
        if point.segment.get("model") != model:
            model = point.segment.get("model")
            bodies.append(f'<tr class="model-row"><th colspan="10">{esc(model)}</th></tr>')
        url = links.segment_url(item.key, point.segment, point.window_end)
        link = f'<a{attrs(href=url)} rel="noopener noreferrer">dashboard</a>' if url else ""
        shares = "".join(
            f'<td class="num">{value_text(s, point.signals[s].observed) if s in point.signals else "–"}</td>'
            for s in ("cache_hit_rate", "length_truncation", "error_rate")
        )
        bodies.append(
            f"<tr{attrs(data_key=item.key)}><td>{esc(segment_label(point.segment))}</td>"
            f'<td>{esc(utc(point.window_end))}</td><td class="num">{fmt(point.load.get("requests_per_s", 0.0))}</td>'
            + "".join(_cell(item, s) for s in ("ttft", "itl", "throughput"))
            + f"{shares}<td>{link}</td></tr>"
        )
    empty = "" if bodies else '<p class="empty">No judged windows yet (the worker publishes them each window).</p>'
    body = (
        '<h1>Segments</h1><p class="lead">Each segment\'s last judged window against what was expected at its '
        "load; sparklines show the recent windows.</p>"
        f'<table id="segments" class="segments"><thead><tr>{head}</tr></thead><tbody>{"".join(bodies)}</tbody>'
        f"</table>{empty}"
    )
    return page("segments", body, csrf=csrf, name="segments")


def login_page(csrf: str, next_path: str, failed: bool) -> str:
    problem = '<p class="error" role="alert">That token is not right.</p>' if failed else ""
    body = (
        f"<h1>Sign in</h1>{problem}"
        f'<form class="login" method="post"{attrs(action="/login?" + urlencode({"next": next_path}))}>'
        f'<input type="hidden" name="csrf"{attrs(value=csrf)}>'
        '<label>your name <input name="name" autocomplete="username" required maxlength="100"></label>'
        '<label>token <input type="password" name="token" autocomplete="current-password" required></label>'
        '<button type="submit">sign in</button></form>'
    )
    return page("sign in", body, csrf=csrf, name="login")


def error_page(status: int, message: str, csrf: str) -> str:
    return page(str(status), f"<h1>{status}</h1><p>{esc(message)}</p>", csrf=csrf, name="error")
