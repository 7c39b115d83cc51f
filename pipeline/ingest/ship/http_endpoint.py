"""``servewatch ship --listen``: request logs POSTed to ``/v1/requests`` (one record or a JSON array),
and change markers POSTed to ``/v1/changes`` by a deploy pipeline.

An aiohttp server (imported only when HTTP is served) answers each POST once its records
are in Kafka (``Chunk.on_published``), so a client that got its answer lost nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Final

import orjson

if TYPE_CHECKING:  # aiohttp is imported only when HTTP is served
    from aiohttp import web

from pydantic import ValidationError

from servewatch.pipeline.ingest.ship.sources import Chunk, ChunkResult, Unit, next_or_stop
from servewatch.schemas.change_marker import ChangeMarker

logger = logging.getLogger(__name__)


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[::1]:PORT`` or a bare port (on 127.0.0.1: nothing beyond this machine
    unless asked for)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"--listen {text!r}: expected HOST:PORT or PORT") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"--listen {text!r}: port out of range")
    return host.strip("[]") or "127.0.0.1", number


class HttpSource:
    """``POST /v1/requests`` with one record or a JSON array of records; ``GET /healthz``.

    The answer waits until the body's records (and dead letters) are in Kafka:
    ``{"accepted": n, "rejected": m, "errors": [{"index", "reason", "error"}, ...]}``,
    200 when any record was accepted, 422 when none was, 400 for a body that is not JSON
    (dead-lettered as well), 503 while shutting down, 413 above ``max_body_bytes`` (not
    read, so not dead-lettered). aiohttp serves it (a Faust dependency, so nothing new).
    """

    label = "http"
    MAX_ERRORS: Final = 100

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = 8 * 1024 * 1024,
        publish_marker: Callable[[ChangeMarker], Awaitable[None]] | None = None,
    ) -> None:
        self.host, self.port, self.max_body_bytes = host, port, max_body_bytes
        self.publish_marker = publish_marker  # ``POST /v1/changes`` is served when given
        self._queue: asyncio.Queue[Chunk] = asyncio.Queue(maxsize=64)
        self._closing = False
        self._entering = 0  # handlers about to queue a chunk: the drain waits for them
        self._runner: web.AppRunner | None = None

    @property
    def closing(self) -> bool:
        """True once stopping: new posts are refused (503), those in hand still answered."""
        return self._closing

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1/requests"

    async def start(self) -> None:
        """Listen (a port of 0 becomes a free one, in ``port``)."""
        import socket

        from aiohttp import web

        if self._runner is not None:
            return
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/requests", self._post)
        app.router.add_get("/healthz", self._health)
        if self.publish_marker is not None:
            app.router.add_post("/v1/changes", self._post_change)
        family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((self.host, self.port), family=family)
        self.port = int(sock.getsockname()[1])
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self._runner = runner
        logger.info("accepting request logs at %s", self.url)

    async def _health(self, request: web.Request) -> web.Response:
        from aiohttp import web

        return web.json_response({"status": "closing" if self._closing else "ok"})

    async def _post_change(self, request: web.Request) -> web.Response:
        """A change marker: ``{"model", "description", "at"?, "id"?, "instance"?, "labels"?, "by"?}``
        (``at`` defaults to now, ``id`` to a new UUID). 201 with the marker once the broker has
        it; 400 for a body that is not a JSON object, 422 with the problems for an invalid one."""
        from aiohttp import web

        assert self.publish_marker is not None
        if self._closing:
            return web.json_response({"error": "shutting down"}, status=503)
        try:
            value = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return web.json_response({"error": f"not JSON: {exc}"}, status=400)
        if not isinstance(value, dict):
            return web.json_response({"error": "expected one JSON object (a change marker)"}, status=400)
        value.setdefault("id", str(uuid.uuid4()))
        value.setdefault("at", time.time())
        value["source"] = "http"
        try:
            marker = ChangeMarker.model_validate(value)
        except ValidationError as exc:
            errors = [{"field": ".".join(map(str, e["loc"])), "error": e["msg"]} for e in exc.errors()]
            return web.json_response({"error": "invalid change marker", "errors": errors}, status=422)
        await self.publish_marker(marker)
        logger.info("change marker %s on %s: %s", marker.id, marker.model, marker.description)
        return web.json_response(marker.model_dump(mode="json"), status=201)

    async def _post(self, request: web.Request) -> web.Response:
        from aiohttp import web

        if self._closing:
            return web.json_response({"error": "shutting down"}, status=503)
        body = await request.read()
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            units, malformed = [Unit(body, rejection=("invalid_json", str(exc)))], True
        else:
            malformed = False
            if isinstance(value, list):
                units = [Unit(None, value=item, index=index) for index, item in enumerate(value)]
            else:
                units = [Unit(body, value=value)]
        if not units:
            return web.json_response({"accepted": 0, "rejected": 0, "errors": []})
        if self._closing:
            return web.json_response({"error": "shutting down"}, status=503)
        done: asyncio.Future[ChunkResult] = asyncio.get_running_loop().create_future()

        def published(result: ChunkResult) -> None:
            if not done.done():
                done.set_result(result)

        self._entering += 1
        try:
            await self._queue.put(Chunk(units, published))
        finally:
            self._entering -= 1
        result = await done
        errors = [{"index": index, "reason": reason, "error": error}
                  for index, reason, error in result.rejected[: self.MAX_ERRORS]]  # fmt: skip
        status = 400 if malformed else 200 if result.accepted else 422
        return web.json_response(
            {"accepted": result.accepted, "rejected": len(result.rejected), "errors": errors}, status=status
        )

    async def chunks(self, stop: asyncio.Event) -> AsyncGenerator[Chunk, None]:
        await self.start()
        while True:
            chunk = await next_or_stop(self._queue, stop)
            if chunk is None:
                break
            yield chunk
        self._closing = True  # new posts get 503; the ones already in are shipped and answered
        while self._entering or not self._queue.empty():
            yield await self._queue.get()

    async def close(self) -> None:
        self._closing = True
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
