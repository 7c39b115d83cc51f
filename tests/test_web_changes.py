"""Changes on the triage page: markers and reports from ``servewatch.changes`` in the
store, markers on an incident's charts, "started N windows after change ..." on an incident
that follows one, and the changes view (HTML and JSON) with each change's latest report."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from servewatch.pipeline.web import feed
from servewatch.pipeline.web.changes import change_text
from servewatch.pipeline.web.charts import Mark, load_chart, signal_chart
from servewatch.pipeline.web.store import TriageStore
from servewatch.schemas.change_marker import ChangeRef
from tests.conftest import MakeClient
from tests.web_samples import IMG, SCRIPT, WINDOW_S, incident, incident_group, marker, report, segment, series

START = 1767225600.0
CHANGE_AT = START + 66 * WINDOW_S  # 4 windows before the incident below starts


def after_change(description: str = "enable prefix caching") -> TriageStore:
    """A store with a change on llama, the incident it was followed by, and a final report on it."""
    store = TriageStore()
    labels = segment("llama")
    for point in series(labels, START, 90, anomalous_from=70):
        store.add(point)
    store.add(marker("llama", CHANGE_AT, description=description))
    store.add(marker("qwen", START, change_id="c0", description="qwen 2.5 → 3"))  # another model's
    ref = ChangeRef(id="c1", at=CHANGE_AT, description=description, windows_after=4)
    event = incident("llama", "g-fire", START + 70 * WINDOW_S, event_id="ev-1", after_change=ref)
    store.add(event)
    store.add(incident_group(event))
    store.add(report("llama", CHANGE_AT))
    return store


# -- the store ----------------------------------------------------------------------------------------


def test_store_applies_markers_and_reports_idempotently() -> None:
    store = TriageStore()
    live = store.subscribe(frozenset({"change_marker", "change_report"}))
    first = marker("llama", START, change_id="c1")
    store.add(first)
    store.add(first)  # read again after a reconnect
    store.add(marker("qwen", START + 600, change_id="c2", description="new weights"))
    assert live.queue.qsize() == 2
    assert [c.marker.id for c in store.changes()] == ["c2", "c1"]  # newest first
    assert [m.id for m in store.markers("llama")] == ["c1"] and store.changes("qwen")[0].report is None

    interim = report("llama", START, final=False, requests=1200)
    store.add(interim)
    store.add(report("llama", START, final=False, requests=2400))
    final = report("llama", START)
    store.add(final)
    assert live.queue.qsize() == 5
    for again in (interim, final, report("llama", START, final=False, requests=3000)):
        store.add(again)  # the topic read again from its start: the final report stays
    assert live.queue.qsize() == 5
    held = store.change("c1")
    assert held is not None and held.report == final and store.change("nope") is None
    store.add(report("llama", START).model_copy(update={"change": None}))  # an offline comparison: no marker
    assert live.queue.qsize() == 5
    kinds = [json.loads(live.queue.get_nowait() or "{}")["kind"] for _ in range(5)]
    assert kinds == ["change_marker", "change_marker", "change_report", "change_report", "change_report"]


def test_store_changes_are_bounded_and_incidents_name_their_change() -> None:
    store = TriageStore(max_changes=3)
    for i in range(5):
        store.add(marker("m", START + i, change_id=f"c{i}"))
        store.add(report("m", START + i, change_id=f"c{i}"))
    assert [c.marker.id for c in store.changes()] == ["c4", "c3", "c2"]
    assert len(store._reports) == 3 and store.change("c0") is None
    ref = ChangeRef(id="c4", at=START + 4, description="x", windows_after=2)
    event = incident("m", "g", START + 40, after_change=ref)
    store.add(event)
    store.add(incident("m", "g", START + 40, after_change=ref, status="resolved"))
    store.add(incident("m", "g2", START + 80))
    [after] = store.after_change("c4")
    assert after.status.value == "resolved" and store.after_change("c3") == []


async def test_the_feed_reads_markers_and_reports(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def fake_read(bootstrap: str, topic: str, **_: Any) -> AsyncIterator[bytes]:
        assert topic == feed.topics.CHANGES
        yield marker("m", START).model_dump_json().encode()
        yield b"{not json"
        yield b'{"kind": "change_report", "model": "m"}'
        yield report("m", START).model_dump_json().encode()
        await asyncio.Event().wait()

    monkeypatch.setattr(feed, "read_topic", fake_read)
    store = TriageStore()
    task = asyncio.create_task(feed.fold_topic(store, "x:1", feed.topics.CHANGES))
    for _ in range(100):
        held = store.change("c1")
        if held is not None and held.report is not None:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    held = store.change("c1")
    assert held is not None and held.report is not None and held.report.final
    assert caplog.text.count("unreadable record on servewatch.changes skipped") == 2


# -- charts and the incident ----------------------------------------------------------------------------


def test_charts_draw_changes_in_range_with_escaped_labels() -> None:
    points = series(segment("m"), START, 40, anomalous_from=30)
    marks = [Mark(START + 150, f"deploy {SCRIPT}", f"change c1: {IMG}"), Mark(START + 9999, "later", "out of range"),
             Mark(START + 390, "x" * 60, "near the right edge")]  # fmt: skip
    chart = signal_chart(points, "ttft", START, START + 400, label="m chat", marks=marks)
    assert chart.count('class="change-line"') == 2 and chart.count('class="change-label"') == 2
    assert "later" not in chart and "<script" not in chart and "<img" not in chart
    assert "deploy &lt;script&gt;" in chart and "change c1: &lt;img" in chart
    assert "x" * 31 + "…" in chart and "x" * 32 not in chart  # long labels are cut, the tooltip has it all
    assert re.search(r'x="[\d.]+" y="\d+" text-anchor="end">x', chart)  # near the right edge: label to the left
    load = load_chart(points, START, START + 400, marks=marks)
    assert load.count('class="change-line"') == 2 and 'class="change-label"' not in load
    assert 'class="change-line"' not in signal_chart(points, "ttft", START, START + 400, label="m")


async def test_an_incident_after_a_change_says_so_and_its_charts_mark_it(make_client: MakeClient) -> None:
    client = await make_client(after_change())
    for path in ("/anomalies/ev-1", "/groups/g-fire"):
        page = await (await client.get(path)).text()
        note = re.search(r'<p class="change-note".*?</p>', page, re.S)
        assert note, path
        text = re.sub(r"<[^>]+>", "", note.group(0))
        assert "Started 4 windows after change c1: 'enable prefix caching'" in text, text
        assert 'href="/changes/c1"' in note.group(0) and "report (final): 2 regressed, 1 improved" in text
        assert "1 rollback condition HOLDS" in text
        signal_svg = re.search(r'<svg class="chart signal-chart".*?</svg>', page, re.S)
        assert signal_svg and signal_svg.group(0).count('class="change-line"') == 1, path
        assert '<text class="change-label"' in signal_svg.group(0) and "enable prefix caching</text>" in page
        assert "qwen 2.5" not in page  # another model's change is not drawn
        assert "<code>change_marker</code> started 4 windows after change c1" in page  # the first hint
    plain = after_change()
    plain.add(incident("llama", "g-other", START + 80 * WINDOW_S, event_id="ev-2"))
    client = await make_client(plain)
    page = await (await client.get("/anomalies/ev-2")).text()
    assert 'class="change-note"' not in page and 'class="change-line"' in page  # still drawn: in range


async def test_a_change_no_longer_held_is_still_drawn_from_the_incident(make_client: MakeClient) -> None:
    store = TriageStore()
    for point in series(segment("llama"), START, 90, anomalous_from=70):
        store.add(point)
    ref = ChangeRef(id="c-old", at=CHANGE_AT, description="raise max_num_seqs", windows_after=4)
    store.add(incident("llama", "g", START + 70 * WINDOW_S, event_id="ev", after_change=ref))
    page = await (await (await make_client(store)).get("/anomalies/ev")).text()
    assert "Started 4 windows after change" in page and "report (" not in page
    assert page.count('class="change-line"') == 2 and "raise max_num_seqs</text>" in page


# -- the changes view --------------------------------------------------------------------------------------


def test_change_text_formats_ratios_and_points() -> None:
    assert change_text("ratio", 1.38, 1.25, 1.52) == "+38.0 % [+25.0, +52.0 %]"
    assert change_text("ratio", 0.9) == "-10.0 %"
    assert change_text("points", -40.0, -42.5, -37.1) == "-40.00 pt [-42.50, -37.10 pt]"
    assert change_text("points", None) == "–" and change_text("ratio", float("nan")) == "–"


async def test_the_changes_view_renders_reports_with_verdicts(make_client: MakeClient) -> None:
    store = after_change()
    store.add(marker("llama", CHANGE_AT + 3600, change_id="c2", description="back to fp16"))
    store.add(report("llama", CHANGE_AT + 3600, change_id="c2", final=False, requests=900))
    client = await make_client(store)
    page = await (await client.get("/changes")).text()
    assert '<a href="/changes">changes</a>' in page  # in the navigation
    ids = re.findall(r'<section class="change" id="change-([^"]+)"', page)
    assert ids == ["c2", "c1", "c0"]  # newest first
    c1 = re.search(r'id="change-c1".*?</section>', page, re.S)
    assert c1
    section = c1.group(0)
    assert '<span class="badge report-final">final</span>' in section
    for signal, verdict in (("ttft_p95", "regressed"), ("tokens_per_s_p50", "improved"),
                            ("cache_hit_rate", "regressed"), ("error_share", "no change"),
                            ("leak_share", "insufficient data")):  # fmt: skip
        row = re.search(rf'<tr data-signal="{signal}".*?</tr>', section, re.S)
        assert row, signal
        slug = verdict.replace(" ", "-")
        assert f'<td class="outcome outcome-{slug}">{verdict}</td>' in row.group(0), signal
    assert "+38.0 % [+25.0, +52.0 %]" in section and "-40.00 pt [-42.50, -37.10 pt]" in section
    assert "0.8 s" in section and "83.00 %" in section and "44.3 tok/s" in section
    assert "6 (97% / 95%)" in section  # coverage
    holds = re.search(r'<tr class="holds">.*?</tr>', section, re.S)
    assert holds and "<strong>HOLDS</strong>" in holds.group(0) and "chat / 4k-32k" in holds.group(0)
    assert "+41.0 % [+22.0, +63.0 %]" in holds.group(0)
    assert '<tr class="clear">' in section and "+0.01 pt [-0.08, +0.10 pt]" in section  # the points condition
    assert 'href="/anomalies/ev-1"' in section  # the incident that followed it
    assert "deploy=d-42" in section and "ana" in section
    c2 = re.search(r'id="change-c2".*?</section>', page, re.S)
    assert c2 and "report-interim" in c2.group(0) and "900 requests" in c2.group(0)
    assert "No report yet" in page  # c0
    qwen = await (await client.get("/changes", params={"model": "qwen"})).text()
    assert re.findall(r'<section class="change" id="change-([^"]+)"', qwen) == ["c0"]
    one = await client.get("/changes/c1")
    assert one.status == 200 and "HOLDS" in await one.text()
    assert (await client.get("/changes/nope")).status == 404


async def test_the_changes_view_escapes_what_the_poster_typed(make_client: MakeClient) -> None:
    description = f"flip {SCRIPT} {IMG}"
    store = after_change(description=description)
    hostile = marker(f"m{IMG}", START, change_id=f"c{SCRIPT}", description=description)
    store.add(hostile.model_copy(update={"labels": {f"k{IMG}": f"v{SCRIPT}"}, "by": f"by {IMG}"}))
    client = await make_client(store)
    for path in ("/changes", "/changes/c1", "/anomalies/ev-1", "/groups/g-fire"):
        response = await client.get(path)
        page = await response.text()
        assert response.status == 200, path
        assert page.count("<script") == 1 and "<img" not in page, path
        assert "flip &lt;script&gt;window.__xss=2;alert(1)&lt;/script&gt;" in page, path
        for title in re.findall(r"<title>(.*?)</title>", page, re.S):
            assert "<" not in title, (path, title)
    page = await (await client.get("/changes")).text()
    assert 'href="/changes/c%3Cscript%3Ewindow.__xss%3D2%3Balert%281%29%3C%2Fscript%3E"' in page
    assert "k&lt;img" in page and "v&lt;script&gt;" in page and "by &lt;img" in page


async def test_api_changes_answers_json(make_client: MakeClient) -> None:
    client = await make_client(after_change())
    answer = await (await client.get("/api/changes")).json()
    assert [c["marker"]["id"] for c in answer["changes"]] == ["c1", "c0"]
    c1, c0 = answer["changes"]
    assert c1["report"]["kind"] == "change_report" and c1["report"]["final"] is True
    assert [s["verdict"] for s in c1["report"]["signals"]][:2] == ["regressed", "improved"]
    assert c1["report"]["rollback"][0]["holds"] is True and c1["incidents"] == ["ev-1"]
    assert c0["report"] is None and c0["marker"]["description"] == "qwen 2.5 → 3"
    only = await (await client.get("/api/changes", params={"model": "qwen"})).json()
    assert [c["marker"]["id"] for c in only["changes"]] == ["c0"]
    one = await (await client.get("/api/changes/c1")).json()
    assert one["marker"]["labels"] == {"deploy": "d-42", "ticket": "OPS-7"}
    assert (await client.get("/api/changes/nope")).status == 404
    spec = await (await client.get("/openapi.json")).json()
    assert {"/api/changes", "/api/changes/{id}"} <= set(spec["paths"])
    assert {"ChangeMarker", "ChangeReport", "ChangeView"} <= set(spec["components"]["schemas"])


async def test_the_stream_delivers_change_records_when_asked(make_client: MakeClient) -> None:
    store = TriageStore()
    client = await make_client(store)
    response = await client.get("/api/stream", params={"kinds": "change_marker,change_report"})
    assert (await response.content.readline()).startswith(b"retry:")
    store.add(incident_group(incident("m", "g", START)))  # not asked for
    store.add(marker("m", START))

    async def next_data() -> dict[str, Any]:
        while True:
            line = await response.content.readline()
            if line.startswith(b"data: "):
                return dict(json.loads(line[6:]))

    record = await asyncio.wait_for(next_data(), 5)
    assert record["kind"] == "change_marker" and record["id"] == "c1"
    response.close()
