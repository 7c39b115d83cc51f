"""The triage page's replica table: per model, each serving instance against its peers.

One row per instance and source (``TriageStore.replicas``): its request logs' comparison,
its scrapes', or both; the requests it served in its latest window (interval), how many
peers it was compared with, and per signal its ratio to their median with a sparkline of
the recent windows; a cell is ``firing`` while the instance's incident of
that signal is open and ``anomalous`` while its evidence is past the paging bar. An
instance not heard from for a few windows (drained, scaled in) is shown as such.
"""

from __future__ import annotations

from collections.abc import Sequence

from servewatch.models.explain.event_text import utc
from servewatch.pipeline.web.charts import fmt, sparkline
from servewatch.pipeline.web.render import attrs, esc, page, select_box
from servewatch.pipeline.web.store import SegmentOverview

#: The compared signals, in the table's order, with their column titles.
COLUMNS = (
    ("prefill_per_token", "prefill per token"),
    ("itl", "inter-token latency"),
    ("error_rate", "errors"),
    ("preemptions", "preemptions"),
)
#: Where a row's comparison comes from, as the table says it.
SOURCES = {"requests": "request logs", "scrapes": "scrapes"}
#: Windows without a point after which an instance is shown as not heard from.
STALE_WINDOWS = 3


def _cell(row: SegmentOverview, signal: str) -> str:
    point = row.point.signals.get(signal)
    if point is None:
        return '<td class="num">–</td>'
    state = "firing" if point.firing else "anomalous" if point.anomalous else "normal"
    spark = sparkline(row.sparklines.get(signal, []), f"{signal} of {row.point.segment.get('instance')} vs peers")
    return f'<td class="num {state}">{point.observed:.2f}x{spark}</td>'


def replicas_page(rows: Sequence[SegmentOverview], models: Sequence[str], model: str | None, csrf: str) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in ("instance", "from", "last window (UTC)", "requests/s", "peers",
                                                   *(title for _, title in COLUMNS)))  # fmt: skip
    newest: dict[str, float] = {}
    for row in rows:
        name = row.point.segment.get("model", "")
        newest[name] = max(newest.get(name, row.point.window_end), row.point.window_end)
    bodies, current = [], None
    for row in rows:
        point = row.point
        name = point.segment.get("model", "")
        if name != current:
            current = name
            bodies.append(f'<tr class="model-row"><th colspan="{5 + len(COLUMNS)}">{esc(name)}</th></tr>')
        length = point.window_end - point.window_start
        stale = newest[name] - point.window_end > STALE_WINDOWS * length
        seen = f"{utc(point.window_end)}{' (not heard from since)' if stale else ''}"
        bodies.append(
            f"<tr{attrs(data_key=row.key, class_='stale' if stale else None)}>"
            f"<td><code>{esc(point.segment.get('instance', ''))}</code></td>"
            f"<td>{esc(SOURCES.get(point.segment.get('source', 'requests'), ''))}</td><td>{esc(seen)}</td>"
            f'<td class="num">{fmt(point.load.get("requests_per_s", 0.0))}</td>'
            f'<td class="num">{point.load.get("peers", 0.0):.0f}</td>'
            + "".join(_cell(row, s) for s, _ in COLUMNS)
            + "</tr>"
        )
    choose = select_box("model", "model", [(m, m) for m in models], model)
    empty = "" if bodies else '<p class="empty">No instance compared yet (an instance needs peers and a warm-up).</p>'
    body = (
        '<h1>Replicas</h1><p class="lead">Each serving instance\'s latest window against the median of the other '
        "instances of its model on the same request mix; above about 1.3x with the evidence of a few windows, it "
        "pages as <code>replica_outlier</code>.</p>"
        f'<form class="filters" method="get" action="/replicas">{choose}<button>show</button></form>'
        f'<table id="replicas" class="segments"><thead><tr>{head}</tr></thead><tbody>{"".join(bodies)}</tbody>'
        f"</table>{empty}"
    )
    return page("replicas", body, csrf=csrf, name="replicas")
