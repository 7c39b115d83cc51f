"""The detail views: one incident group (its verdicts and incidents) and one incident.

An incident is shown the way on-call reasons about it: the change it followed (if any), the
sentence, the likely causes, the load, the signal over the last hours against its band with
the load beneath and the model's changes marked on both, what
changed in the traffic, and the requests to look up, the anomalous window's beside the
baseline's, each linked to the user's own log search. Escaping as in ``render``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlencode

from servewatch.models.explain.event_text import utc
from servewatch.pipeline.web.changes import ChangeSource, change_note, chart_marks
from servewatch.pipeline.web.charts import fmt, load_chart, signal_chart
from servewatch.pipeline.web.links import LinkTemplates
from servewatch.pipeline.web.render import (
    VERDICTS,
    anomaly_href,
    attrs,
    badge,
    esc,
    group_href,
    page,
    segment_label,
    value_text,
)
from servewatch.pipeline.web.store import Member, segment_key
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.feedback import Feedback
from servewatch.schemas.incident_group import IncidentGroup
from servewatch.schemas.series import SeriesPoint

#: Hours of a signal shown before an incident (fewer when the page holds fewer).
CHART_BEFORE_S = 3 * 3600.0
#: Incidents of a group drawn in full on its page (the rest are rows of its table).
DRAWN_MEMBERS = 6
TOKENS = (("prompt_tokens", "prompt"), ("cached_tokens", "cached"), ("completion_tokens", "output"))

SeriesOf = Callable[[str], list[SeriesPoint]]


def chart_range(points: Sequence[SeriesPoint], event: AnomalyEvent) -> tuple[float, float]:
    """From hours before the incident (or the first window held) to the latest window held."""
    first = points[0].window_start if points else event.window_start
    last = points[-1].window_end if points else event.window_end
    start = min(max(event.window_start - CHART_BEFORE_S, first), event.window_start - 600.0)
    end = max(min(last, event.window_end + CHART_BEFORE_S), event.window_end + 60.0)
    return start, end


def feedback_item(feedback: Feedback) -> str:
    comment = f": {esc(feedback.comment)}" if feedback.comment else ""
    ident = f"{feedback.by}|{feedback.at}|{feedback.verdict}"
    return (f'<li{attrs(data_id=ident)}><strong>{esc(feedback.verdict.replace("_", " "))}</strong> by '
            f"{esc(feedback.by)} at {esc(utc(feedback.at))}{comment}</li>")  # fmt: skip


def feedback_section(group: IncidentGroup, feedback: Sequence[Feedback], user: str | None) -> str:
    buttons = "".join(f'<button type="button" class="verdict-{v}"{attrs(data_verdict=v)}>{esc(t)}</button>'
                      for v, t in VERDICTS)  # fmt: skip
    return (
        '<section class="feedback" id="feedback"><h2>Feedback</h2>'
        f'<form id="feedback-form"{attrs(data_key=group.group)}>'
        f'<label>your name <input id="feedback-by" name="by" maxlength="100"{attrs(value=user or "")}></label>'
        '<label>comment <input id="feedback-comment" name="comment" maxlength="2000"></label>'
        f'{buttons}</form><p id="feedback-status" class="status" role="status"></p>'
        f'<ul id="feedback-list">{"".join(feedback_item(f) for f in feedback)}</ul></section>'
    )


def _number(value: Any) -> str:
    return fmt(float(value)) if isinstance(value, int | float) and not isinstance(value, bool) else esc(value)


def evidence_table(rows: Sequence[Mapping[str, Any]], segment: Mapping[str, str], links: LinkTemplates) -> str:
    if not rows:
        # Evidence is read back for the step that pages (the firing, a step up); a resolve, an
        # update or an engine's capacity figures carry none: say where to look, not just "none".
        return '<p class="empty">no requests kept with this event: see the incident\'s firing event</p>'
    head = "".join(f"<th>{h}</th>" for h in ("request", "sample", "finished (UTC)", "instance", "tokens",
                                              "timings", "finish", "excerpt"))  # fmt: skip
    body = []
    for row in rows:
        request_id = row.get("request_id") or "?"
        url = links.evidence_url(row, segment)
        request = f'<a{attrs(href=url)} rel="noopener noreferrer">{esc(request_id)}</a>' if url else esc(request_id)
        finished = row.get("timestamp")
        when = utc(finished) if isinstance(finished, int | float) else finished or ""
        tokens = " · ".join(f"{label} {_number(row[k])}" for k, label in TOKENS if row.get(k) is not None)
        timings = " · ".join(f"{esc(k.removesuffix('_s'))} {_number(v)} s" for k, v in row.items()
                             if k.endswith("_s") and v is not None)  # fmt: skip
        excerpt = row.get("content_excerpt") or row.get("reasoning_excerpt") or ""
        if row.get("unavailable"):
            excerpt = "(could not be read back)"
        body.append(
            f'<tr><td class="request-id">{request}</td><td>{esc(row.get("sample", ""))}</td><td>{esc(when)}</td>'
            f"<td>{esc(row.get('instance') or '')}</td><td>{tokens}</td><td>{timings}</td>"
            f'<td>{esc(row.get("finish_reason") or "")}</td><td class="excerpt">{esc(excerpt)}</td></tr>'
        )
    return f'<table class="evidence"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def anomaly_section(
    event: AnomalyEvent,
    series_of: SeriesOf,
    links: LinkTemplates,
    latest: AnomalyEvent,
    changes: ChangeSource | None = None,
) -> str:
    """One incident in full; ``latest`` is its current state (``event`` the step with evidence)."""
    key = segment_key(event.segment)
    points = series_of(key)
    t0, t1 = chart_range(points, event)
    model = event.segment.get("model", "?")
    label = f"{model} {segment_label(event.segment)}"
    incident = (event.window_start, latest.window_end if latest.status.value == "resolved" else t1)
    if event.change is None and latest.change is not None:
        event = event.model_copy(update={"change": latest.change})
    marks = chart_marks(changes.markers(model) if changes is not None else [], event.change)
    charts = signal_chart(points, event.signal.value, t0, t1, label=label, incident=incident,
                          marks=marks) + load_chart(points, t0, t1, incident, marks)  # fmt: skip
    facts = [("observed", value_text(event.signal.value, event.observed)),
             ("expected", value_text(event.signal.value, event.expected)), ("score", fmt(event.score)),
             ("explained by load", "yes" if event.explained_by_load else "no"),
             ("window", f"{utc(event.window_start)} – {utc(event.window_end)}")]  # fmt: skip
    facts += [(name.replace("_", " "), fmt(value)) for name, value in event.load.items()]
    hints = "".join(f"<li><code>{esc(h.code)}</code> {esc(h.message)}</li>" for h in event.hints)
    shifts = "".join(f"<li>{esc(c)}</li>" for c in (event.facets.changes if event.facets else []))
    current = [r for r in event.evidence if r.get("sample") != "baseline"]
    baseline = [r for r in event.evidence if r.get("sample") == "baseline"]
    dashboard = links.segment_url(key, event.segment, t1)
    more = f'<p><a{attrs(href=dashboard)} rel="noopener noreferrer">segment dashboard</a></p>' if dashboard else ""
    young = '<p class="note">baseline still young: few windows seen</p>' if event.baseline_young else ""
    return (
        f'<article class="anomaly"{attrs(id=f"a-{event.id}", data_fingerprint=event.fingerprint)}>'
        f"<h3><a{attrs(href=anomaly_href(event.id))}>{esc(event.signal.value)} · {esc(label)}</a> "
        f"{badge('sev', event.severity.value)} {badge('st', latest.status.value)}</h3>"
        f'{change_note(event, changes)}<p class="summary">{esc(event.summary)}</p>{young}'
        f'<dl class="facts">{"".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in facts)}</dl>'
        + (f'<h4>Likely causes</h4><ul class="hints">{hints}</ul>' if hints else "")
        + f'<figure class="charts">{charts}</figure>'
        + (f'<h4>What changed against the baseline</h4><ul class="changes">{shifts}</ul>' if shifts else "")
        + '<div class="evidence-pair"><section><h4>Requests of the anomalous window</h4>'
        + evidence_table(current, event.segment, links)
        + "</section><section><h4>Baseline sample (latest normal window)</h4>"
        + evidence_table(baseline, event.segment, links)
        + f"</section></div>{more}</article>"
    )


def member_row(member: Member) -> str:
    latest, detail = member.latest, member.detail
    signal = detail.signal.value
    return (
        f"<tr{attrs(data_fingerprint=latest.fingerprint)}><td><a{attrs(href=anomaly_href(detail.id))}>"
        f"{esc(latest.signal.value)}</a></td><td>{esc(segment_label(latest.segment))}</td>"
        f'<td class="status">{badge("st", latest.status.value)}</td><td>{badge("sev", detail.severity.value)}</td>'
        f'<td class="num">{fmt(detail.score)}</td><td class="num">{value_text(signal, detail.observed)}'
        f" / {value_text(signal, detail.expected)}</td><td>{esc(utc(detail.window_start))}</td></tr>"
    )


def members_table(members: Sequence[Member]) -> str:
    rows = "".join(member_row(m) for m in members)
    head = "".join(f"<th>{h}</th>" for h in ("signal", "segment", "status", "severity", "score",
                                              "observed / expected", "started (UTC)"))  # fmt: skip
    return f'<table id="members" class="members"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'


def group_page(
    group: IncidentGroup,
    members: Sequence[Member],
    feedback: Sequence[Feedback],
    *,
    series_of: SeriesOf,
    links: LinkTemplates,
    csrf: str,
    user: str | None,
    changes: ChangeSource | None = None,
) -> str:
    drawn = "".join(anomaly_section(m.detail, series_of, links, m.latest, changes) for m in members[:DRAWN_MEMBERS])
    body = (
        f'<p class="crumbs"><a href="/">incidents</a> › group</p><h1 id="group-title">{esc(group.title)}</h1>'
        f'<p class="badges" id="group-state">{badge("st", group.status.value)} {badge("sev", group.severity.value)} '
        f"model <strong>{esc(group.model)}</strong> · cause <code>{esc(group.cause)}</code> · started "
        f"{esc(utc(group.window_start))} · last {esc(utc(group.window_end))}</p>"
        f'<p class="summary">{esc(group.summary)}</p>'
        + (
            f"<p><a{attrs(href='/replicas?' + urlencode({'model': group.model}))}>replica table of "
            f"{esc(group.model)}</a></p>"
            if group.cause.startswith("replica_outlier")
            else ""
        )
        + feedback_section(group, feedback, user)
        + f"<h2>Incidents ({len(members)})</h2>"
        + members_table(members)
        + (drawn or '<p class="empty">No incident events of this group held yet.</p>')
    )
    return page(group.title, body, csrf=csrf, name="group", group=group.group)


def anomaly_page(
    event: AnomalyEvent,
    latest: AnomalyEvent,
    *,
    series_of: SeriesOf,
    links: LinkTemplates,
    csrf: str,
    changes: ChangeSource | None = None,
) -> str:
    up = f" › <a{attrs(href=group_href(event.group))}>group</a>" if event.group else ""
    body = (
        f'<p class="crumbs"><a href="/">incidents</a>{up} › incident</p>'
        f"<h1>{esc(event.signal.value)} on {esc(event.segment.get('model', '?'))}</h1>"
        + anomaly_section(event, series_of, links, latest, changes)
    )
    return page(f"{event.signal.value} incident", body, csrf=csrf, name="anomaly", group=event.group)
