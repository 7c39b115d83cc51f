"""Local stand-ins for the services servewatch pages: Slack, PagerDuty, Alertmanager, a webhook.

The demo and the notifier's integration tests need somewhere real to deliver to, over real
HTTP, without accounts or network: one aiohttp server on a free loopback port answers as

* Slack's incoming webhook (``POST /slack/{hook}``, answers ``ok``) and its Web API
  (``POST /slack-api/chat.postMessage`` and ``chat.update``, HTTP 200 with ``ok: true|false``);
* PagerDuty's Events API v2 (``POST /pagerduty/v2/enqueue``, 202 or 400 ``invalid event``);
* Alertmanager's ``POST /alertmanager/api/v2/alerts`` (200, or 400 on a malformed list);
* any webhook (``POST /webhook/{name}``; headers and raw bytes kept to check HMAC signatures).

The checks mirror the services' documented limits (PagerDuty's 32-character routing key,
1024-character summary and 255-character dedup key; Slack's ``no_text``, ``not_authed`` and
``message_not_found``; Alertmanager's non-empty label sets), so that a payload the real
service would refuse is refused here too. It keeps what it accepted (``received``), every attempt
(``attempts``), and, given ``log_path``, appends each accepted request to a JSON-lines file at
once, so a receiver in another process can still be counted (``read_log``).

Faults are scripted per kind while it runs: ``faults[kind]`` is a list consumed one fault per
request of that kind (``Fault.status(429, retry_after=2)``, ``Fault.delay(3)``), and
``down(kind, seconds)`` drops that kind's connections without an answer, as if unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from aiohttp import web

from servewatch.pipeline.dev.loopback import LoopbackServer, serve_until_signalled

logger = logging.getLogger(__name__)

PD_SEVERITIES = ("critical", "error", "warning", "info")
PD_ACTIONS = ("trigger", "acknowledge", "resolve")
DEMO_ROUTING_KEY = "servewatch-demo-routing-key-0000"  # PagerDuty integration keys are 32 characters
_ROUTES = {
    "slack": "/slack/{hook}",
    "slack_api": "/slack-api/{method}",
    "pagerduty": "/pagerduty/v2/enqueue",
    "alertmanager": "/alertmanager/api/v2/alerts",
    "webhook": "/webhook/{name}",
}
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
KINDS = tuple(_ROUTES)


@dataclass(frozen=True)
class Fault:
    """One scripted misbehaviour, consumed by the next request of its kind."""

    code: int | None = None  # answer this status instead of the normal one
    retry_after: float | None = None  # with a Retry-After header (seconds)
    body: str = ""
    seconds: float = 0.0  # wait this long, then answer normally

    @classmethod
    def status(cls, code: int, retry_after: float | None = None, body: str = "") -> Fault:
        return cls(code=code, retry_after=retry_after, body=body)

    @classmethod
    def delay(cls, seconds: float) -> Fault:
        return cls(seconds=seconds)


@dataclass
class Received:
    """One request: ``status`` is the HTTP status answered (0: connection dropped, no answer)."""

    kind: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: Any  # the parsed JSON, or None if it was not JSON
    at: float  # time.time() on arrival
    status: int = 0
    raw: bytes = b""
    fault: str = ""  # "", "status", "delay", "down" or "abandoned" (client left during a delay)


def _known(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    return kind


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _is_time(value: Any) -> bool:
    try:
        datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return False
    return isinstance(value, str)


def pagerduty_errors(event: Any) -> list[str]:
    """What PagerDuty's Events API v2 would object to in ``event`` (empty: valid)."""
    if not isinstance(event, dict):
        return ["Event object is invalid"]
    errors = []
    key, action, dedup = event.get("routing_key"), event.get("event_action"), event.get("dedup_key")
    if not isinstance(key, str) or not key:
        errors.append("'routing_key' is missing or blank")
    elif len(key) != 32:
        errors.append("Length of 'routing_key' is incorrect (should be 32 characters)")
    if action not in PD_ACTIONS:
        errors.append("'event_action' is missing or invalid (trigger, acknowledge or resolve)")
    if dedup is not None and (not isinstance(dedup, str) or len(dedup) > 255):
        errors.append("'dedup_key' must be a string of at most 255 characters")
    if action in ("acknowledge", "resolve") and not dedup:
        errors.append("'dedup_key' is required for acknowledge and resolve")
    if action == "trigger":
        payload = event.get("payload")
        if not isinstance(payload, dict):
            return [*errors, "'payload' is missing or not an object"]
        summary = payload.get("summary")
        if not isinstance(summary, str) or not summary:
            errors.append("'payload.summary' is missing or blank")
        elif len(summary) > 1024:
            errors.append("'payload.summary' is longer than 1024 characters")
        if not isinstance(payload.get("source"), str) or not payload["source"]:
            errors.append("'payload.source' is missing or blank")
        if payload.get("severity") not in PD_SEVERITIES:
            errors.append("'payload.severity' must be one of critical, error, warning, info")
    return errors


def alertmanager_errors(alerts: Any) -> list[str]:
    """What Alertmanager's ``POST /api/v2/alerts`` would object to (empty: valid)."""
    if not isinstance(alerts, list):
        return ["the body must be a JSON list of alerts"]
    errors = []
    for i, alert in enumerate(alerts):
        labels = alert.get("labels") if isinstance(alert, dict) else None
        if not isinstance(labels, dict) or not labels:
            errors.append(f"alert {i}: 'labels' must be a non-empty object")
            continue
        if not all(isinstance(v, str) and _LABEL_NAME.match(str(k)) for k, v in labels.items()):
            errors.append(f"alert {i}: label names must match [a-zA-Z_][a-zA-Z0-9_]*, values be strings")
        annotations = alert.get("annotations", {})
        if not isinstance(annotations, dict) or not all(isinstance(v, str) for v in annotations.values()):
            errors.append(f"alert {i}: 'annotations' must map names to strings")
        for when in ("startsAt", "endsAt"):
            if when in alert and not _is_time(alert[when]):
                errors.append(f"alert {i}: '{when}' is not an RFC 3339 time")
    return errors


class LocalReceiver(LoopbackServer):
    """Every endpoint on one ``127.0.0.1`` port (0: a free one); ``async with`` starts and stops it."""

    def __init__(self, log_path: Path | None = None, port: int = 0) -> None:
        self.log_path = log_path
        self.received: list[Received] = []
        self.attempts: list[Received] = []
        self.faults: dict[str, list[Fault]] = {kind: [] for kind in KINDS}
        self.messages: dict[str, dict[str, Any]] = {}  # Slack ts -> the message's latest chat.* body
        self._down_until: dict[str, float] = {}
        self._last_ts_us = 0
        self.listen_port = port

    def urls(self, name: str = "demo") -> dict[str, str]:
        return endpoint_urls(self.url, name)

    def add_routes(self, app: web.Application) -> None:
        for kind, path in _ROUTES.items():
            app.router.add_post(path, self._handler(kind))

    def inject(self, kind: str, *faults: Fault) -> None:
        """Queue ``faults`` for the next requests of ``kind`` (same as ``faults[kind].extend``)."""
        self.faults[_known(kind)].extend(faults)

    def down(self, kind: str, seconds: float) -> None:
        """For ``seconds`` from now, drop ``kind``'s connections unanswered (0: back up now)."""
        self._down_until[_known(kind)] = time.monotonic() + seconds

    def count_by_kind(self) -> dict[str, int]:
        return {kind: sum(r.kind == kind for r in self.received) for kind in KINDS}

    def bodies(self, kind: str) -> list[Any]:
        return [r.body for r in self.received if r.kind == kind]

    async def wait_for(self, kind: str, count: int = 1, timeout: float = 5.0) -> list[Received]:
        """Wait until ``count`` requests of ``kind`` were accepted; raise ``TimeoutError`` if not."""
        async with asyncio.timeout(timeout):
            while len(got := [r for r in self.received if r.kind == kind]) < count:
                await asyncio.sleep(0.01)
        return got

    def _handler(self, kind: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            headers = {k.lower(): v for k, v in request.headers.items()}
            seen = Received(kind, request.path, headers, _json_or_none(raw), time.time(), raw=raw)
            if time.monotonic() < self._down_until.get(kind, 0.0):
                self.attempts.append(replace(seen, fault="down"))
                if request.transport is not None:
                    request.transport.close()  # the client sees the connection closed, no answer
                return web.Response()  # never written: aiohttp drops it on the closed transport
            fault = self.faults[kind].pop(0) if self.faults.get(kind) else None
            if fault is not None and fault.code is not None:
                self.attempts.append(replace(seen, status=fault.code, fault="status"))
                extra = {} if fault.retry_after is None else {"Retry-After": f"{fault.retry_after:g}"}
                return web.Response(status=fault.code, text=fault.body, headers=extra)
            if fault is not None:
                await asyncio.sleep(fault.seconds)
            response, accepted = self._answer(kind, request, seen.body)
            gone = request.transport is None or request.transport.is_closing()
            seen = replace(seen, status=response.status, fault="abandoned" if gone else "delay" if fault else "")
            self.attempts.append(seen)
            if accepted and not gone:
                self._accept(seen)
            return response

        return handle

    def _accept(self, seen: Received) -> None:
        self.received.append(seen)
        logger.debug("accepted %s %s", seen.kind, seen.path)
        if self.log_path is None:
            return
        line: dict[str, Any] = {"kind": seen.kind, "path": seen.path, "body": seen.body}
        line |= {"headers": seen.headers, "at": seen.at, "status": seen.status}
        if seen.kind == "webhook":  # signatures are over the exact bytes
            line["raw"] = seen.raw.decode("utf-8", "replace")
        with self.log_path.open("a", encoding="utf-8") as log:
            log.write(json.dumps(line) + "\n")
            log.flush()

    def _answer(self, kind: str, request: web.Request, body: Any) -> tuple[web.Response, bool]:
        """The service's normal answer, and whether it accepted the request."""
        if kind == "slack":
            if not isinstance(body, dict):
                return web.Response(status=400, text="invalid_payload"), False
            if not any(body.get(k) for k in ("text", "blocks", "attachments")):
                return web.Response(status=400, text="no_text"), False
            return web.Response(text="ok"), True
        if kind == "slack_api":
            answer = self._slack_api(request.match_info["method"], request.headers.get("Authorization", ""), body)
            return web.json_response(answer), bool(answer["ok"])
        if kind == "pagerduty":
            if errors := pagerduty_errors(body):
                invalid = {"status": "invalid event", "message": "Event object is invalid", "errors": errors}
                return web.json_response(invalid, status=400), False
            dedup = body.get("dedup_key") or uuid.uuid4().hex
            return web.json_response(
                {"status": "success", "message": "Event processed", "dedup_key": dedup}, status=202
            ), True
        if kind == "alertmanager":
            if errors := alertmanager_errors(body):
                return web.json_response("; ".join(errors), status=400), False
            return web.Response(), True
        return web.Response(text="ok"), True

    def _slack_api(self, method: str, authorization: str, body: Any) -> dict[str, Any]:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return {"ok": False, "error": "not_authed"}
        if method not in ("chat.postMessage", "chat.update"):
            return {"ok": False, "error": "unknown_method"}
        if not isinstance(body, dict):
            return {"ok": False, "error": "invalid_json"}
        channel = body.get("channel")
        if not isinstance(channel, str) or not channel:
            return {"ok": False, "error": "channel_not_found"}
        if not any(body.get(k) for k in ("text", "blocks", "attachments")):
            return {"ok": False, "error": "no_text"}
        if method == "chat.update":
            ts = body.get("ts")
            if ts not in self.messages or self.messages[ts].get("channel") != channel:
                return {"ok": False, "error": "message_not_found"}
        else:
            now_us = max(int(time.time() * 1_000_000), self._last_ts_us + 1)
            self._last_ts_us = now_us
            ts = f"{now_us // 1_000_000}.{now_us % 1_000_000:06d}"
        self.messages[ts] = body
        return {"ok": True, "channel": channel, "ts": ts}


def endpoint_urls(url: str, name: str = "demo") -> dict[str, str]:
    """Each sink type's URL on a receiver at ``url``, as its config takes it (Alertmanager's
    base, Slack's API base)."""
    base = {"slack": f"/slack/{name}", "slack_api": "/slack-api", "pagerduty": "/pagerduty/v2/enqueue"}
    base |= {"alertmanager": "/alertmanager", "webhook": f"/webhook/{name}"}
    return {kind: url + path for kind, path in base.items()}


def read_log(path: Path) -> list[dict[str, Any]]:
    """The accepted requests a receiver (maybe in another process) appended to ``path``."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def sample_config_yaml(urls: dict[str, str]) -> str:
    """A notifier config (YAML) with one sink of each type pointed at ``urls`` (``LocalReceiver.urls()``)."""
    q = json.dumps  # a JSON string is a valid YAML scalar, quoted and escaped
    return f"""\
# servewatch demo: every sink type delivers to a local receiver (servewatch.pipeline.dev.receivers).
defaults: {{group_wait: 1s, group_interval: 5s, repeat_interval: 1h}}
retry: {{initial: 500ms, max_wait: 5s, timeout: 5s, give_up_after: 5m}}
sinks:
  - name: demo-slack
    type: slack
    url: {q(urls["slack"])}
    route: {{min_severity: info}}
  - name: demo-slack-bot
    type: slack_bot
    token: "xoxb-servewatch-demo"
    channel: "#servewatch-demo"
    api_url: {q(urls["slack_api"])}
    route: {{min_severity: info}}
  - name: demo-pager
    type: pagerduty
    routing_key: {q(DEMO_ROUTING_KEY)}
    url: {q(urls["pagerduty"])}
    route: {{min_severity: critical}}
  - name: demo-alertmanager
    type: alertmanager
    url: {q(urls["alertmanager"])}
    route: {{min_severity: warning}}
    timing: {{group_wait: 1s, group_interval: 5s, repeat_interval: 60s}}
  - name: demo-webhook
    type: webhook
    url: {q(urls["webhook"])}
    secret: "demo-secret"
    route: {{min_severity: info}}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve the local Slack/PagerDuty/Alertmanager/webhook stand-ins.")
    parser.add_argument("--log", type=Path, default=None, help="append each accepted request here (JSON lines)")
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(serve_until_signalled(LocalReceiver(log_path=args.log, port=args.port), "receiver ready: "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
