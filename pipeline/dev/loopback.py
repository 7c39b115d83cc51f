"""An aiohttp app on ``127.0.0.1`` for the development stand-ins (receivers, the OpenAI server).

A subclass adds its routes (``add_routes``); ``async with`` starts and stops it on a free port
(or the one asked for); ``serve_until_signalled`` runs one as a child process that prints the
line its parent waits for (``children.start_announcing``) and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from types import TracebackType
from typing import Self

from aiohttp import web

logger = logging.getLogger(__name__)


class LoopbackServer:
    """Listens on ``127.0.0.1:<listen_port>`` (0: a free one) once started."""

    listen_port: int = 0
    _runner: web.AppRunner | None = None

    def add_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    @property
    def address(self) -> str:
        """``http://127.0.0.1:<port>`` of the running server."""
        if self._runner is None:
            raise RuntimeError(f"the {type(self).__name__} is not started")
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    @property
    def url(self) -> str:
        """What a client is told to use (the address unless a subclass adds a base path)."""
        return self.address

    async def start(self) -> None:
        app = web.Application()
        self.add_routes(app)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.listen_port).start()
        logger.info("%s on %s", type(self).__name__, self.address)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def serve_until_signalled(server: LoopbackServer, ready: str) -> None:
    """Run ``server`` until SIGTERM or SIGINT; ``ready`` and its URL go to stdout once it listens."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with server:
        sys.stdout.write(f"{ready}{server.url}\n")  # the line a parent process waits for
        sys.stdout.flush()
        await stop.wait()
