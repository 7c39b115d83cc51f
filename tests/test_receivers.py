"""The local stand-ins for Slack, PagerDuty, Alertmanager and webhooks (pipeline/dev/receivers.py)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from servewatch.pipeline.dev.receivers import (
    DEMO_ROUTING_KEY,
    KINDS,
    Fault,
    LocalReceiver,
    read_log,
    sample_config_yaml,
)

TRIGGER = {
    "routing_key": DEMO_ROUTING_KEY,
    "event_action": "trigger",
    "dedup_key": "group-1",
    "payload": {"summary": "TTFT p99 up 4x on llama-70b", "source": "servewatch", "severity": "critical"},
}


@pytest.fixture
async def receiver(tmp_path: Path) -> AsyncIterator[LocalReceiver]:
    async with LocalReceiver(log_path=tmp_path / "received.jsonl") as running:
        yield running


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=5.0) as http:
        yield http


async def test_each_endpoint_answers_like_its_service_and_is_recorded(
    receiver: LocalReceiver, client: httpx.AsyncClient
) -> None:
    urls = receiver.urls()
    assert urls["alertmanager"] == f"{receiver.url}/alertmanager" and receiver.url.startswith("http://127.0.0.1:")

    slack = await client.post(urls["slack"], json={"text": "hello"})
    assert (slack.status_code, slack.text) == (200, "ok")

    pd = await client.post(urls["pagerduty"], json=TRIGGER)
    assert pd.status_code == 202
    assert pd.json() == {"status": "success", "message": "Event processed", "dedup_key": "group-1"}
    no_key = await client.post(urls["pagerduty"], json={**TRIGGER, "dedup_key": None})
    assert no_key.status_code == 202 and len(no_key.json()["dedup_key"]) == 32  # PagerDuty makes one up

    alerts = [{"labels": {"alertname": "ServewatchAnomaly", "model": "llama"}, "startsAt": "2024-05-01T12:00:00Z"}]
    am = await client.post(f"{urls['alertmanager']}/api/v2/alerts", json=alerts)
    assert (am.status_code, am.content) == (200, b"")

    hook = await client.post(urls["webhook"], json={"group": "g1"}, headers={"X-Servewatch-Signature": "sha256=ab"})
    assert hook.status_code == 200

    assert receiver.count_by_kind() == {"slack": 1, "slack_api": 0, "pagerduty": 2, "alertmanager": 1, "webhook": 1}
    assert receiver.bodies("alertmanager") == [alerts]
    webhook = receiver.received[-1]
    assert (webhook.kind, webhook.path, webhook.status) == ("webhook", "/webhook/demo", 200)
    assert webhook.headers["x-servewatch-signature"] == "sha256=ab" and webhook.body == {"group": "g1"}
    assert len(receiver.attempts) == 5


async def test_invalid_payloads_are_refused_and_not_received(
    receiver: LocalReceiver, client: httpx.AsyncClient
) -> None:
    urls = receiver.urls()
    bad = {**TRIGGER, "routing_key": "short", "payload": {"summary": "x" * 1025, "severity": "fatal"}}
    answer = await client.post(urls["pagerduty"], json=bad)
    assert answer.status_code == 400 and answer.json()["status"] == "invalid event"
    errors = " | ".join(answer.json()["errors"])
    for field in ("routing_key", "summary", "source", "severity"):
        assert field in errors
    resolve = await client.post(urls["pagerduty"], json={**TRIGGER, "event_action": "resolve", "dedup_key": ""})
    assert resolve.status_code == 400 and "dedup_key" in resolve.json()["errors"][0]
    long_key = await client.post(urls["pagerduty"], json={**TRIGGER, "dedup_key": "k" * 256})
    assert long_key.status_code == 400

    am_url = f"{urls['alertmanager']}/api/v2/alerts"
    malformed: list[Any] = [{"labels": {"a": "b"}}, [{"annotations": {}}], [{"labels": {}}], [{"labels": {"a-b": "c"}}]]
    for body in malformed:
        assert (await client.post(am_url, json=body)).status_code == 400, body
    assert (await client.post(urls["slack"], json={"username": "x"})).text == "no_text"

    assert receiver.received == [] and [a.status for a in receiver.attempts] == [400] * 8


async def test_slack_api_posts_then_updates_by_ts(receiver: LocalReceiver, client: httpx.AsyncClient) -> None:
    api = receiver.urls()["slack_api"]
    auth = {"Authorization": "Bearer xoxb-test"}
    message = {"channel": "#alerts", "text": "firing"}

    assert (await client.post(f"{api}/chat.postMessage", json=message)).json() == {"ok": False, "error": "not_authed"}
    first = (await client.post(f"{api}/chat.postMessage", json=message, headers=auth)).json()
    second = (await client.post(f"{api}/chat.postMessage", json=message, headers=auth)).json()
    assert first["ok"] and first["channel"] == "#alerts"
    assert float(second["ts"]) > float(first["ts"]) and len(first["ts"].split(".")[1]) == 6

    update = {"channel": "#alerts", "ts": first["ts"], "text": "resolved"}
    updated = (await client.post(f"{api}/chat.update", json=update, headers=auth)).json()
    assert updated == {"ok": True, "channel": "#alerts", "ts": first["ts"]}
    assert receiver.messages[first["ts"]]["text"] == "resolved"
    for wrong in ({"ts": "1.000001"}, {"channel": "#other"}):
        missing = await client.post(f"{api}/chat.update", json={**update, **wrong}, headers=auth)
        assert missing.json() == {"ok": False, "error": "message_not_found"}

    assert receiver.count_by_kind()["slack_api"] == 3  # refusals (ok: false) are attempts only
    assert len(receiver.attempts) == 6


async def test_faults_are_consumed_one_per_request(receiver: LocalReceiver, client: httpx.AsyncClient) -> None:
    url = receiver.urls()["slack"]
    receiver.inject("slack", Fault.status(429, retry_after=2), Fault.status(500, body="boom"))
    receiver.faults["pagerduty"].append(Fault.status(503))  # another kind's queue is left alone

    limited = await client.post(url, json={"text": "1"})
    assert limited.status_code == 429 and limited.headers["retry-after"] == "2"
    failed = await client.post(url, json={"text": "2"})
    assert (failed.status_code, failed.text) == (500, "boom")
    fine = await client.post(url, json={"text": "3"})
    assert fine.status_code == 200

    assert receiver.bodies("slack") == [{"text": "3"}]
    assert [(a.status, a.fault) for a in receiver.attempts] == [(429, "status"), (500, "status"), (200, "")]
    assert receiver.faults == {**{kind: [] for kind in KINDS}, "pagerduty": [Fault.status(503)]}
    with pytest.raises(ValueError, match="unknown kind"):
        receiver.inject("teams", Fault.status(500))


async def test_a_delay_answers_late_and_a_client_that_gave_up_is_not_received(
    receiver: LocalReceiver, client: httpx.AsyncClient
) -> None:
    url = receiver.urls()["webhook"]
    receiver.inject("webhook", Fault.delay(0.2), Fault.delay(0.4))

    loop = asyncio.get_running_loop()
    began = loop.time()
    late = await client.post(url, json={"n": 1})
    assert late.status_code == 200 and loop.time() - began >= 0.2
    with pytest.raises(httpx.TimeoutException):
        await client.post(url, json={"n": 2}, timeout=0.1)
    async with asyncio.timeout(2):
        while len(receiver.attempts) < 2:
            await asyncio.sleep(0.02)

    assert [a.fault for a in receiver.attempts] == ["delay", "abandoned"]
    assert receiver.bodies("webhook") == [{"n": 1}]


async def test_down_drops_connections_for_a_while(receiver: LocalReceiver, client: httpx.AsyncClient) -> None:
    url = receiver.urls()["pagerduty"]
    receiver.down("pagerduty", 0.3)
    receiver.inject("pagerduty", Fault.status(500))  # not consumed while down

    with pytest.raises(httpx.TransportError):
        await client.post(url, json=TRIGGER)
    assert (await client.post(receiver.urls()["slack"], json={"text": "up"})).status_code == 200  # other kinds serve
    await asyncio.sleep(0.35)
    assert (await client.post(url, json=TRIGGER)).status_code == 500
    assert (await client.post(url, json=TRIGGER)).status_code == 202

    assert [a.fault for a in receiver.attempts] == ["down", "", "status", ""]
    assert receiver.attempts[0].status == 0 and receiver.attempts[0].body == TRIGGER
    assert receiver.count_by_kind()["pagerduty"] == 1


async def test_the_log_keeps_accepted_requests_as_json_lines(
    receiver: LocalReceiver, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    urls = receiver.urls()
    secret, body = b"demo-secret", b'{"group": "g1", "status": "firing"}'
    signature = hmac.new(secret, body, hashlib.sha256).hexdigest()
    receiver.inject("slack", Fault.status(500))
    await client.post(urls["slack"], json={"text": "lost"})
    await client.post(urls["slack"], json={"text": "kept"})
    await client.post(urls["webhook"], content=body, headers={"X-Servewatch-Signature": signature})

    lines = read_log(tmp_path / "received.jsonl")  # written at once, before stop()
    assert [(line["kind"], line["body"]) for line in lines] == [
        ("slack", {"text": "kept"}),
        ("webhook", {"group": "g1", "status": "firing"}),
    ]
    hook = lines[1]
    assert set(hook) == {"kind", "path", "body", "headers", "at", "status", "raw"}
    expected = hmac.new(secret, hook["raw"].encode(), hashlib.sha256).hexdigest()
    assert hmac.compare_digest(hook["headers"]["x-servewatch-signature"], expected)
    assert read_log(tmp_path / "absent.jsonl") == []


def test_the_sample_config_is_valid_and_points_every_sink_at_the_receiver() -> None:
    from servewatch.pipeline.notify.config import parse_config

    urls = {
        "slack": "http://127.0.0.1:1/slack/demo",
        "slack_api": "http://127.0.0.1:1/slack-api",
        "pagerduty": "http://127.0.0.1:1/pagerduty/v2/enqueue",
        "alertmanager": "http://127.0.0.1:1/alertmanager",
        "webhook": "http://127.0.0.1:1/webhook/demo",
    }
    config = parse_config(sample_config_yaml(urls), ".yaml", environ={})
    sinks = {sink.type: sink for sink in config.sinks}
    assert set(sinks) == {"slack", "slack_bot", "pagerduty", "alertmanager", "webhook"}
    assert config.defaults.group_wait == 1.0 and config.defaults.group_interval == 5.0
    assert config.defaults.repeat_interval == 3600.0
    assert config.timing_of(sinks["alertmanager"]).repeat_interval == 60.0
    severities = {kind: str(sink.route.min_severity) for kind, sink in sinks.items()}
    assert severities == {
        "slack": "info",
        "slack_bot": "info",
        "pagerduty": "critical",
        "alertmanager": "warning",
        "webhook": "info",
    }
    raw: dict[str, Any] = {
        "slack": sinks["slack"].url.get_secret_value(),  # type: ignore[union-attr]
        "slack_api": sinks["slack_bot"].api_url.get_secret_value(),  # type: ignore[union-attr]
        "pagerduty": sinks["pagerduty"].url.get_secret_value(),  # type: ignore[union-attr]
        "alertmanager": sinks["alertmanager"].url.get_secret_value(),  # type: ignore[union-attr]
        "webhook": sinks["webhook"].url.get_secret_value(),  # type: ignore[union-attr]
    }
    assert raw == urls
    assert sinks["webhook"].secret.get_secret_value() == "demo-secret"  # type: ignore[union-attr]
    assert len(sinks["pagerduty"].routing_key.get_secret_value()) == 32  # type: ignore[union-attr]


async def test_the_module_runs_as_a_process_that_prints_its_url(tmp_path: Path) -> None:
    log = tmp_path / "sub.jsonl"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "servewatch.pipeline.dev.receivers", "--log", str(log), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), timeout=10)).decode().strip()
        assert line.startswith("receiver ready: http://127.0.0.1:")
        url = line.removeprefix("receiver ready: ")
        async with httpx.AsyncClient(timeout=5.0) as http:
            answer = await http.post(f"{url}/slack/sub", json={"text": "from the test"})
        assert answer.status_code == 200
    finally:
        process.terminate()
        code = await asyncio.wait_for(process.wait(), timeout=10)
    assert code == 0
    assert [json.loads(text)["body"] for text in log.read_text().splitlines()] == [{"text": "from the test"}]
