"""``servewatch web``: serve the triage page until Ctrl-C or SIGTERM.

Bound to the loopback interface by default; bound anywhere else it refuses to start
without ``SERVEWATCH_WEB_TOKEN``, because the page shows request excerpts and takes
verdicts. ``serve_web`` is the same server as a coroutine, for the demo to run beside its
workload.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import signal
from collections.abc import Callable

from servewatch.pipeline.cli.common import CommandError, Subcommands, reach_broker, settings_from
from servewatch.pipeline.settings import Settings

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


#: The shortest token accepted: a guessable one would be worse than none (it looks safe).
MIN_TOKEN_CHARS = 16


def check_exposure(settings: Settings, host: str) -> None:
    token = settings.web.token.get_secret_value() if settings.web.token is not None else None
    if token is not None and len(token.strip()) < MIN_TOKEN_CHARS:
        raise CommandError(f"SERVEWATCH_WEB_TOKEN is too short: use at least {MIN_TOKEN_CHARS} characters "
                           "(e.g. `openssl rand -hex 16`)", "web")  # fmt: skip
    if not is_loopback(host) and token is None:
        raise CommandError(
            f"refusing to serve the triage page on {host} without a token: set SERVEWATCH_WEB_TOKEN "
            "(or keep the default --host 127.0.0.1)",
            "web",
        )


async def serve_web(
    settings: Settings, host: str = "127.0.0.1", port: int = 8088, ready: Callable[[str], None] | None = None
) -> None:
    """Serve the triage page over ``settings``' broker until cancelled; ``ready`` gets its URL
    once it listens (``port`` 0: a free one)."""
    import httpx
    from aiohttp import web

    from servewatch.pipeline.kafka import KafkaAuth, ensure_topics
    from servewatch.pipeline.web.auth import HostCheck
    from servewatch.pipeline.web.feed import FeedbackPublisher, follow
    from servewatch.pipeline.web.links import GrafanaAnnotator, LinkTemplates
    from servewatch.pipeline.web.server import create_web_app
    from servewatch.pipeline.web.store import TriageStore

    check_exposure(settings, host)
    bootstrap = settings.kafka.bootstrap
    if bootstrap is None:
        raise CommandError("no Kafka broker: give --broker HOST:PORT or set SERVEWATCH_BROKER", "web")
    try:
        links = LinkTemplates(settings.web.evidence_url, settings.web.segment_url)
        hosts = HostCheck(settings.web.allowed_hosts, host)
    except ValueError as exc:
        raise CommandError(str(exc), "web") from None
    auth = KafkaAuth.from_settings(settings)
    store = TriageStore()

    async def start() -> FeedbackPublisher:
        await ensure_topics(bootstrap, settings.kafka.topic_partitions, auth=auth)
        started = FeedbackPublisher(bootstrap, auth)
        try:
            await started.start()
        except BaseException:
            await started.stop()  # a failed start leaves its producer open; a next attempt makes another
            raise
        return started

    # Start-up only: a broker not up yet is waited for (SERVEWATCH_BROKER_WAIT_S), one that
    # refuses is one line; once serving, the page's readers retry a broker that went away (``follow``).
    publisher = await reach_broker(settings, "web", start)
    client = httpx.AsyncClient(timeout=5.0)
    annotator = None
    if settings.grafana.url and settings.grafana.token is not None:
        annotator = GrafanaAnnotator(settings.grafana.url, settings.grafana.token, client)
    token = settings.web.token.get_secret_value() if settings.web.token is not None else None
    app = create_web_app(store, token=token, publish_feedback=publisher, links=links, hosts=hosts)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    feed: asyncio.Task[None] | None = None
    try:
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0][1] if runner.addresses else port
        shown = f"[{host}]" if ":" in host else host
        if not is_loopback(host):
            logger.warning("serving on %s over plain HTTP: put TLS in front (a reverse proxy)", host)
        feed = asyncio.create_task(follow(store, bootstrap, auth, annotator.annotate if annotator else None))
        if ready is not None:
            ready(f"http://{shown}:{bound}/")
        await feed
    finally:
        if feed is not None:
            feed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feed
        await runner.cleanup()
        await publisher.stop()
        await client.aclose()


def cmd_web(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    check_exposure(settings, args.host)

    async def run() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):  # both end the server cleanly
            loop.add_signal_handler(signum, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await serve_web(settings, args.host, args.port, lambda url: print(f"triage page: {url}", flush=True))

    asyncio.run(run())
    return 0


def add_web_parser(sub: Subcommands) -> None:
    p = sub.add_parser("web", help="serve the triage page: incident groups live, details, charts, feedback")
    p.add_argument("--broker", metavar="HOST:PORT", help="Kafka bootstrap servers (default: SERVEWATCH_BROKER)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1; any other "
                   "needs SERVEWATCH_WEB_TOKEN)")  # fmt: skip
    p.add_argument("--port", type=int, default=8088, help="port (default 8088; 0: a free one)")
    p.set_defaults(func=cmd_web)
