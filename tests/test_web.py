"""The triage page without a browser: the store's queries and bounds, the JSON API,
live updates, authentication and CSRF, verdicts, links out, and escaping of request content."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import TestClient
from pydantic import SecretStr

from servewatch.pipeline.cli.main import main
from servewatch.pipeline.web import feed
from servewatch.pipeline.web.charts import load_chart, signal_chart, sparkline
from servewatch.pipeline.web.links import GrafanaAnnotator, LinkTemplates
from servewatch.pipeline.web.store import Filters, TriageStore
from servewatch.schemas.feedback import Feedback
from tests.conftest import MakeClient
from tests.web_samples import IMG, SCRIPT, WINDOW_S, evidence, incident, incident_group, key_of, segment, series

START = 1767225600.0
TOKEN = "s3cret-token-for-tests"


def filled(store: TriageStore | None = None) -> TriageStore:
    """A store with one firing group (its incident, 90 judged windows) and one resolved group."""
    store = store or TriageStore()
    labels = segment("llama")
    for point in series(labels, START, 90, anomalous_from=70):
        store.add(point)
    firing = incident("llama", "g-fire", START + 70 * WINDOW_S)
    store.add(firing)
    store.add(incident_group(firing))
    old = incident("qwen", "g-old", START + 100, labels=segment("qwen"))
    store.add(old)
    store.add(incident_group(old, status="resolved"))
    return store


async def csrf_of(client: TestClient, **headers: str) -> str:
    page = await client.get("/", headers=headers)
    match = re.search(r'<meta name="csrf-token" content="([0-9a-f]+)">', await page.text())
    assert match, "the page carries its CSRF token"
    return match.group(1)


# -- the store ----------------------------------------------------------------------------------


def test_store_lists_firing_and_recent_groups_newest_first_with_filters() -> None:
    store = filled()
    assert [g.group for g in store.groups()] == ["g-fire", "g-old"]
    assert [g.group for g in store.groups(Filters(model="qwen"))] == ["g-old"]
    assert [g.group for g in store.groups(Filters(status="firing"))] == ["g-fire"]
    assert [g.group for g in store.groups(Filters(signal="itl"))] == []
    assert [g.group for g in store.groups(Filters(severity="critical"))] == ["g-fire", "g-old"]
    # a resolved group ages out of the list once the topic's event time is past its keep
    later = incident("llama", "g-later", START + 7 * 3600)
    store.add(incident_group(later))
    assert [g.group for g in store.groups()] == ["g-later", "g-fire"]
    assert store.group("g-old") is not None  # still held, only not listed


def test_store_members_series_segments_and_anomalies() -> None:
    store = filled()
    [member] = store.members("g-fire")
    assert member.latest.status.value == "firing" and member.detail.evidence
    resolved = incident("llama", "g-fire", START + 70 * WINDOW_S, status="resolved", rows=[])
    store.add(resolved)
    [member] = store.members("g-fire")
    assert member.latest.status.value == "resolved" and member.detail.evidence  # evidence from the firing step
    assert store.latest(member.detail).id == resolved.id
    key = key_of(segment("llama"))
    assert len(store.series(key)) == 90 and len(store.series(key, since=START + 80 * WINDOW_S)) == 10
    [overview] = store.segments()
    assert overview.key == key and len(overview.sparklines["ttft"]) == 60 and "itl" not in overview.sparklines
    assert [e.id for e in store.anomalies(Filters(model="llama"))] == [resolved.id, "g-fire-ev-firing"]
    assert store.anomaly("nope") is None and store.models() == ["llama", "qwen"]


def test_store_memory_is_bounded() -> None:
    store = TriageStore(max_groups=3, max_events=5, series_points=20, max_segments=2)
    for i in range(10):
        event = incident("m", f"g{i}", START + i, event_id=f"e{i}")
        store.add(event)
        store.add(incident_group(event, status="resolved" if i % 2 else "firing"))
    assert len(store._groups) == 3 and len(store._events) == 5
    assert store.anomaly("e0") is None and store.anomaly("e9") is not None
    assert store.members("g0") == []
    for route in ("a", "b", "c"):
        for point in series(segment("m", route), START, 50, anomalous_from=99):
            store.add(point)
    assert len(store._series) == 2 and all(len(points) == 20 for points in store._series.values())
    late = series(segment("m", "c"), START + 45 * WINDOW_S, 1, anomalous_from=99)[0]
    store.add(late)  # a repeat of a held window replaces it, order kept
    starts = [p.window_start for p in store.series(key_of(segment("m", "c")))]
    assert starts == sorted(starts) and len(starts) == 20


async def test_store_subscribers_get_records_and_a_slow_one_is_dropped() -> None:
    store = TriageStore(queue_size=2)
    fast, slow = store.subscribe(), store.subscribe()
    event = incident("m", "g1", START)
    store.add(event)
    assert json.loads(await fast.queue.get())["kind"] == "incident"
    store.add(incident_group(event))
    assert json.loads(await fast.queue.get())["kind"] == "group"
    store.add(incident_group(event, status="resolved"))  # ``slow`` never read: its third record overflows
    assert slow.dropped and await slow.queue.get() is None
    assert not fast.dropped
    for point in series(segment("m"), START, 3, anomalous_from=9):
        store.add(point)  # series points go only to those who asked for them
    assert fast.queue.qsize() == 1


def test_feedback_is_kept_once_per_verdict() -> None:
    store = filled()
    verdict = Feedback(group="g-fire", model="llama", verdict="not_expected", by="ana", at=START + 900)
    store.add(verdict)
    store.add(verdict)  # our own, read back from the topic
    assert store.feedback("g-fire") == [verdict]


# -- the API ------------------------------------------------------------------------------------


async def test_api_answers_json(make_client: MakeClient) -> None:
    client = await make_client(filled())
    groups = await (await client.get("/api/groups", params={"status": "firing"})).json()
    assert [g["group"] for g in groups["groups"]] == ["g-fire"] and groups["groups"][0]["verdicts"] == []
    detail = await (await client.get("/api/groups/g-fire")).json()
    assert detail["group"]["title"].startswith("prefix_cache_ineffective") and len(detail["members"]) == 1
    assert (await client.get("/api/groups/nope")).status == 404
    anomalies = await (await client.get("/api/anomalies", params={"model": "llama"})).json()
    event_id = anomalies["anomalies"][0]["id"]
    one = await (await client.get(f"/api/anomalies/{event_id}")).json()
    assert one["evidence"][0]["request_id"] == "req-slow-1"
    assert (await client.get("/api/anomalies/nope")).status == 404
    segments = await (await client.get("/api/segments")).json()
    assert segments["segments"][0]["signals"]["ttft"]["anomalous"] is True
    key = key_of(segment("llama"))
    since = START + 85 * WINDOW_S
    points = await (await client.get("/api/series", params={"key": key, "signal": "ttft", "since": since})).json()
    assert len(points["points"]) == 5 and set(points["points"][0]["signals"]) == {"ttft"}
    assert (await client.get("/api/series", params={"key": key, "since": "soon"})).status == 400
    assert (await client.get("/api/groups", params={"severity": "loud"})).status == 400
    assert (await client.get("/healthz")).status == 200


async def test_openapi_describes_every_api_route(make_client: MakeClient) -> None:
    client = await make_client(TriageStore())
    spec = await (await client.get("/openapi.json")).json()
    assert spec["openapi"].startswith("3.1")
    routes = {
        (r.method.lower(), r.resource.canonical)
        for r in client.app.router.routes()  # type: ignore[union-attr]
        if r.resource is not None and r.resource.canonical.startswith("/api/") and r.method != "HEAD"
    }
    described = {(method, path) for path, item in spec["paths"].items() for method in item}
    assert routes and routes <= described, routes - described
    assert "AnomalyEvent" in spec["components"]["schemas"] and "SeriesPoint" in spec["components"]["schemas"]


async def test_the_stream_delivers_a_new_record(make_client: MakeClient) -> None:
    store = TriageStore()
    client = await make_client(store)
    response = await client.get("/api/stream")
    assert response.headers["Content-Type"].startswith("text/event-stream")
    assert (await response.content.readline()).startswith(b"retry:")
    event = incident("m", "g-new", START)
    store.add(incident_group(event))

    async def next_data() -> dict[str, Any]:
        while True:
            line = await response.content.readline()
            if line.startswith(b"data: "):
                return dict(json.loads(line[6:]))

    record = await asyncio.wait_for(next_data(), 5)
    assert record["kind"] == "group" and record["group"] == "g-new"
    response.close()


# -- authentication, CSRF, verdicts ----------------------------------------------------------------


async def test_a_token_is_required_when_set(make_client: MakeClient) -> None:
    client = await make_client(filled(), token=TOKEN)
    assert (await client.get("/api/groups")).status == 401
    assert (await client.get("/api/groups", headers={"Authorization": "Bearer wrong"})).status == 401
    assert (await client.get("/api/groups", headers={"Authorization": f"Bearer {TOKEN}"})).status == 200
    basic = base64.b64encode(f"ana:{TOKEN}".encode()).decode()
    assert (await client.get("/api/groups", headers={"Authorization": f"Basic {basic}"})).status == 200
    page = await client.get("/groups/g-fire", allow_redirects=False)
    assert page.status == 303 and page.headers["Location"].startswith("/login?next=")
    assert (await client.get("/healthz")).status == 200 and (await client.get("/static/app.js")).status == 200
    # the login form: wrong token, then the right one gives a session cookie that opens pages
    form_page = await (await client.get("/login")).text()
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', form_page)
    assert csrf
    wrong = await client.post("/login", data={"csrf": csrf.group(1), "token": "nope", "name": "ana"})
    assert wrong.status == 401
    stale = await client.post("/login", data={"csrf": "0" * 64, "token": TOKEN, "name": "ana"})
    assert stale.status == 403
    ok = await client.post("/login?next=/segments", data={"csrf": csrf.group(1), "token": TOKEN, "name": "ana"},
                           allow_redirects=False)  # fmt: skip
    assert ok.status == 303 and ok.headers["Location"] == "/segments"
    assert "httponly" in ok.headers["Set-Cookie"].lower() and "samesite=strict" in ok.headers["Set-Cookie"].lower()
    assert (await client.get("/groups/g-fire")).status == 200  # the cookie jar holds the session
    again = re.search(r'name="csrf" value="([0-9a-f]+)"', await (await client.get("/login")).text())
    assert again and again.group(1) != csrf.group(1)  # bound to the session now
    evil = await client.post("/login?next=//evil.example", data={"csrf": again.group(1), "token": TOKEN, "name": "a"},
                             allow_redirects=False)  # fmt: skip
    assert evil.headers["Location"] == "/"


async def test_verdicts_need_csrf_and_are_published_with_who_and_when(make_client: MakeClient) -> None:
    published: list[Feedback] = []

    async def publish(feedback: Feedback) -> None:
        published.append(feedback)

    store = filled()
    client = await make_client(store, publish_feedback=publish, now=lambda: START + 1234.0)
    url = "/api/groups/g-fire/feedback"
    body = {"verdict": "not_expected", "by": "ana", "comment": "cache was not meant to go off"}
    assert (await client.post(url, json=body)).status == 403
    assert (await client.post(url, json=body, headers={"X-CSRF-Token": "f" * 64})).status == 403
    csrf = await csrf_of(client)
    foreign = {"X-CSRF-Token": csrf, "Origin": "https://evil.example"}
    assert (await client.post(url, json=body, headers=foreign)).status == 403
    assert (await client.post(url, data="verdict=expected", headers={"X-CSRF-Token": csrf})).status == 415
    nobody = await client.post(url, json={"verdict": "expected"}, headers={"X-CSRF-Token": csrf})
    assert nobody.status == 400
    assert (await client.post(url, json={**body, "verdict": "meh"}, headers={"X-CSRF-Token": csrf})).status == 400
    assert not published
    answer = await client.post(url, json=body, headers={"X-CSRF-Token": csrf})
    assert answer.status == 201, await answer.text()
    [given] = published
    assert (given.group, given.model, given.verdict, given.by, given.at) == ("g-fire", "llama", "not_expected",
                                                                            "ana", START + 1234.0)  # fmt: skip
    assert given.signals == ["ttft"] and store.feedback("g-fire") == [given]
    page = await (await client.get("/groups/g-fire")).text()
    assert "not expected</strong> by ana" in page and "cache was not meant to go off" in page
    listed = await (await client.get("/")).text()
    assert '<td class="verdict">not expected</td>' in listed
    ack = await client.post(url, json={"verdict": "acknowledge", "by": "bo"}, headers={"X-CSRF-Token": csrf})
    assert ack.status == 201 and published[-1].verdict == "acknowledged"


async def test_a_failed_publish_is_reported_not_recorded(make_client: MakeClient) -> None:
    async def broken(feedback: Feedback) -> None:
        raise ConnectionError("broker down")

    store = filled()
    client = await make_client(store, publish_feedback=broken)
    csrf = await csrf_of(client)
    answer = await client.post("/api/groups/g-fire/feedback", json={"verdict": "expected", "by": "ana"},
                               headers={"X-CSRF-Token": csrf})  # fmt: skip
    assert answer.status == 503 and store.feedback("g-fire") == []


async def test_basic_auth_names_who_gives_the_verdict(make_client: MakeClient) -> None:
    published: list[Feedback] = []

    async def publish(feedback: Feedback) -> None:
        published.append(feedback)

    client = await make_client(filled(), token=TOKEN, publish_feedback=publish)
    basic = {"Authorization": "Basic " + base64.b64encode(f"ana:{TOKEN}".encode()).decode()}
    csrf = await csrf_of(client, **basic)
    answer = await client.post("/api/groups/g-fire/feedback", json={"verdict": "expected", "by": "mallory"},
                               headers={**basic, "X-CSRF-Token": csrf})  # fmt: skip
    assert answer.status == 201 and published[0].by == "ana"


# -- pages, escaping and headers ------------------------------------------------------------------


def hostile_store() -> TriageStore:
    """Request content with script and image payloads in every place the page shows it."""
    store = TriageStore()
    labels = segment(f"m{IMG}", route=SCRIPT)
    for point in series(labels, START, 30, anomalous_from=20):
        store.add(point)
    rows = evidence(START + 200, request_id=f"r{SCRIPT}", excerpt=f"answer {IMG} {SCRIPT}")
    event = incident(labels["model"], "g-x", START + 200, labels=labels, rows=rows, summary=f"summary {SCRIPT}",
                     event_id="ev-x", change=f"changed {IMG}")  # fmt: skip
    store.add(event)
    store.add(incident_group(event, title=f"title {IMG}", summary=f"group {SCRIPT}"))
    store.add(Feedback(group="g-x", model=labels["model"], verdict="expected", by=f"by {IMG}", at=START + 300,
                       comment=f"comment {SCRIPT}"))  # fmt: skip
    return store


async def test_request_content_renders_as_text_everywhere(make_client: MakeClient) -> None:
    client = await make_client(hostile_store(), links=LinkTemplates(evidence="https://logs.example/?q={request_id}"))
    for path in ("/", "/groups/g-x", "/anomalies/ev-x", "/segments", "/login?next=" + IMG):
        response = await client.get(path)
        page = await response.text()
        assert response.status == 200, path
        assert "<img" not in page and "onerror=" not in page.replace("onerror=&quot;", ""), path
        assert page.count("<script") == 1 and '<script src="/static/app.js" defer></script>' in page, path
        for title in re.findall(r"<title>(.*?)</title>", page, re.S):
            assert "<" not in title, (path, title)
    detail = await (await client.get("/groups/g-x")).text()
    for shown in ("answer &lt;img src=x onerror=&quot;window.__xss=1;alert(1)&quot;&gt;",
                  "summary &lt;script&gt;", "title &lt;img", "changed &lt;img", "comment &lt;script&gt;",
                  "by &lt;img", "r&lt;script&gt;"):  # fmt: skip
        assert shown in detail, shown
    assert 'href="https://logs.example/?q=r%3Cscript%3Ewindow.__xss%3D2%3Balert%281%29%3C%2Fscript%3E"' in detail
    assert "<svg" in detail and "&lt;script&gt;" in re.search(r"<svg.*?</svg>", detail, re.S).group(0)  # type: ignore[union-attr]


async def test_every_answer_carries_the_security_headers(make_client: MakeClient) -> None:
    client = await make_client(filled())
    for path in ("/", "/api/groups", "/static/app.css", "/nope"):
        response = await client.get(path)
        csp = response.headers["Content-Security-Policy"]
        assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp, path
        assert response.headers["X-Content-Type-Options"] == "nosniff", path
    page = await (await client.get("/groups/g-fire")).text()
    assert 'class="band"' in page and 'class="anomaly-window"' in page and "req-slow-1" in page
    assert "req-base-1" in page and "Baseline sample" in page and "cached share of prompt tokens" in page
    assert (await client.get("/groups/nope")).status == 404


def test_charts_draw_band_windows_and_load_on_one_axis() -> None:
    labels = segment("m")
    points = series(labels, START, 40, anomalous_from=30)
    chart = signal_chart(points, "ttft", START, START + 400, label="m chat", incident=(START + 300, START + 400))
    assert chart.count('class="band"') == 1 and chart.count('class="anomaly-window"') == 1
    assert 'class="incident-window"' in chart and 'class="observed"' in chart and 'class="expected"' in chart
    one_sided = signal_chart(points, "cache_hit_rate", START, START + 400, label="m")
    assert 'class="band"' in one_sided  # low only: the band reaches the top
    load = load_chart(points, START, START + 400)
    assert all(f'class="{css}"' in load for css in ("load-requests", "load-prompt", "load-output"))
    assert "no judged windows" in signal_chart([], "ttft", START, START + 400, label="m")
    assert sparkline([1.0], "x") == "" and "<polyline" in sparkline([1.0, 2.0, 1.5], "x")


# -- links out --------------------------------------------------------------------------------------


def test_link_templates_quote_values_and_refuse_bad_templates() -> None:
    links = LinkTemplates(
        evidence="https://kibana/app/discover#/?_g=(time:(from:'{start}',to:'{end}'))&q={request_id}&m={model}",
        segment="https://grafana/d/x?var-segment={segment}&from={start_ms}&to={end_ms}&var-route={route}",
    )
    row = {"request_id": "a b&c", "timestamp": START + 100, "e2e_s": 40.0}
    url = links.evidence_url(row, {"model": "llama/70b"})
    assert url == ("https://kibana/app/discover#/?_g=(time:(from:'2026-01-01T00%3A00%3A00Z',"
                   "to:'2026-01-01T00%3A02%3A40Z'))&q=a%20b%26c&m=llama%2F70b")  # fmt: skip
    assert links.evidence_url({"timestamp": START}, {}) is None
    seg = links.segment_url("model=m|route=chat", {"model": "m", "route": "chat"}, START + 3600)
    assert seg == (f"https://grafana/d/x?var-segment=model%3Dm%7Croute%3Dchat&from={int((START - 5 * 3600) * 1000)}"
                   f"&to={int((START + 3600) * 1000)}&var-route=chat")  # fmt: skip
    assert LinkTemplates().evidence_url(row, {}) is None
    with pytest.raises(ValueError, match="unknown fields"):
        LinkTemplates(evidence="https://x/{prompt}")
    with pytest.raises(ValueError, match="http"):
        LinkTemplates(segment="javascript:alert({segment})")
    loki = (
        'https://grafana/explore?left={{"datasource":"loki","queries":[{{"expr":"{{app=\\"vllm\\"}} |= '
        '\\"{request_id}\\""}}],"range":{{"from":"{start_ms}","to":"{end_ms}"}}}}'
    )  # README's example
    assert '"expr":"{app=\\"vllm\\"} |= \\"r1\\""' in (LinkTemplates(evidence=loki).evidence_url(
        {"request_id": "r1", "timestamp": START}, {}) or "")  # fmt: skip


async def test_grafana_annotations_for_firing_and_resolved_groups() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200 if len(seen) < 3 else 500, json={"id": len(seen)})

    event = incident("llama", "g1", START)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        annotator = GrafanaAnnotator("https://grafana.example/", SecretStr("glsa_x"), client, now=lambda: START + 60)
        assert await annotator.annotate(incident_group(event))
        assert not await annotator.annotate(incident_group(event))  # the same record: once
        update = incident_group(event).model_copy(update={"transition": "update", "id": "u"})
        assert not await annotator.annotate(update)
        assert await annotator.annotate(incident_group(event, status="resolved"))
        old = incident_group(incident("llama", "g0", START - 7200))
        assert not await annotator.annotate(old)  # history read at start: not repainted
        failing = incident_group(incident("llama", "g2", START))
        assert not await annotator.annotate(failing)  # Grafana answered 500: a warning, no exception
    first = json.loads(seen[0].content)
    assert str(seen[0].url) == "https://grafana.example/api/annotations"
    assert seen[0].headers["Authorization"] == "Bearer glsa_x"
    assert first["tags"] == ["servewatch", "llama", "prefix_cache_ineffective"] and first["time"] == int(START * 1000)
    assert json.loads(seen[1].content)["text"].startswith("resolved:")


# -- the Kafka side and the command ------------------------------------------------------------------


async def test_the_feed_skips_unreadable_records(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    event = incident("m", "g1", START)

    async def fake_read(bootstrap: str, topic: str, **_: Any) -> AsyncIterator[bytes]:
        yield b"not json"
        yield b'{"kind": "incident", "id": 1}'
        yield event.model_dump_json().encode()
        yield incident_group(event).model_dump_json().encode()
        await asyncio.Event().wait()

    monkeypatch.setattr(feed, "read_topic", fake_read)
    store = TriageStore()
    groups: list[str] = []

    async def on_group(group: Any) -> None:
        groups.append(group.group)

    task = asyncio.create_task(feed.fold_topic(store, "x:1", feed.topics.ANOMALIES, on_group=on_group))
    for _ in range(100):
        if store.group("g1") is not None:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    assert store.anomaly(event.id) is not None and groups == ["g1"]
    assert caplog.text.count("unreadable record on servewatch.anomalies skipped") == 2


def test_web_refuses_a_public_interface_without_a_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("SERVEWATCH_WEB_TOKEN", raising=False)
    assert main(["web", "--host", "0.0.0.0", "--broker", "127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("servewatch web: refusing") and "SERVEWATCH_WEB_TOKEN" in err[0]
    monkeypatch.setenv("SERVEWATCH_WEB_TOKEN", "short")
    assert main(["web", "--broker", "127.0.0.1:9"]) == 2
    assert "too short" in capsys.readouterr().err
    monkeypatch.delenv("SERVEWATCH_WEB_TOKEN")
    monkeypatch.delenv("SERVEWATCH_BROKER", raising=False)
    assert main(["web"]) == 2 and "no Kafka broker" in capsys.readouterr().err
