"""PagerDuty Events API v2: a group triggers one alert, its updates refresh it, and its
resolution resolves it, all under one ``dedup_key`` derived from the group's key.

PagerDuty refuses an event whose summary is over 1,024 characters or whose dedup key is
over 255, so the models check both and ``build_event`` cuts to fit. The routing key is a
``SecretStr``: it is revealed only in the JSON sent, never in a repr, a log or an error.

>>> dedup_key("3f2a9c4be1d07a55")
'servewatch/3f2a9c4be1d07a55'
>>> len(dedup_key("x" * 400))
43
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Literal

import httpx
import orjson
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_serializer, model_validator

from servewatch.pipeline.notify.config import PagerDuty
from servewatch.pipeline.notify.notification import Notification
from servewatch.pipeline.notify.sinks.content import clip, hint_text, pick_evidence, rfc3339
from servewatch.pipeline.notify.sinks.redact import post_hiding
from servewatch.schemas.anomaly import Severity, Status

logger = logging.getLogger(__name__)

SUMMARY_CHARS = 1024
DEDUP_CHARS = 255
DEDUP_PREFIX = "servewatch/"
#: Enough hints and words for the incident page; PagerDuty takes events up to 512 KB.
MAX_HINTS = 10
DETAIL_CHARS = 4000
PDSeverity = Literal["critical", "error", "warning", "info"]
SEVERITY: dict[Severity, PDSeverity] = {
    Severity.CRITICAL: "critical",
    Severity.WARNING: "warning",
    Severity.INFO: "info",
}


def dedup_key(group_key: str) -> str:
    """The group's key under servewatch's prefix; a hash of it if that would be too long.
    The same for a group's trigger and resolve, so PagerDuty resolves what it triggered."""
    key = DEDUP_PREFIX + group_key
    if len(key) <= DEDUP_CHARS:
        return key
    return DEDUP_PREFIX + hashlib.blake2b(group_key.encode(), digest_size=16).hexdigest()


class Link(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    href: str
    text: str


class Payload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    summary: str = Field(min_length=1, max_length=SUMMARY_CHARS)
    source: str = Field(min_length=1)
    severity: PDSeverity
    timestamp: str | None = None
    component: str | None = None
    group: str | None = None
    class_: str | None = Field(default=None, serialization_alias="class")
    custom_details: dict[str, Any] = Field(default_factory=dict)


class Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    routing_key: SecretStr
    event_action: Literal["trigger", "resolve"]
    dedup_key: str = Field(min_length=1, max_length=DEDUP_CHARS)
    payload: Payload | None = None
    links: list[Link] | None = None
    client: str | None = None
    client_url: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> Event:
        if (self.event_action == "trigger") != (self.payload is not None):
            raise ValueError("a trigger carries a payload, a resolve does not")
        if self.event_action == "resolve" and (self.links or self.client or self.client_url):
            raise ValueError("a resolve carries only routing_key, event_action and dedup_key")
        return self

    @field_serializer("routing_key", when_used="json")
    def _reveal(self, key: SecretStr) -> str:
        return key.get_secret_value()  # on the wire only; repr and str keep it masked

    def body(self) -> bytes:
        return self.model_dump_json(exclude_none=True, by_alias=True).encode()


def _details(note: Notification) -> dict[str, Any]:
    group, lead = note.group, note.lead
    details: dict[str, Any] = {
        "title": group.title,
        "summary": clip(group.summary, DETAIL_CHARS),
        "cause": group.cause,
        "model": group.model,
        "members": len(group.members),
        "segments": group.segments,
        "signals": [s.value for s in group.signals],
        "idempotency_key": note.idempotency_key,
    }
    if lead is not None:
        details["hints"] = [clip(hint_text(h), DETAIL_CHARS) for h in lead.hints[:MAX_HINTS]]
        details["lead"] = {
            "signal": lead.signal.value,
            "segment": dict(lead.segment),
            "observed": lead.observed,
            "expected": lead.expected,
            "load": lead.load,
            "explained_by_load": lead.explained_by_load,
        }
        if instance := lead.segment.get("instance"):  # the replica to drain, where event rules can match it
            details["instance"] = instance
        details["evidence"] = [
            {k: v for k, v in row.items() if k != "location"} for row in pick_evidence(lead.evidence)
        ]
    return details


def build_event(note: Notification, routing_key: SecretStr) -> Event:
    """``note`` as an Events API v2 event: ``trigger`` while firing (updates re-trigger the
    same alert), ``resolve`` once the group resolved."""
    group, key = note.group, dedup_key(note.key)
    if note.status is Status.RESOLVED:
        return Event(routing_key=routing_key, event_action="resolve", dedup_key=key)
    payload = Payload(
        summary=clip(
            group.summary if group.summary.startswith(group.title) else f"{group.title}: {group.summary}", SUMMARY_CHARS
        ),
        source=group.model or "servewatch",
        severity=SEVERITY[group.severity],
        timestamp=rfc3339(group.window_end),  # when the window that moved the group ended
        component=group.model or None,
        group=group.cause,
        class_=", ".join(s.value for s in group.signals) or None,
        custom_details=_details(note),
    )
    links = [
        Link(href=url, text=text) for text, url in (("Triage", note.triage_url), ("Runbook", note.runbook_url)) if url
    ]
    return Event(
        routing_key=routing_key,
        event_action="trigger",
        dedup_key=key,
        payload=payload,
        links=links or None,
        client="servewatch",
        client_url=note.triage_url,
    )


class PagerDutySink:
    type = "pagerduty"

    def __init__(self, config: PagerDuty, client: httpx.AsyncClient, timeout: float = 10.0) -> None:
        self.name = config.name
        self._config, self._client, self._timeout = config, client, timeout

    def __repr__(self) -> str:
        return f"PagerDutySink(name={self.name!r})"

    async def send(self, note: Notification) -> dict[str, str]:
        event = build_event(note, self._config.routing_key)
        secret = self._config.routing_key.get_secret_value()
        response = await post_hiding(
            self._client,
            self._config.url.get_secret_value(),
            content=event.body(),
            headers={"Content-Type": "application/json"},
            timeout=self._timeout,
            secrets=[secret],
        )
        try:
            answer = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            answer = {}
        # PagerDuty answers 202 {"status": "success", "dedup_key": ...}: its key is the one to keep.
        accepted = answer.get("dedup_key") if isinstance(answer, dict) else None
        return {"dedup_key": str(accepted or event.dedup_key)}
