"""``servewatch scrape``: engine ``/metrics`` into canonical intervals, to Kafka or a file (a CLI module: it prints)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import TYPE_CHECKING

import orjson

from servewatch.pipeline.cli.common import (
    Progress,
    Subcommands,
    add_broker_flags,
    add_out_flag,
    reach_broker,
    settings_from,
    with_broker,
)
from servewatch.pipeline.settings import Settings

if TYPE_CHECKING:
    from servewatch.pipeline.kafka import Producer


def cmd_scrape(args: argparse.Namespace) -> int:
    """Scrape engine /metrics; canonical intervals to the scrapes topic, or to --out as JSONL."""
    from servewatch.pipeline.durations import parse_duration
    from servewatch.pipeline.ingest.scrape.scraper import check_targets

    try:
        interval_s, timeout_s = parse_duration(args.interval), parse_duration(args.timeout)
        args.give_up_s = 0.0 if args.give_up_after.strip() in ("0", "") else parse_duration(args.give_up_after)
    except ValueError as exc:
        print(f"servewatch scrape: bad duration ({exc})", file=sys.stderr)
        return 2
    try:
        check_targets(args.target)
    except ValueError as exc:
        print(f"servewatch scrape: {exc}", file=sys.stderr)
        return 2
    if args.out:  # no Kafka needed
        return asyncio.run(_scrape(args, interval_s, timeout_s, None))
    with with_broker(settings_from(args), "scrape", embedded=args.embedded) as settings:
        return asyncio.run(_scrape(args, interval_s, timeout_s, settings))


async def _scrape(args: argparse.Namespace, interval_s: float, timeout_s: float, settings: Settings | None) -> int:
    import signal

    import httpx

    from servewatch.pipeline import topics
    from servewatch.pipeline.ingest.scrape.scraper import Scrape, Scraper, run_scrapes
    from servewatch.pipeline.kafka import KafkaAuth, ensure_topics, producer
    from servewatch.schemas.engine_interval import EngineInterval

    kafka = None
    if settings is not None and settings.kafka.bootstrap is not None:
        bootstrap, partitions, auth = (
            settings.kafka.bootstrap,
            settings.kafka.topic_partitions,
            KafkaAuth.from_settings(settings),
        )

        async def start() -> Producer:
            await ensure_topics(bootstrap, partitions, (topics.SCRAPES,), auth=auth)
            started = producer(bootstrap, auth=auth)
            try:
                await started.start()
            except BaseException:
                await started.stop()  # a failed start leaves it open; a next attempt makes another
                raise
            return started

        # A broker not up yet is waited for (SERVEWATCH_BROKER_WAIT_S), one that refuses is one line.
        kafka = await reach_broker(settings, "scrape", start)
    # Only now: a SIGTERM or Ctrl-C while the broker is waited for ends the command at once
    # (nothing is scraped yet), instead of only once the broker answers or the wait is over.
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    record = open(args.record, "ab") if args.record else None  # noqa: SIM115 - closed below
    out = None if not args.out else sys.stdout.buffer if args.out == "-" else open(args.out, "ab")  # noqa: SIM115
    sent = 0
    line = Progress()
    all_down_since: float | None = None
    gave_up: list[int] = []
    give_up_s = args.give_up_s
    try:
        async with httpx.AsyncClient() as client:
            scraper = Scraper(args.target, client, timeout_s)

            async def on_round(n: int, scrapes: list[Scrape], intervals: list[EngineInterval]) -> None:
                nonlocal sent
                for scrape in scrapes:
                    if record is not None:
                        record.write(orjson.dumps(scrape.to_record()) + b"\n")
                for item in intervals:
                    data = item.model_dump_json().encode()
                    if out is not None:
                        out.write(data + b"\n")
                    if kafka is not None:
                        await kafka.send(topics.SCRAPES, data, key=f"{item.instance}|{item.model}".encode())
                sent += len(intervals)
                for handle in (record, out):
                    if handle is not None:
                        handle.flush()
                up = sum(health.up for health in scraper.health.values())
                line.show(f"round {n}: {up}/{len(scraper.health)} targets up, {sent:,} intervals sent")
                nonlocal all_down_since
                if up:
                    all_down_since = None
                elif all_down_since is None:
                    all_down_since = time.monotonic()
                elif give_up_s and time.monotonic() - all_down_since >= give_up_s:
                    gave_up.append(round(time.monotonic() - all_down_since))
                    stop.set()  # every target down for --give-up-after: let the supervisor know

            rounds = await run_scrapes(scraper, interval_s, on_round, args.count, stop)
    finally:
        if kafka is not None:
            await kafka.stop()
        for handle in (record, out):
            if handle is not None and handle is not sys.stdout.buffer:
                handle.close()
    line.done()
    print(f"{rounds:,} rounds, {sent:,} intervals", file=sys.stderr)
    for health in scraper.health.values():
        state = "up" if health.up else f"down ({health.last_error})"
        print(f"  {health.url}: {state}, {health.scrapes:,} scrapes", file=sys.stderr)
    if gave_up:
        print(f"servewatch scrape: every target down for {gave_up[0]} s (--give-up-after): stopping", file=sys.stderr)
        return 1
    return 0


def add_scrape_parser(sub: Subcommands) -> None:
    p = sub.add_parser("scrape", help="scrape vLLM/SGLang /metrics into canonical per-model intervals")
    p.add_argument("--target", action="append", required=True, help="metrics URL, e.g. http://10.0.0.7:8000/metrics "
                   "(repeat for more)")  # fmt: skip
    p.add_argument("--interval", default="10s", help="time between scrapes: 10s, 500ms, 1m (default 10s)")
    p.add_argument("--timeout", default="5s", help="per-scrape timeout (default 5s)")
    p.add_argument("--count", type=int, default=None, help="stop after this many rounds (default: until Ctrl-C)")
    p.add_argument("--give-up-after", default="5m", help="exit 1 when every target has been down this long "
                   "(default 5m; 0: never), so a supervisor sees it")  # fmt: skip
    p.add_argument("--record", help="append every good scrape to this JSONL file (timestamp, instance, body)")
    add_out_flag(p, "intervals as JSONL instead of to Kafka", default=None)
    add_broker_flags(p)
    p.set_defaults(func=cmd_scrape)
