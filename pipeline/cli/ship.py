"""``servewatch ship``: request logs into the requests topic (a CLI module: it prints progress and counts)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import orjson

from servewatch.pipeline.cli.common import (
    Progress,
    Subcommands,
    add_broker_flags,
    kafka_errors,
    settings_from,
    with_broker,
)
from servewatch.pipeline.settings import Settings


def cmd_ship(args: argparse.Namespace) -> int:
    """Ship request logs (a followed JSONL file, stdin or HTTP POSTs) to the requests topic in batches."""
    import os
    import signal

    from aiokafka.errors import KafkaError

    from servewatch.pipeline import topics
    from servewatch.pipeline.durations import parse_duration
    from servewatch.pipeline.ingest.ship.adapters import AdaptOptions, FieldMapping, adapter_for, parse_defaults
    from servewatch.pipeline.ingest.ship.file_follower import FileFollower, StateFile
    from servewatch.pipeline.ingest.ship.http_endpoint import HttpSource, parse_listen
    from servewatch.pipeline.ingest.ship.shipper import ShipConfig, Shipper, ShipStats
    from servewatch.pipeline.ingest.ship.sources import Source, StreamSource
    from servewatch.pipeline.kafka import KafkaAuth, ensure_topics, producer
    from servewatch.schemas.change_marker import ChangeMarker

    base = settings_from(args)
    line = Progress()
    try:
        mapping = FieldMapping.parse(orjson.loads(Path(args.mapping).read_bytes())) if args.mapping else None
        prefix_chars = base.ship.prefix_chars if args.prefix_chars is None else args.prefix_chars
        options = AdaptOptions(
            args.keep_prompt or base.ship.keep_prompt, prefix_chars, parse_defaults(args.default),
            args.instance_from or base.ship.instance_from,
        )  # fmt: skip
        adapter = adapter_for("mapping" if mapping else args.in_format, options, mapping)
        config = ShipConfig(batch_records=args.batch or base.ship.batch_records,
                            batch_bytes=min(base.ship.batch_bytes, base.kafka.max_message_bytes),
                            linger_s=base.ship.linger_s if args.linger is None else parse_duration(args.linger),
                            drain_timeout_s=base.ship.drain_timeout_s)  # fmt: skip
        listen = parse_listen(args.listen) if args.listen else None
        path = None if args.input in (None, "-") else args.input
        if path and args.no_follow and not os.path.isfile(path):
            raise ValueError(f"no such file: {path}")
    except (OSError, ValueError) as exc:
        print(f"servewatch ship: {exc}", file=sys.stderr)
        return 2

    def source() -> Source:
        if path:
            state = StateFile(args.state or StateFile.default_path(path, base.ship.state_dir))
            verb = "reading" if args.no_follow else "following"
            print(f"{verb} {path}; position kept in {state.path}", file=sys.stderr)
            return FileFollower(path, state, follow=not args.no_follow, start=args.start,
                                poll_s=base.ship.poll_s, max_line_bytes=base.kafka.max_message_bytes)  # fmt: skip
        if listen is not None:
            return HttpSource(*listen, max_body_bytes=base.kafka.max_message_bytes, publish_marker=publish_marker)
        return StreamSource(sys.stdin.buffer.read1, max_line_bytes=base.kafka.max_message_bytes)  # type: ignore[union-attr]

    kafka: Any = None  # the producer, once ``ship`` started it

    async def publish_marker(marker: ChangeMarker) -> None:
        assert kafka is not None
        await kafka.send_and_wait(topics.CHANGES, key=marker.model.encode(), value=marker.model_dump_json().encode())

    async def ship(settings: Settings) -> ShipStats:
        nonlocal kafka
        assert settings.kafka.bootstrap is not None
        stop = asyncio.Event()

        def on_signal(name: str) -> None:
            print(f"\n{name}: shipping what was read, then stopping", file=sys.stderr, flush=True)
            stop.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, on_signal, signum.name)
        auth = KafkaAuth.from_settings(base)
        wanted = (topics.REQUESTS, topics.DEADLETTER, topics.CHANGES)
        # A broker not there at start is one line; once shipping, the shipper retries it.
        with kafka_errors(settings, "ship"):
            await ensure_topics(settings.kafka.bootstrap, settings.kafka.topic_partitions, wanted, auth=auth)
            kafka = producer(settings.kafka.bootstrap, auth=auth)
            await kafka.start()
        shipper = Shipper(source(), adapter, kafka, config)
        if isinstance(shipper.source, HttpSource):
            await shipper.source.start()
            print(f"accepting request logs: POST {shipper.source.url} (change markers: POST "
                  f"{shipper.source.url.removesuffix('/requests')}/changes)", file=sys.stderr, flush=True)  # fmt: skip

        async def progress() -> None:
            shown = None
            while True:
                await asyncio.sleep(1.0)
                s = shipper.stats
                if (s.read, s.sent, s.rejected) != shown:
                    shown = (s.read, s.sent, s.rejected)
                    line.show(f"read {s.read:,}, sent {s.sent:,}, rejected {s.rejected:,}")

        reporter = asyncio.create_task(progress())
        try:
            return await shipper.run(stop)
        finally:
            reporter.cancel()
            await kafka.stop()

    try:
        with with_broker(base, "ship", embedded=args.embedded) as settings:
            stats = asyncio.run(ship(settings))
    except (KafkaError, FileNotFoundError) as exc:
        print(f"\nservewatch ship: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    line.done()
    print(f"ship: read {stats.read:,}, sent {stats.sent:,}, rejected {stats.rejected:,}, pending {stats.pending:,} "
          f"in {stats.elapsed_s:.2f} s ({stats.records_per_s:,.0f} records/s, {stats.messages:,} messages)",
          file=sys.stderr)  # fmt: skip
    if stats.by_reason:
        print("  rejected: " + ", ".join(f"{r} {n:,}" for r, n in stats.by_reason.most_common()), file=sys.stderr)
    for letter in stats.samples:
        where = f"line {letter.record_index}" if letter.source_offset is not None else f"item {letter.record_index}"
        if letter.source_offset is not None:
            where += f" (byte {letter.source_offset:,})"
        print(f"  rejected ({letter.reason}) {where}: {letter.error[:200]}", file=sys.stderr)
    if stats.pending:
        print(f"  {stats.pending:,} records read were not delivered (Kafka unreachable); a followed file's saved "
              "position is before them", file=sys.stderr)  # fmt: skip
    return 0 if stats.pending == 0 else 1


def add_ship_parser(sub: Subcommands) -> None:
    p = sub.add_parser("ship", help="ship request logs (JSONL file, stdin or HTTP) to the requests topic in batches")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--in", dest="input", metavar="PATH", help="JSONL file, followed like tail -F (rotation, "
                        "truncation, saved position); '-': standard input until it ends")  # fmt: skip
    source.add_argument("--listen", metavar="[HOST:]PORT", help="serve POST /v1/requests (one record or a JSON "
                        "array) on HOST:PORT (default host 127.0.0.1)")  # fmt: skip
    p.add_argument("--in-format", choices=["auto", "native", "openai"], default="auto", help="record layout: "
                   "RequestLog JSON, {response, request, timing} of an OpenAI-compatible server, or auto "
                   "(default)")  # fmt: skip
    p.add_argument("--mapping", help="JSON file of RequestLog field -> path in each record, for other layouts")
    p.add_argument("--state", help="position file of --in (default: under $XDG_STATE_HOME/servewatch)")
    p.add_argument("--from", dest="start", choices=["beginning", "end"], default="beginning",
                   help="where --in starts without a saved position (default beginning)")  # fmt: skip
    p.add_argument("--no-follow", action="store_true", help="stop at the end of --in instead of following it")
    p.add_argument("--keep-prompt", action="store_true", help="ship prompts as logged (default: only prefix_hash)")
    p.add_argument("--prefix-chars", type=int, help="leading prompt characters hashed into prefix_hash (2000)")
    p.add_argument("--default", action="append", default=[], metavar="LABEL=VALUE", help="route, tenant, instance, "
                   "engine or engine_version for records without one (repeatable)")  # fmt: skip
    p.add_argument("--instance-from", metavar="PATH", help="a dotted path in each record naming its replica (pod, "
                   "kubernetes.node_name), shipped as instance (default: SERVEWATCH_SHIP_INSTANCE_FROM, else the "
                   "record's instance)")  # fmt: skip
    p.add_argument("--batch", type=int, help="records per message (default 500)")
    p.add_argument("--linger", help="how long a partly filled batch waits: 200ms (default), 1s")
    add_broker_flags(p)
    p.set_defaults(func=cmd_ship)
