"""Alertmanager ``POST /api/v2/alerts``: each member incident of a group as one alert, so
Alertmanager's own routing, grouping, inhibition and silences apply to servewatch too.

Alertmanager resolves an alert whose ``endsAt`` passes without it being sent again (the
way Prometheus alerts end when Prometheus stops sending them). A firing alert's ``endsAt``
is therefore set past the next time this sink re-sends it: three repeat intervals and a
group interval after this notification, room for a missed re-send or two. A resolved
member carries its own end, which is in the past: Alertmanager resolves it at once.

>>> label_name("prompt-band"), label_name("9lives"), label_name("__name__"), label_name("")
('prompt_band', '_9lives', 'name__', 'label')
"""

from __future__ import annotations

import logging
import re
from datetime import datetime

import httpx
import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from servewatch.pipeline.notify.config import Alertmanager, Timing
from servewatch.pipeline.notify.notification import Notification
from servewatch.pipeline.notify.sinks.content import hint_text, rfc3339
from servewatch.pipeline.notify.sinks.redact import post_hiding
from servewatch.schemas.anomaly import AnomalyEvent, Status

logger = logging.getLogger(__name__)

#: Prometheus label names; a leading "__" is reserved for Prometheus' own.
LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_NOT_IN_NAME = re.compile(r"[^a-zA-Z0-9_]")
ALERTNAME_PREFIX = "servewatch_"
#: Re-sends a firing alert may miss before Alertmanager resolves it on its own.
MISSED_RESENDS = 3


def label_name(name: str) -> str:
    """``name`` made a valid Prometheus label name that Prometheus does not reserve."""
    name = _NOT_IN_NAME.sub("_", name)
    if name.startswith("__"):
        name = name.lstrip("_")
    if not name:
        return "label"
    return f"_{name}" if name[0].isdigit() else name


class PostableAlert(BaseModel):
    """One alert as ``/api/v2/alerts`` takes it (Alertmanager's ``postableAlert``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Alertmanager's own field names, so the model reads like its API reference.
    labels: dict[str, str] = Field(min_length=1)
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: str
    endsAt: str
    generatorURL: str = ""

    @field_validator("labels")
    @classmethod
    def _label_names(cls, labels: dict[str, str]) -> dict[str, str]:
        bad = [name for name in labels if not LABEL_NAME.match(name) or name.startswith("__")]
        if bad:
            raise ValueError(f"invalid label names: {', '.join(sorted(bad))}")
        if any(value == "" for value in labels.values()):
            raise ValueError("label values must not be empty (Alertmanager reads them as absent)")
        return labels

    @field_validator("startsAt", "endsAt")
    @classmethod
    def _rfc3339(cls, value: str) -> str:
        when = datetime.fromisoformat(value)  # raises ValueError on anything else
        if when.tzinfo is None:
            raise ValueError("a time needs its zone (RFC 3339), e.g. 2026-01-01T00:00:00Z")
        return value

    @model_validator(mode="after")
    def _order(self) -> PostableAlert:
        if datetime.fromisoformat(self.endsAt) <= datetime.fromisoformat(self.startsAt):
            raise ValueError("endsAt must be after startsAt")
        return self


def _labels(note: Notification, member: AnomalyEvent) -> dict[str, str]:
    group = note.group
    cause = _NOT_IN_NAME.sub("_", group.cause)
    own = {
        "alertname": ALERTNAME_PREFIX + cause,
        "model": member.segment.get("model") or group.model,
        "signal": member.signal.value,
        "severity": member.severity.value,
        "group": group.group,
    }
    segment = {label_name(name): value for name, value in member.segment.items()}
    # Ours win: a segment label that sanitises to "severity" must not relabel the alert.
    return {name: value for name, value in {**segment, **own}.items() if value}


def _annotations(note: Notification, member: AnomalyEvent) -> dict[str, str]:
    shown = {
        "summary": member.summary,
        "description": note.group.title,
        "hints": "; ".join(hint_text(h) for h in member.hints),
        "runbook_url": note.runbook_url or "",
        "triage_url": note.triage_url or "",
    }
    return {name: text for name, text in shown.items() if text}


def build_alerts(note: Notification, timing: Timing) -> list[PostableAlert]:
    """One alert per member of ``note``'s group, firing or resolved as the member is."""
    alerts = []
    for member in note.members:
        if member.status is Status.RESOLVED:
            ends = member.window_end  # when it resolved
        else:
            ends = note.sent_at + MISSED_RESENDS * timing.repeat_interval + timing.group_interval
        ends = max(ends, member.window_start + 1.0)  # a clock behind the events' must not invert them
        alerts.append(
            PostableAlert(
                labels=_labels(note, member),
                annotations=_annotations(note, member),
                startsAt=rfc3339(member.window_start),
                endsAt=rfc3339(ends),
                generatorURL=note.triage_url or "",
            )
        )
    return alerts


class AlertmanagerSink:
    type = "alertmanager"

    def __init__(self, config: Alertmanager, timing: Timing, client: httpx.AsyncClient, timeout: float = 10.0) -> None:
        self.name = config.name
        self._config, self._timing, self._client, self._timeout = config, timing, client, timeout

    def __repr__(self) -> str:
        return f"AlertmanagerSink(name={self.name!r})"

    async def send(self, note: Notification) -> dict[str, str]:
        alerts = build_alerts(note, self._timing)
        if not alerts:
            logger.debug("%s: group %s has no members to send", self.name, note.key)
            return {}
        headers = {"Content-Type": "application/json"}
        token = self._config.bearer_token.get_secret_value() if self._config.bearer_token else ""
        if token:
            headers["Authorization"] = f"Bearer {token}"
        body = orjson.dumps([alert.model_dump(mode="json") for alert in alerts])
        url = f"{self._config.url.get_secret_value().rstrip('/')}/api/v2/alerts"
        await post_hiding(self._client, url, content=body, headers=headers, timeout=self._timeout, secrets=[token])
        return {}
