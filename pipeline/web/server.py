"""The triage page's HTTP server (aiohttp): pages, the JSON API, live updates, verdicts.

Everything is read from a ``TriageStore`` the Kafka feed fills; the server itself holds
nothing and talks to Kafka only through ``publish_feedback``, so tests run it on a store
alone. Live updates are server-sent events (one JSON record per message, its ``kind``
saying which): one long GET per open page, which proxies and browsers handle without a
WebSocket library. The Host check, authentication, CSRF and security headers live in ``auth``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from servewatch.pipeline.web.auth import CSRF_HEADER, Guard, HostCheck, client_cookie, safe_next, security_headers
from servewatch.pipeline.web.changes import change_json, change_page, changes_page
from servewatch.pipeline.web.detail import anomaly_page, group_page
from servewatch.pipeline.web.links import LinkTemplates
from servewatch.pipeline.web.openapi import openapi
from servewatch.pipeline.web.render import error_page, groups_page, login_page, segments_page
from servewatch.pipeline.web.replicas import replicas_page
from servewatch.pipeline.web.store import DEFAULT_KINDS, Filters, TriageStore, group_json
from servewatch.schemas.anomaly import Severity, Signal, Status
from servewatch.schemas.feedback import Feedback

logger = logging.getLogger(__name__)

STATIC = Path(__file__).with_name("static")
KINDS = frozenset({"group", "incident", "feedback", "series", "change_marker", "change_report"})
ALIASES = {"acknowledge": "acknowledged", "not expected": "not_expected"}
CHOICES = {"signal": {s.value for s in Signal}, "severity": {s.value for s in Severity},
           "status": {s.value for s in Status}}  # fmt: skip


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")


def _problem(status: int, message: str) -> web.HTTPException:
    kind = web.HTTPException
    for candidate in (web.HTTPBadRequest, web.HTTPForbidden, web.HTTPNotFound, web.HTTPUnsupportedMediaType,
                      web.HTTPServiceUnavailable):  # fmt: skip
        if candidate.status_code == status:
            kind = candidate
    return kind(text=orjson.dumps({"error": message}).decode(), content_type="application/json")


def filters_of(request: web.Request) -> Filters:
    """The model/signal/severity/status query parameters (empty: any); a value no record can have is a 400."""
    values = {name: request.query.get(name) or None for name in ("model", "signal", "severity", "status")}
    for name, allowed in CHOICES.items():
        if values[name] is not None and values[name] not in allowed:
            raise _problem(400, f"{name} must be one of {sorted(allowed)}")
    return Filters(**values)


def _number(request: web.Request, name: str) -> float | None:
    raw = request.query.get(name)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise _problem(400, f"{name} must be a number (Unix seconds)") from None
    if not math.isfinite(value):
        raise _problem(400, f"{name} must be finite")
    return value


class _Routes:
    def __init__(self, store: TriageStore, guard: Guard, publish: Callable[[Feedback], Awaitable[None]],
                 links: LinkTemplates, now: Callable[[], float], heartbeat_s: float) -> None:  # fmt: skip
        self.store, self.guard, self.publish, self.links, self.now = store, guard, publish, links, now
        self.heartbeat_s = heartbeat_s

    # -- pages -------------------------------------------------------------------------------
    async def index(self, request: web.Request) -> web.Response:
        groups = [(g, self.store.feedback(g.group)) for g in self.store.groups(filters_of(request))]
        return _html(groups_page(groups, filters_of(request), self.store.models(), self.guard.csrf_token(request)))

    async def group_page(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        group = self.store.group(key)
        csrf = self.guard.csrf_token(request)
        if group is None:
            return _html(error_page(404, f"No incident group {key} is held (it may have aged out).", csrf), 404)
        return _html(group_page(group, self.store.members(key), self.store.feedback(key), series_of=self.store.series,
                                links=self.links, csrf=csrf, user=self.guard.user(request),
                                changes=self.store))  # fmt: skip

    async def anomaly_page(self, request: web.Request) -> web.Response:
        event = self.store.anomaly(request.match_info["id"])
        csrf = self.guard.csrf_token(request)
        if event is None:
            return _html(error_page(404, "No such incident event is held (it may have aged out).", csrf), 404)
        latest = self.store.latest(event)
        return _html(anomaly_page(event, latest, series_of=self.store.series, links=self.links, csrf=csrf,
                                  changes=self.store))  # fmt: skip

    async def segments_page(self, request: web.Request) -> web.Response:
        overview = self.store.segments(request.query.get("model") or None)
        return _html(segments_page(overview, self.links, self.guard.csrf_token(request)))

    async def replicas_page(self, request: web.Request) -> web.Response:
        model = request.query.get("model") or None
        rows = self.store.replicas(model)
        models = sorted({row.point.segment.get("model", "") for row in self.store.replicas()})
        return _html(replicas_page(rows, models, model, self.guard.csrf_token(request)))

    async def changes_page(self, request: web.Request) -> web.Response:
        model = request.query.get("model") or None
        models = sorted({m.model for m in self.store.markers()})
        return _html(changes_page(self.store.changes(model), models, model, self.store.after_change,
                                  self.guard.csrf_token(request)))  # fmt: skip

    async def change_page(self, request: web.Request) -> web.Response:
        change_id = request.match_info["id"]
        change = self.store.change(change_id)
        csrf = self.guard.csrf_token(request)
        if change is None:
            return _html(error_page(404, f"No change {change_id} is held.", csrf), 404)
        return _html(change_page(change, self.store.after_change(change_id), csrf))

    async def login_form(self, request: web.Request) -> web.Response:
        if self.guard.token is None:
            return web.Response(status=303, headers={"Location": "/"})
        next_path = safe_next(request.query.get("next"))
        return _html(login_page(self.guard.csrf_token(request), next_path, failed=False))

    async def login(self, request: web.Request) -> web.Response:
        form = await request.post()
        next_path = safe_next(request.query.get("next"))
        if self.guard.token is None:
            return web.Response(status=303, headers={"Location": next_path})
        if not self.guard.csrf_ok(request, str(form.get("csrf", ""))):
            raise _problem(403, "the form is stale or came from another site: reload the page")
        if not self.guard.token_matches(str(form.get("token", ""))):
            return _html(login_page(self.guard.csrf_token(request), next_path, failed=True), 401)
        name = str(form.get("name", "")).strip()[:100] or "on-call"
        response = web.Response(status=303, headers={"Location": next_path})
        self.guard.set_session(response, request, name)
        return response

    # -- API ---------------------------------------------------------------------------------
    async def api_groups(self, request: web.Request) -> web.Response:
        groups = self.store.groups(filters_of(request))
        return _json({"groups": [group_json(g, self.store.feedback(g.group)) for g in groups]})

    async def api_group(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        group = self.store.group(key)
        if group is None:
            raise _problem(404, "no such group held")
        members = [m.latest.model_dump(mode="json") for m in self.store.members(key)]
        return _json({"group": group_json(group, self.store.feedback(key)), "members": members})

    async def api_anomalies(self, request: web.Request) -> web.Response:
        limit = _number(request, "limit")
        events = self.store.anomalies(filters_of(request), request.query.get("group") or None,
                                      int(limit) if limit is not None and limit > 0 else 200)  # fmt: skip
        return _json({"anomalies": [e.model_dump(mode="json") for e in events]})

    async def api_anomaly(self, request: web.Request) -> web.Response:
        event = self.store.anomaly(request.match_info["id"])
        if event is None:
            raise _problem(404, "no such event held")
        return _json(event.model_dump(mode="json"))

    async def api_segments(self, request: web.Request) -> web.Response:
        items = []
        for item in self.store.segments(request.query.get("model") or None):
            p = item.point
            items.append({"key": item.key, "segment": p.segment, "window_end": p.window_end, "load": p.load,
                          "signals": {k: v.model_dump(mode="json") for k, v in p.signals.items()},
                          "sparklines": item.sparklines,
                          "dashboard": self.links.segment_url(item.key, p.segment, p.window_end)})  # fmt: skip
        return _json({"segments": items})

    async def api_series(self, request: web.Request) -> web.Response:
        key = request.query.get("key")
        if not key:
            raise _problem(400, "give the segment's key")
        signal = request.query.get("signal") or None
        points = self.store.series(key, _number(request, "since"), _number(request, "until"))
        out = []
        for point in points:
            data = point.model_dump(mode="json")
            if signal is not None:
                if signal not in point.signals:
                    continue
                data["signals"] = {signal: data["signals"][signal]}
            out.append(data)
        return _json({"key": key, "points": out})

    async def api_changes(self, request: web.Request) -> web.Response:
        changes = self.store.changes(request.query.get("model") or None)
        return _json({"changes": [change_json(c, self.store.after_change(c.marker.id)) for c in changes]})

    async def api_change(self, request: web.Request) -> web.Response:
        change_id = request.match_info["id"]
        change = self.store.change(change_id)
        if change is None:
            raise _problem(404, "no such change held")
        return _json(change_json(change, self.store.after_change(change_id)))

    async def api_csrf(self, request: web.Request) -> web.Response:
        return _json({"csrf": self.guard.csrf_token(request)})

    async def api_feedback(self, request: web.Request) -> web.Response:
        if not self.guard.csrf_ok(request, request.headers.get(CSRF_HEADER)):
            raise _problem(403, f"missing or wrong {CSRF_HEADER} (read it from the page, or GET /api/csrf)")
        if request.content_type != "application/json":
            raise _problem(415, "send JSON")
        key = request.match_info["key"]
        group = self.store.group(key)
        if group is None:
            raise _problem(404, "no such group held")
        try:
            body = await request.json()
        except ValueError:
            raise _problem(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise _problem(400, "send a JSON object")
        verdict = ALIASES.get(str(body.get("verdict")), body.get("verdict"))
        by = (self.guard.user(request) or str(body.get("by") or "")).strip()[:100]
        if not by:
            raise _problem(400, "say who gives the verdict ('by')")
        signals, comment = [s.value for s in group.signals], str(body.get("comment") or "")
        try:
            feedback = Feedback.model_validate({"group": key, "model": group.model, "verdict": verdict, "by": by,
                                                "at": self.now(), "signals": signals, "comment": comment})  # fmt: skip
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise _problem(400, problems) from None
        try:
            await self.publish(feedback)
        except Exception as exc:  # any client error: the verdict was not recorded, say so
            logger.warning("could not publish feedback on group %s: %s", key, type(exc).__name__)
            raise _problem(503, "the verdict could not be written to Kafka; try again") from None
        self.store.add(feedback)  # shown at once; the copy read back from the topic is the same record
        logger.info("feedback %s on group %s by %s", feedback.verdict, key, by)
        all_given = [f.model_dump(mode="json") for f in self.store.feedback(key)]
        return _json({"feedback": feedback.model_dump(mode="json"), "all": all_given}, 201)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        asked = {k.strip() for k in request.query.get("kinds", "").split(",") if k.strip()}
        kinds = frozenset(asked & KINDS) if asked else DEFAULT_KINDS
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Accel-Buffering": "no"})
        await response.prepare(request)
        subscription = self.store.subscribe(kinds)
        try:
            await response.write(b"retry: 2000\n: connected\n\n")
            while True:
                try:
                    text = await asyncio.wait_for(subscription.queue.get(), self.heartbeat_s)
                except TimeoutError:
                    await response.write(b": ping\n\n")  # keeps proxies from closing an idle stream
                    continue
                if text is None:  # dropped (too slow) or the server is stopping
                    break
                await response.write(b"data: " + text.encode() + b"\n\n")
        except (ConnectionResetError, ConnectionError):
            pass  # the page was closed
        finally:
            self.store.unsubscribe(subscription)
        return response

    async def healthz(self, request: web.Request) -> web.Response:
        return _json({"ok": True})

    async def favicon(self, request: web.Request) -> web.Response:
        return web.Response(status=204)  # browsers ask for one; none is nicer than a logged 404

    async def describe(self, request: web.Request) -> web.Response:
        return _json(openapi())


def create_web_app(
    store: TriageStore,
    *,
    token: str | None,
    publish_feedback: Callable[[Feedback], Awaitable[None]],
    links: LinkTemplates | None = None,
    secret: bytes | None = None,
    now: Callable[[], float] = time.time,
    heartbeat_s: float = 15.0,
    hosts: HostCheck | None = None,
) -> web.Application:
    """The triage page over ``store``; ``token`` None: no authentication (loopback only).
    ``hosts``: the Host names it answers to (default: the address each connection came in on,
    and the loopback names on loopback)."""
    guard = Guard(token, secret)
    routes = _Routes(store, guard, publish_feedback, links or LinkTemplates(), now, heartbeat_s)
    # The Host check comes first: a rebinding page must learn nothing, not even that it needs a token.
    middlewares = [(hosts or HostCheck()).middleware, client_cookie, guard.middleware]
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024)
    app.on_response_prepare.append(security_headers)

    async def end_streams(_: web.Application) -> None:
        store.close()

    app.on_shutdown.append(end_streams)
    add = app.router
    add.add_get("/", routes.index)
    add.add_get("/groups/{key}", routes.group_page)
    add.add_get("/anomalies/{id}", routes.anomaly_page)
    add.add_get("/segments", routes.segments_page)
    add.add_get("/replicas", routes.replicas_page)
    add.add_get("/changes", routes.changes_page)
    add.add_get("/changes/{id}", routes.change_page)
    add.add_get("/login", routes.login_form)
    add.add_post("/login", routes.login)
    add.add_get("/api/groups", routes.api_groups)
    add.add_get("/api/groups/{key}", routes.api_group)
    add.add_post("/api/groups/{key}/feedback", routes.api_feedback)
    add.add_get("/api/csrf", routes.api_csrf)
    add.add_get("/api/anomalies", routes.api_anomalies)
    add.add_get("/api/anomalies/{id}", routes.api_anomaly)
    add.add_get("/api/segments", routes.api_segments)
    add.add_get("/api/series", routes.api_series)
    add.add_get("/api/changes", routes.api_changes)
    add.add_get("/api/changes/{id}", routes.api_change)
    add.add_get("/api/stream", routes.stream)
    add.add_get("/openapi.json", routes.describe)
    add.add_get("/healthz", routes.healthz)
    add.add_get("/favicon.ico", routes.favicon)
    add.add_static("/static", STATIC)
    return app
