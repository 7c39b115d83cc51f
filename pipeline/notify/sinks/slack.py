"""Slack: a group's notification as a Block Kit message, through an incoming webhook (a new
message each time) or a bot token (one message per group, edited as the group moves).

The message leads with what a person on call decides on (status, severity, cause, where,
how far off, whether load explains it), then why (hints) and what to look up (requests),
then links. Every string that came from logs or events goes through ``escape_mrkdwn``.
"""

from __future__ import annotations

import logging

import httpx
import orjson

from servewatch.pipeline.notify.config import SlackBot, SlackWebhook
from servewatch.pipeline.notify.notification import Notification
from servewatch.pipeline.notify.sinks.base import RejectedError, RetryableError, retry_after_s
from servewatch.pipeline.notify.sinks.content import (
    duration_text,
    evidence_line,
    figure,
    load_text,
    pick_evidence,
    segment_text,
)
from servewatch.pipeline.notify.sinks.redact import hide, post_hiding, url_secrets
from servewatch.pipeline.notify.sinks.slack_blocks import (
    BUTTON_CHARS,
    FIELD_CHARS,
    HEADER_CHARS,
    URL_CHARS,
    Actions,
    Block,
    Button,
    Context,
    Header,
    Message,
    Section,
    Text,
    escape_mrkdwn,
    message,
    mrkdwn,
    plain,
)
from servewatch.schemas.anomaly import Severity, Status

logger = logging.getLogger(__name__)

SEVERITY_EMOJI = {Severity.CRITICAL: "🔴", Severity.WARNING: "🟠", Severity.INFO: "🔵"}
RESOLVED_EMOJI = "✅"
STEP_WORD = {"firing": "Firing", "update": "Update", "resolved": "Resolved"}
MAX_HINTS = 3
#: Slack Web API errors worth another try (api.slack.com/methods/chat.postMessage#errors).
TRANSIENT = frozenset({"ratelimited", "internal_error", "fatal_error", "service_unavailable", "request_timeout"})


def _field(name: str, value: str) -> Text:
    return mrkdwn(f"*{name}*\n{escape_mrkdwn(value)}", FIELD_CHARS)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _links(note: Notification) -> list[Actions]:
    buttons = [
        Button(text=plain(label, BUTTON_CHARS), url=url, action_id=f"servewatch_{label.lower()}")
        for label, url in (("Triage", note.triage_url), ("Runbook", note.runbook_url))
        if url and url.startswith(("https://", "http://")) and len(url) <= URL_CHARS  # else Slack refuses it all
    ]
    return [Actions(elements=buttons)] if buttons else []


def _context(note: Notification) -> Context:
    group = note.group
    said = [f"{_count(len(group.members), 'incident')} in {_count(group.segments, 'segment')}"]
    if note.status is Status.RESOLVED:
        said.append(f"lasted {duration_text(group.window_end - group.window_start)}")
    said.append(f"key {escape_mrkdwn(note.idempotency_key)}")
    return Context(elements=[mrkdwn(" · ".join(said))])


def build_message(note: Notification) -> Message:
    """The Block Kit message for ``note``: full while firing, short once resolved."""
    group, lead = note.group, note.lead
    title = escape_mrkdwn(group.title)
    if note.status is Status.RESOLVED:
        head = f"{RESOLVED_EMOJI} Resolved · {title}"
        blocks: list[Block] = [
            Header(text=plain(head, HEADER_CHARS)),
            Section(text=mrkdwn(escape_mrkdwn(group.summary))),
        ]
        return message(f"Resolved: {title}", [*blocks, *_links(note), _context(note)])
    step = STEP_WORD[note.step]
    head = f"{SEVERITY_EMOJI[group.severity]} {step} · {group.severity.value} · {title}"
    blocks = [Header(text=plain(head, HEADER_CHARS)), Section(text=mrkdwn(escape_mrkdwn(group.summary)))]
    fields = [
        _field("Severity", group.severity.value),
        _field("Model", group.model),
        _field("Signals", ", ".join(s.value for s in group.signals)),
    ]
    if lead is not None:
        observed = f"{figure(lead.signal, lead.observed)} vs {figure(lead.signal, lead.expected)} expected"
        fields += [
            _field("Segment", segment_text(lead.segment)),
            _field(f"Observed ({lead.signal.value})", observed),
            _field("Load", load_text(lead.load)),
            _field("Explained by load", "yes" if lead.explained_by_load else "no"),
        ]
        if instance := lead.segment.get("instance"):  # a replica to drain: its own field, first to read
            fields.insert(2, _field("Instance", instance))
    blocks.append(Section(fields=fields))
    if lead is not None and lead.hints:
        lines = [f"• *{escape_mrkdwn(h.code)}*: {escape_mrkdwn(h.message)}" for h in lead.hints[:MAX_HINTS]]
        blocks.append(Section(text=mrkdwn("*Likely causes*\n" + "\n".join(lines))))
    if lead is not None and (rows := pick_evidence(lead.evidence)):
        lines = [f"• {escape_mrkdwn(evidence_line(row))}" for row in rows]
        blocks.append(Section(text=mrkdwn("*Requests to look at*\n" + "\n".join(lines))))
    fallback = f"{step} {group.severity.value}: {title}"
    return message(fallback, [*blocks, *_links(note), _context(note)])


def _body(msg: Message, **extra: str) -> bytes:
    return orjson.dumps({**extra, **msg.model_dump(mode="json", exclude_none=True)})


class SlackWebhookSink:
    """An incoming webhook: each notification is a new message (a webhook cannot edit)."""

    type = "slack"

    def __init__(self, config: SlackWebhook, client: httpx.AsyncClient, timeout: float = 10.0) -> None:
        self.name = config.name
        self._config, self._client, self._timeout = config, client, timeout

    def __repr__(self) -> str:
        return f"SlackWebhookSink(name={self.name!r})"  # never the URL: it is the secret

    async def send(self, note: Notification) -> dict[str, str]:
        url = self._config.url.get_secret_value()
        headers = {"Content-Type": "application/json"}
        body = _body(build_message(note))
        await post_hiding(self._client, url, content=body, headers=headers, timeout=self._timeout, secrets=[url])
        return {}


class SlackBotSink:
    """A bot token: ``chat.postMessage`` for a group's first notification, ``chat.update`` of
    that message (its ``channel`` and ``ts``, kept in the memo) for the later ones."""

    type = "slack_bot"

    def __init__(self, config: SlackBot, client: httpx.AsyncClient, timeout: float = 10.0) -> None:
        self.name = config.name
        self._config, self._client, self._timeout = config, client, timeout

    def __repr__(self) -> str:
        return f"SlackBotSink(name={self.name!r}, channel={self._config.channel!r})"

    async def send(self, note: Notification) -> dict[str, str]:
        msg = build_message(note)
        ts = note.memo.get("ts")
        if ts:
            channel = note.memo.get("channel") or self._config.channel
            try:
                return await self._call("chat.update", _body(msg, channel=channel, ts=ts))
            except RejectedError as exc:
                if exc.answer != "message_not_found":
                    raise
                # Deleted by someone, or the channel's history expired: tell it anew.
                logger.info("%s: message %s in %s is gone, posting a new one", self.name, ts, channel)
        return await self._call("chat.postMessage", _body(msg, channel=self._config.channel))

    async def _call(self, method: str, body: bytes) -> dict[str, str]:
        """One Web API call; its ``{"ok": false, "error": ...}`` answers sorted like HTTP failures."""
        token = self._config.token.get_secret_value()
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json; charset=utf-8"}
        url = f"{self._config.api_url.get_secret_value().rstrip('/')}/{method}"
        response = await post_hiding(
            self._client, url, content=body, headers=headers, timeout=self._timeout, secrets=[token]
        )
        try:
            answer = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):  # a proxy's page, which may quote the request back
            text = hide(response.text[:200], [token, *url_secrets(url)])
            raise RejectedError(f"{method}: not a Slack Web API answer", response.status_code, text)
        if answer.get("ok") is True:
            return {"channel": str(answer.get("channel", "")), "ts": str(answer.get("ts", ""))}
        error = str(answer.get("error", "unknown_error"))
        if error in TRANSIENT:
            raise RetryableError(f"{method}: {error}", retry_after_s(response.headers.get("retry-after")))
        raise RejectedError(f"{method}: {error}", response.status_code, error)
