"""Links out of the triage page, into the tools people already use.

servewatch keeps a few requests per incident, never the logs: the logs stay in the user's
own search (Kibana Discover, Grafana Explore with Loki...). ``LinkTemplates`` turns an
evidence record into a link to that search (by request id and a time range around the
request) and a segment into a link to its dashboard, from URL templates in the settings.
Every value is URL-quoted, so request content cannot change where a link goes, and a
template must be http(s), so no setting can make the page run a ``javascript:`` link.

``GrafanaAnnotator`` marks firing and resolved groups on Grafana's dashboards
(``POST /api/annotations``), best effort: a Grafana that is down costs a warning, never the page.
"""

from __future__ import annotations

import html
import logging
import string
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import SecretStr

from servewatch.models.windows.segment_keys import DIMENSIONS
from servewatch.schemas.incident_group import IncidentGroup

logger = logging.getLogger(__name__)

TIME_FIELDS = ("start", "end", "start_ms", "end_ms")
EVIDENCE_FIELDS = frozenset({"request_id", "model", "instance", "route", "tenant", *TIME_FIELDS})
SEGMENT_FIELDS = frozenset({"segment", *DIMENSIONS, *TIME_FIELDS})
#: How far around a request its log search looks: clocks of hosts and shippers differ.
EVIDENCE_MARGIN_S = 60.0
#: A segment's dashboard link shows the hours the page keeps.
SEGMENT_SPAN_S = 6 * 3600.0


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _times(start: float, end: float) -> dict[str, str]:
    return {"start": _iso(start), "end": _iso(end), "start_ms": str(int(start * 1000)), "end_ms": str(int(end * 1000))}


def _check(template: str | None, allowed: frozenset[str], what: str) -> None:
    if template is None:
        return
    if not template.startswith(("http://", "https://")):
        raise ValueError(f"{what} URL template must start with http:// or https://: {template!r}")
    names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    unknown = names - allowed
    if unknown:
        raise ValueError(f"{what} URL template has unknown fields {sorted(unknown)}; known: {sorted(allowed)}")


def _fill(template: str, values: Mapping[str, object]) -> str:
    quoted = {name: quote(str(value), safe="") for name, value in values.items()}
    return template.format_map(_Blank(quoted))


class _Blank(dict[str, str]):
    """A missing field (a label the segment does not have) is empty, not an error."""

    def __missing__(self, key: str) -> str:
        return ""


@dataclass(frozen=True)
class LinkTemplates:
    """``evidence``: fields {request_id}, {model}, {instance}, {route}, {tenant}; ``segment``:
    {segment} (its key) and each label ({model}, {route}, ...). Both: {start}, {end}
    (ISO-8601 UTC) and {start_ms}, {end_ms} (Unix milliseconds, as Grafana wants them)."""

    evidence: str | None = None
    segment: str | None = None

    def __post_init__(self) -> None:
        _check(self.evidence, EVIDENCE_FIELDS, "evidence")
        _check(self.segment, SEGMENT_FIELDS, "segment")

    def evidence_url(self, record: Mapping[str, Any], segment: Mapping[str, str]) -> str | None:
        """A log search for one evidence record, or None (no template, or no request id)."""
        request_id = record.get("request_id")
        if self.evidence is None or not request_id:
            return None
        finished = record.get("timestamp")
        if not isinstance(finished, int | float):
            return None
        took = record.get("e2e_s")
        began = finished - (took if isinstance(took, int | float) and took > 0 else 0.0)
        values: dict[str, object] = {"request_id": request_id, **_times(began - EVIDENCE_MARGIN_S,
                                                                      finished + EVIDENCE_MARGIN_S)}  # fmt: skip
        for name in ("model", "instance", "route", "tenant"):
            values[name] = record.get(name) or segment.get(name, "")
        return _fill(self.evidence, values)

    def segment_url(self, key: str, segment: Mapping[str, str], until: float) -> str | None:
        """The segment's dashboard over the hours before ``until``, or None without a template."""
        if self.segment is None:
            return None
        return _fill(self.segment, {**segment, "segment": key, **_times(until - SEGMENT_SPAN_S, until)})


class GrafanaAnnotator:
    """Posts a Grafana annotation when a group fires and when it resolves.

    The web process reads the anomaly topic from its start, so only records whose window
    ended within ``recent_s`` of now are annotated (a restart does not repaint history), and
    each record at most once.
    """

    def __init__(
        self,
        url: str,
        api_token: SecretStr,
        client: httpx.AsyncClient,
        *,
        recent_s: float = 900.0,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.endpoint = url.rstrip("/") + "/api/annotations"
        self._token, self._client, self.recent_s, self._now = api_token, client, recent_s, now
        self._done: OrderedDict[str, None] = OrderedDict()

    def body(self, group: IncidentGroup) -> dict[str, Any]:
        # Grafana renders annotation text as HTML (sanitised): escape what came from records.
        text = html.escape(f"{group.transition}: {group.title}")
        return {"time": int(group.window_start * 1000), "timeEnd": int(group.window_end * 1000),
                "tags": ["servewatch", group.model, group.cause], "text": text}  # fmt: skip

    async def annotate(self, group: IncidentGroup) -> bool:
        """True when Grafana accepted an annotation for this record."""
        if group.transition not in ("firing", "resolved") or group.id in self._done:
            return False
        if self._now() - group.window_end > self.recent_s:
            return False
        self._done[group.id] = None
        while len(self._done) > 10_000:
            self._done.popitem(last=False)
        headers = {"Authorization": f"Bearer {self._token.get_secret_value()}"}
        try:
            response = await self._client.post(self.endpoint, json=self.body(group), headers=headers)
        except httpx.HTTPError as exc:
            logger.warning("Grafana annotation for group %s failed: %s", group.group, type(exc).__name__)
            return False
        if response.status_code >= 400:
            logger.warning("Grafana refused the annotation for group %s: HTTP %d", group.group, response.status_code)
            return False
        return True
