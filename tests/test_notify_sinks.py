"""The notifier's sinks: payloads within each receiver's limits, hostile log text
kept inert, each receiver's answers sorted into accepted, retryable and rejected, and
secrets kept out of errors. HTTP goes to ``httpx.MockTransport``: no network."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from servewatch.pipeline.notify.config import (
    Alertmanager,
    NotifyConfig,
    PagerDuty,
    SlackBot,
    SlackWebhook,
    Timing,
    Webhook,
)
from servewatch.pipeline.notify.notification import Notification
from servewatch.pipeline.notify.sinks.alertmanager import AlertmanagerSink, PostableAlert, build_alerts, label_name
from servewatch.pipeline.notify.sinks.base import RejectedError, RetryableError
from servewatch.pipeline.notify.sinks.build import build_sink
from servewatch.pipeline.notify.sinks.content import rfc3339
from servewatch.pipeline.notify.sinks.pagerduty import Event, PagerDutySink, build_event, dedup_key
from servewatch.pipeline.notify.sinks.slack import SlackBotSink, SlackWebhookSink, build_message
from servewatch.pipeline.notify.sinks.slack_blocks import (
    FALLBACK_CHARS,
    FIELD_CHARS,
    HEADER_CHARS,
    MAX_BLOCKS,
    TEXT_CHARS,
    Header,
    Message,
    Section,
    Text,
    escape_mrkdwn,
)
from servewatch.pipeline.notify.sinks.webhook import WebhookSink, sign, verify
from servewatch.schemas.anomaly import Hint, Severity, Signal, Status
from tests.notify_fixtures import CAUSE, GROUP_KEY, MODEL, sample_notification

HOOK_URL = "https://hooks.slack.com/services/T0001/B0001/hooksecretXYZ"
BOT_TOKEN = "xoxb-bot-token-secret-123"
ROUTING_KEY = "R0UT1NGKEY0123456789abcdefABCDEF"  # PagerDuty's keys are 32 characters
AM_TOKEN = "am-bearer-secret"

Handler = Callable[[httpx.Request], httpx.Response]


def client_for(handler: Handler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def recording(*answers: httpx.Response) -> tuple[Handler, list[httpx.Request]]:
    """A handler answering ``answers`` in turn (the last one again after), and what it was sent."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers[min(len(seen), len(answers)) - 1]

    return handle, seen


def timing_out(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("read timed out", request=request)


def slack_hook() -> SlackWebhook:
    return SlackWebhook(name="team", type="slack", url=HOOK_URL)  # type: ignore[arg-type]


def slack_bot() -> SlackBot:
    return SlackBot(name="bot", type="slack_bot", token=BOT_TOKEN, channel="#oncall", api_url="https://slack.test/api")  # type: ignore[arg-type]


def pagerduty() -> PagerDuty:
    return PagerDuty(name="pager", type="pagerduty", routing_key=ROUTING_KEY, url="https://pd.test/v2/enqueue")  # type: ignore[arg-type]


def payload_of(note: Notification) -> dict[str, Any]:
    return build_message(note).model_dump(mode="json", exclude_none=True)


def texts(payload: dict[str, Any]) -> list[str]:
    """Every text of a Block Kit payload, wherever it sits."""
    found = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("text"), str):
                found.append(node["text"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(payload)
    return found


def huge(note: Notification) -> Notification:
    """``note`` with a 100 kB summary and title, 200 long hints and 200 evidence rows."""
    hints = [Hint(code=f"code_{i}", message="why " * 500) for i in range(200)]
    rows = [
        {"request_id": f"r{i}", "ttft_s": 1.0, "sample": "slowest", "content_excerpt": "&<>" * 2000} for i in range(200)
    ]
    lead = note.members[0].model_copy(update={"hints": hints, "evidence": rows, "summary": "slow " * 20_000})
    group = note.group.model_copy(update={"summary": "& slow <now> " * 10_000, "title": "t&" * 500})
    return dataclasses.replace(note, group=group, members=(lead, *note.members[1:]))


# -- Slack: content, limits, escaping ---------------------------------------------------------


def test_a_firing_group_reads_as_one_message() -> None:
    payload = payload_of(sample_notification())
    blocks = payload["blocks"]
    assert [b["type"] for b in blocks] == ["header", "section", "section", "section", "section", "actions", "context"]
    header = blocks[0]["text"]["text"]
    assert header.startswith("🔴 Firing · critical · ") and CAUSE in header and MODEL in header
    fields = {f["text"].split("\n")[0]: f["text"].split("\n", 1)[1] for f in blocks[2]["fields"]}
    assert fields["*Segment*"] == "route=chat, prompt_band=1k-4k"
    assert fields["*Observed (ttft)*"] == "4.21 s vs 620 ms expected"
    assert fields["*Load*"].startswith("12.4 req/s, 45,210 prompt tok/s")
    assert fields["*Explained by load*"] == "no" and fields["*Model*"] == MODEL
    assert "*prefix_cache_ineffective*:" in blocks[3]["text"]["text"]
    evidence = blocks[4]["text"]["text"].split("\n")[1:]
    assert len(evidence) == 3 and evidence[0].startswith("• req-7f3a9c: ttft 4.21 s")  # the slowest first
    assert "3,812 prompt (0 cached) → 256 completion tokens, stop" in evidence[0]
    assert [b["url"] for b in blocks[5]["elements"]] == [
        f"https://servewatch.example.com/groups/{GROUP_KEY}",
        f"https://wiki.example.com/runbooks/servewatch/{CAUSE}",
    ]
    assert blocks[6]["elements"][0]["text"] == f"3 incidents in 2 segments · key servewatch:{GROUP_KEY}:firing:1"
    assert payload["text"].startswith("Firing critical: ")


def test_a_resolved_group_is_short_and_links_only_what_is_set() -> None:
    payload = payload_of(sample_notification("resolved", triage_url=None, runbook_url=None))
    assert [b["type"] for b in payload["blocks"]] == ["header", "section", "context"]
    assert payload["blocks"][0]["text"]["text"].startswith("✅ Resolved · ")
    assert "lasted 5 min" in payload["blocks"][2]["elements"][0]["text"]


def test_huge_content_still_makes_a_valid_payload() -> None:
    payload = payload_of(huge(sample_notification()))
    Message.model_validate(payload)  # what was built validates again, as Slack would read it
    assert len(payload["blocks"]) <= MAX_BLOCKS
    assert len(payload["blocks"][0]["text"]["text"]) <= HEADER_CHARS
    assert all(len(text) <= TEXT_CHARS for text in texts(payload["blocks"]))
    assert all(len(field["text"]) <= FIELD_CHARS for field in payload["blocks"][2]["fields"])
    assert 0 < len(payload["text"]) <= FALLBACK_CHARS
    assert payload["blocks"][1]["text"]["text"].endswith("…")
    assert not [t for t in texts(payload) if re.search(r"&(?!amp;|lt;|gt;)", t)]  # no entity cut in half


def test_block_models_refuse_what_slack_refuses() -> None:
    with pytest.raises(ValidationError):
        Header(text=Text(type="plain_text", text="x" * (HEADER_CHARS + 1)))
    with pytest.raises(ValidationError):
        Header(text=Text(type="mrkdwn", text="*bold*"))
    with pytest.raises(ValidationError):
        Section(text=Text(type="mrkdwn", text="x" * (TEXT_CHARS + 1)))
    with pytest.raises(ValidationError):
        Section()
    with pytest.raises(ValidationError):
        Message(text="t", blocks=[Section(text=Text(type="mrkdwn", text="x"))] * (MAX_BLOCKS + 1))
    with pytest.raises(ValidationError):
        Message(text="", blocks=[])


@pytest.mark.parametrize(
    ("hostile", "absent"),
    [
        ("<!channel> wake up", ["<", ">", "!channel>"]),
        ("<!here|here> <!everyone>", ["<", ">"]),
        ("<@U123ABC> look", ["<@", ">"]),
        ("<https://evil.example|click me>", ["<https", "|click me>"]),
        ("@here @channel @everyone", ["@here", "@channel", "@everyone"]),
        ("*bold* _italic_ ~strike~", ["*", "~", " _", "_ "]),
        ("`code` and ```rm -rf /```", ["`"]),
        ("tom & jerry <3", ["& ", "<3"]),
        ("rtl \u202eevil\u202c zero\u200bwidth", ["\u202e", "\u200b"]),
    ],
)
def test_escape_mrkdwn_defuses_hostile_text(hostile: str, absent: list[str]) -> None:
    escaped = escape_mrkdwn(hostile)
    assert not [piece for piece in absent if piece in escaped], escaped


def test_escape_mrkdwn_keeps_what_people_search_for() -> None:
    assert escape_mrkdwn("req_7f3a_9c prompt_band=1k-4k a*b") == "req_7f3a_9c prompt_band=1k-4k a*b"
    assert escape_mrkdwn("a & b") == "a &amp; b"
    assert escape_mrkdwn("@here") == "@\u200bhere"


def test_hostile_log_content_survives_nowhere_in_the_slack_json() -> None:
    raw = json.dumps(payload_of(sample_notification(hostile=True)), ensure_ascii=False)
    for marker in ("<!channel>", "<@U123>", "<https://", "|click>", "*b*", "@here", "`"):
        assert marker not in raw, marker
    assert "<" not in raw and ">" not in raw  # the payload links through buttons, never through <url|...>
    assert "&lt;!channel&gt;" in raw  # shown, not acted on


# -- Slack: the two ways of sending ----------------------------------------------------------


async def test_the_slack_webhook_posts_the_message() -> None:
    handler, seen = recording(httpx.Response(200, text="ok"))
    async with client_for(handler) as client:
        assert await SlackWebhookSink(slack_hook(), client, 5.0).send(sample_notification()) == {}
    assert str(seen[0].url) == HOOK_URL
    assert seen[0].headers["content-type"] == "application/json"
    body = json.loads(seen[0].content)
    assert body["text"] and body["blocks"][0]["type"] == "header"


@pytest.mark.parametrize(
    ("answer", "error", "check"),
    [
        (httpx.Response(500, text="oops"), RetryableError, lambda e: e.retry_after is None),
        (httpx.Response(429, headers={"Retry-After": "7"}), RetryableError, lambda e: e.retry_after == 7.0),
        (httpx.Response(400, text="invalid_blocks"), RejectedError, lambda e: e.answer == "invalid_blocks"),
        (httpx.Response(404, text=f"no hook at {HOOK_URL}"), RejectedError, lambda e: e.status_code == 404),
    ],
)
async def test_slack_webhook_failures_are_sorted(
    answer: httpx.Response, error: type[Exception], check: Callable[[Any], bool]
) -> None:
    sink = SlackWebhookSink(slack_hook(), client_for(lambda _: answer), 5.0)
    with pytest.raises(error) as caught:
        await sink.send(sample_notification())
    assert check(caught.value)
    said = f"{caught.value} {caught.value!r} {getattr(caught.value, 'answer', '')} {sink!r}"
    assert "hooksecretXYZ" not in said


async def test_a_timeout_is_retryable() -> None:
    with pytest.raises(RetryableError, match="timed out"):
        await SlackWebhookSink(slack_hook(), client_for(timing_out), 2.0).send(sample_notification())


def slack_api(*answers: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[Handler, list[httpx.Request]]:
    return recording(*(httpx.Response(200, json=a, headers=headers) for a in answers))


async def test_the_bot_posts_first_then_edits_its_message() -> None:
    handler, seen = slack_api(
        {"ok": True, "channel": "C042", "ts": "1767225700.000100"},
        {"ok": True, "channel": "C042", "ts": "1767225700.000100"},
    )
    sink = SlackBotSink(slack_bot(), client_for(handler), 5.0)
    memo = await sink.send(sample_notification())
    assert memo == {"channel": "C042", "ts": "1767225700.000100"}
    assert await sink.send(sample_notification("resolved", seq=2, memo=memo)) == memo
    assert [r.url.path for r in seen] == ["/api/chat.postMessage", "/api/chat.update"]
    first, second = (json.loads(r.content) for r in seen)
    assert first["channel"] == "#oncall" and "ts" not in first and first["blocks"]
    assert second["channel"] == "C042" and second["ts"] == "1767225700.000100"
    assert seen[0].headers["authorization"] == f"Bearer {BOT_TOKEN}"
    assert seen[0].headers["content-type"] == "application/json; charset=utf-8"


async def test_a_vanished_message_is_posted_anew() -> None:
    handler, seen = slack_api({"ok": False, "error": "message_not_found"}, {"ok": True, "channel": "C1", "ts": "2.0"})
    memo = await SlackBotSink(slack_bot(), client_for(handler), 5.0).send(
        sample_notification(seq=2, memo={"channel": "C1", "ts": "1.0"})
    )
    assert memo == {"channel": "C1", "ts": "2.0"}
    assert [r.url.path for r in seen] == ["/api/chat.update", "/api/chat.postMessage"]


async def test_the_bot_sorts_slacks_ok_false_answers() -> None:
    handler, _ = slack_api({"ok": False, "error": "ratelimited"}, headers={"Retry-After": "3"})
    with pytest.raises(RetryableError) as limited:
        await SlackBotSink(slack_bot(), client_for(handler), 5.0).send(sample_notification())
    assert limited.value.retry_after == 3.0
    handler, _ = slack_api({"ok": False, "error": "invalid_auth"})
    with pytest.raises(RejectedError) as refused:
        await SlackBotSink(slack_bot(), client_for(handler), 5.0).send(sample_notification())
    assert refused.value.answer == "invalid_auth" and BOT_TOKEN not in f"{refused.value} {refused.value!r}"
    with pytest.raises(RejectedError, match="not a Slack Web API answer"):
        sink = SlackBotSink(slack_bot(), client_for(lambda _: httpx.Response(200, text="<html>")), 5.0)
        await sink.send(sample_notification())
    assert BOT_TOKEN not in repr(sink)


# -- PagerDuty -------------------------------------------------------------------------------


def test_a_trigger_carries_what_the_responder_needs() -> None:
    event = json.loads(build_event(sample_notification(), pagerduty().routing_key).body())
    assert event["routing_key"] == ROUTING_KEY and event["event_action"] == "trigger"
    assert event["dedup_key"] == f"servewatch/{GROUP_KEY}" and event["client"] == "servewatch"
    payload = event["payload"]
    assert (payload["severity"], payload["source"], payload["component"]) == ("critical", MODEL, MODEL)
    assert payload["group"] == CAUSE and payload["class"] == "ttft, prefill_time, cache_hit_rate"
    assert datetime.fromisoformat(payload["timestamp"]).tzinfo is not None
    details = payload["custom_details"]
    assert details["members"] == 3 and details["hints"][0].startswith(f"{CAUSE}: ")
    assert details["lead"]["observed"] == 4.21 and details["lead"]["load"]["requests_per_s"] == 12.4
    assert details["lead"]["segment"] == {"model": MODEL, "route": "chat", "prompt_band": "1k-4k"}
    assert [r["request_id"] for r in details["evidence"]] == ["req-7f3a9c", "req-b81e02", "req-uniform-01"]
    assert all("location" not in r for r in details["evidence"])
    assert [link["text"] for link in event["links"]] == ["Triage", "Runbook"]


def test_a_resolve_is_bare_and_resolves_what_was_triggered() -> None:
    trigger = json.loads(build_event(sample_notification(), pagerduty().routing_key).body())
    resolve = json.loads(build_event(sample_notification("resolved", seq=2), pagerduty().routing_key).body())
    assert resolve == {"routing_key": ROUTING_KEY, "event_action": "resolve", "dedup_key": trigger["dedup_key"]}


@pytest.mark.parametrize(
    ("ours", "theirs"), [(Severity.CRITICAL, "critical"), (Severity.WARNING, "warning"), (Severity.INFO, "info")]
)
def test_severities_map_to_pagerdutys(ours: Severity, theirs: str) -> None:
    note = sample_notification()
    note = dataclasses.replace(note, group=note.group.model_copy(update={"severity": ours}))
    assert build_event(note, pagerduty().routing_key).payload.severity == theirs  # type: ignore[union-attr]


def test_pagerduty_limits_hold_for_huge_content() -> None:
    note = huge(sample_notification())
    long_key = "k" * 600
    note = dataclasses.replace(note, group=note.group.model_copy(update={"group": long_key}))
    trigger = build_event(note, pagerduty().routing_key)
    assert trigger.payload is not None and len(trigger.payload.summary) <= 1024
    assert len(trigger.dedup_key) <= 255
    resolved = dataclasses.replace(note, group=note.group.model_copy(update={"status": Status.RESOLVED}))
    assert build_event(resolved, pagerduty().routing_key).dedup_key == trigger.dedup_key == dedup_key(long_key)
    with pytest.raises(ValidationError):
        Event(routing_key=ROUTING_KEY, event_action="resolve", dedup_key="x" * 256)  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        Event(routing_key=ROUTING_KEY, event_action="trigger", dedup_key="k")  # type: ignore[arg-type]


async def test_pagerduty_keeps_its_dedup_key_and_never_tells_the_routing_key() -> None:
    answer = {"status": "success", "message": "Event processed", "dedup_key": f"servewatch/{GROUP_KEY}"}
    handler, seen = recording(httpx.Response(202, json=answer))
    sink = PagerDutySink(pagerduty(), client_for(handler), 5.0)
    assert await sink.send(sample_notification()) == {"dedup_key": f"servewatch/{GROUP_KEY}"}
    assert str(seen[0].url) == "https://pd.test/v2/enqueue"

    def echo(request: httpx.Request) -> httpx.Response:  # a receiver quoting the event back
        return httpx.Response(400, text=f"invalid event: {request.content.decode()}")

    sink = PagerDutySink(pagerduty(), client_for(echo), 5.0)
    with pytest.raises(RejectedError) as refused:
        await sink.send(sample_notification())
    said = f"{refused.value} {refused.value!r} {refused.value.answer} {sink!r}"
    said += repr(build_event(sample_notification(), pagerduty().routing_key))
    assert ROUTING_KEY not in said and "[redacted]" in refused.value.answer


# -- Alertmanager ----------------------------------------------------------------------------


async def test_each_member_is_an_alert_alertmanager_expires_unless_resent() -> None:
    config = Alertmanager(name="am", type="alertmanager", url="http://am.test:9093/", bearer_token=AM_TOKEN)  # type: ignore[arg-type]
    timing = Timing(group_wait=0, group_interval=60, repeat_interval=60)
    handler, seen = recording(httpx.Response(200))
    note = sample_notification()
    assert await AlertmanagerSink(config, timing, client_for(handler), 5.0).send(note) == {}
    assert str(seen[0].url) == "http://am.test:9093/api/v2/alerts"
    assert seen[0].headers["authorization"] == f"Bearer {AM_TOKEN}"
    alerts = json.loads(seen[0].content)
    assert len(alerts) == 3
    first = alerts[0]
    assert first["labels"] == {
        "alertname": f"servewatch_{CAUSE}",
        "model": MODEL,
        "signal": "ttft",
        "severity": "critical",
        "group": GROUP_KEY,
        "route": "chat",
        "prompt_band": "1k-4k",
    }
    assert first["annotations"]["summary"] == note.members[0].summary
    assert first["annotations"]["description"] == note.group.title
    assert first["annotations"]["hints"].startswith(f"{CAUSE}: cached prompt tokens fell")
    assert first["annotations"]["runbook_url"] == note.runbook_url
    assert first["generatorURL"] == note.triage_url
    assert first["startsAt"] == rfc3339(note.members[0].window_start)
    assert first["endsAt"] == rfc3339(note.sent_at + 3 * 60 + 60)


def test_a_resolved_member_ends_when_it_resolved() -> None:
    note = sample_notification("resolved", triage_url=None)
    alerts = build_alerts(note, Timing())
    assert [a.endsAt for a in alerts] == [rfc3339(m.window_end) for m in note.members]
    assert alerts[0].generatorURL == "" and "triage_url" not in alerts[0].annotations


def test_labels_follow_prometheus_rules() -> None:
    note = sample_notification()
    odd = note.members[0].model_copy(
        update={"segment": {"model": MODEL, "prompt-band": "1k", "9x": "y", "__name__": "n", "severity": "info"}}
    )
    note = dataclasses.replace(note, members=(odd,), group=note.group.model_copy(update={"cause": "signal:ttft"}))
    labels = build_alerts(note, Timing())[0].labels
    assert labels["alertname"] == "servewatch_signal_ttft"
    assert labels["prompt_band"] == "1k" and labels["_9x"] == "y" and labels["name__"] == "n"
    assert labels["severity"] == "critical"  # a segment label never relabels the alert
    assert (label_name("a.b-c"), label_name("__")) == ("a_b_c", "label")
    with pytest.raises(ValidationError):
        PostableAlert(labels={"bad-name": "x"}, startsAt=rfc3339(0), endsAt=rfc3339(60))
    with pytest.raises(ValidationError):
        PostableAlert(labels={"a": "x"}, startsAt=rfc3339(60), endsAt=rfc3339(60))


# -- Webhook ---------------------------------------------------------------------------------


async def test_the_webhook_sends_the_group_signed() -> None:
    config = Webhook(
        name="hook", type="webhook", url="https://hooks.test/in", secret="whsec",  # type: ignore[arg-type]
        headers={"X-Api-Key": "k-123456", "content-type": "text/plain"},
    )  # fmt: skip
    handler, seen = recording(httpx.Response(204))
    note = sample_notification(seq=4)
    assert await WebhookSink(config, client_for(handler), 5.0, clock=lambda: 1767226000.7).send(note) == {}
    request = seen[0]
    body = json.loads(request.content)
    assert set(body) == {"group", "members", "status", "transition", "seq", "idempotency_key", "sent_at"}
    assert body["group"]["group"] == GROUP_KEY and len(body["members"]) == 3 and body["seq"] == 4
    assert body["members"][0]["evidence"][1]["request_id"] == "req-7f3a9c"
    assert request.headers["idempotency-key"] == note.idempotency_key == body["idempotency_key"]
    assert request.headers["content-type"] == "application/json" and request.headers["x-api-key"] == "k-123456"
    timestamp, signature = int(request.headers["x-servewatch-timestamp"]), request.headers["x-servewatch-signature"]
    assert timestamp == 1767226000 and signature.startswith("v1=")
    assert verify(b"whsec", timestamp, request.content, signature, now=1767226010.0)
    assert not verify(b"whsec", timestamp, request.content.replace(b'"seq":4', b'"seq":5'), signature, now=1767226010.0)
    assert not verify(b"other", timestamp, request.content, signature, now=1767226010.0)
    assert not verify(b"whsec", timestamp, request.content, signature, now=1767226000.0 + 301)  # a replay
    assert verify(b"whsec", timestamp, request.content, f"v1=00, {signature}", now=1767226010.0)  # rotation


async def test_an_unsigned_webhook_has_no_signature_headers() -> None:
    handler, seen = recording(httpx.Response(200))
    config = Webhook(name="hook", type="webhook", url="https://hooks.test/in")
    await WebhookSink(config, client_for(handler), 5.0).send(sample_notification())
    assert "x-servewatch-signature" not in seen[0].headers and "x-servewatch-timestamp" not in seen[0].headers
    assert sign(b"s", 1, b"{}") == sign(b"s", 1, b"{}") != sign(b"s", 2, b"{}")


# -- Building sinks --------------------------------------------------------------------------


async def test_build_sink_picks_the_type_and_its_timeout() -> None:
    notify = NotifyConfig.model_validate(
        {
            "retry": {"timeout": "7s"},
            "sinks": [
                {"name": "a", "type": "slack", "url": HOOK_URL, "retry": {"timeout": "3s"}},
                {"name": "b", "type": "slack_bot", "token": BOT_TOKEN, "channel": "#x"},
                {"name": "c", "type": "pagerduty", "routing_key": ROUTING_KEY},
                {"name": "d", "type": "alertmanager", "url": "http://am:9093"},
                {"name": "e", "type": "webhook", "url": "https://x.test"},
            ],
        }
    )
    async with httpx.AsyncClient() as client:
        sinks = [build_sink(config, notify, client) for config in notify.sinks]
    assert [type(s) for s in sinks] == [SlackWebhookSink, SlackBotSink, PagerDutySink, AlertmanagerSink, WebhookSink]
    assert [(s.name, s.type) for s in sinks] == [
        ("a", "slack"), ("b", "slack_bot"), ("c", "pagerduty"), ("d", "alertmanager"), ("e", "webhook"),
    ]  # fmt: skip
    assert [s._timeout for s in sinks] == [3.0, 7.0, 7.0, 7.0, 7.0]  # type: ignore[attr-defined]
    assert sinks[3]._timing.repeat_interval == 60.0  # type: ignore[attr-defined]
    shown = " ".join(repr(s) for s in sinks)
    assert "hooksecretXYZ" not in shown and BOT_TOKEN not in shown and ROUTING_KEY not in shown


def test_the_fixture_can_be_hostile_everywhere_a_log_reaches() -> None:
    note = sample_notification(hostile=True)
    assert "<!channel>" in note.group.summary and "<!channel>" in note.members[0].segment["route"]
    assert any("<!channel>" in str(row.get("content_excerpt")) for row in note.members[0].evidence)
    assert note.members[0].signal is Signal.TTFT and note.sink == "s"


@pytest.mark.parametrize(
    "url, secret",
    [
        ("https://hooks.test/in?token=S3CR3T-T0K3N", "S3CR3T-T0K3N"),
        ("https://hooks.test/hooks/S3CR3T-PATH-T0K3N", "S3CR3T-PATH-T0K3N"),
        ("https://bot:S3CR3T-PASSW0RD@hooks.test/in", "S3CR3T-PASSW0RD"),
    ],
)
async def test_a_receiver_quoting_its_url_back_leaks_no_credential(url: str, secret: str) -> None:
    # A proxy's error page that echoes the request line: the refusal's message and answer are
    # what the notifier logs and writes to the deliveries and dead-letter topics.
    def echo(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, text=f"bad request: POST {request.url} ({request.url.query.decode()})")

    config = Webhook(name="hook", type="webhook", url=url)  # type: ignore[arg-type]
    assert secret not in repr(config) and secret not in str(config.model_dump())
    with pytest.raises(RejectedError) as refused:
        await WebhookSink(config, client_for(echo), 5.0).send(sample_notification())
    assert secret not in str(refused.value) and secret not in refused.value.answer
    assert "[redacted]" in refused.value.answer


def _sink_at(kind: str, url: str, client: httpx.AsyncClient) -> Any:
    if kind == "pagerduty":
        return PagerDutySink(PagerDuty(name="pd", type="pagerduty", routing_key=ROUTING_KEY, url=url), client, 5.0)  # type: ignore[arg-type]
    if kind == "alertmanager":
        config = Alertmanager(name="am", type="alertmanager", url=url)  # type: ignore[arg-type]
        return AlertmanagerSink(config, Timing(group_wait=0, group_interval=60, repeat_interval=60), client, 5.0)
    config = SlackBot(name="bot", type="slack_bot", token=BOT_TOKEN, channel="#oncall", api_url=url)  # type: ignore[arg-type]
    return SlackBotSink(config, client, 5.0)


@pytest.mark.parametrize("kind", ["pagerduty", "alertmanager", "slack_bot"])
@pytest.mark.parametrize("status", [400, 200])
@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("https://relay.test/hook/x9Y8z7W6v5U4t3S2", "x9Y8z7W6v5U4t3S2"),
        ("https://relay.test/in?token=S3CR3T-T0K3N", "S3CR3T-T0K3N"),
        ("https://bot:S3CR3T-PASSW0RD@relay.test/in", "S3CR3T-PASSW0RD"),
    ],
)
async def test_every_sinks_url_is_a_secret_kept_out_of_what_its_failures_say(
    kind: str, status: int, url: str, secret: str
) -> None:
    # A relay or proxy in front of PagerDuty, Alertmanager or Slack's Web API whose error page
    # quotes the request line back; with 200 too, as a captive portal answers.
    def echo(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, text=f"<html>no such route: {request.url.raw_path.decode()}</html>")

    sink = _sink_at(kind, url, client_for(echo))
    config = sink._config
    assert secret not in repr(sink) and secret not in repr(config) and secret not in str(config.model_dump())
    try:
        await sink.send(sample_notification())
    except RejectedError as refused:
        assert secret not in str(refused) and secret not in refused.answer
    else:
        assert status == 200 and kind != "slack_bot"  # a 2xx is accepted where no answer is read


async def test_a_webhooks_first_message_of_a_group_is_its_firing_whatever_the_groups_record_says() -> None:
    handler, seen = recording(httpx.Response(200), httpx.Response(200))
    sink = WebhookSink(Webhook(name="hook", type="webhook", url="https://hooks.test/in"), client_for(handler), 5.0)  # type: ignore[arg-type]
    first = sample_notification()
    moved_on = first.group.model_copy(update={"transition": "update"})  # after group_wait: an update already
    await sink.send(sample_notification(group=moved_on))
    await sink.send(sample_notification(seq=2, group=moved_on))
    bodies = [json.loads(request.content) for request in seen]
    assert [body["transition"] for body in bodies] == ["firing", "update"]
    assert bodies[0]["group"]["transition"] == "update"  # the record itself, as on the anomaly topic
