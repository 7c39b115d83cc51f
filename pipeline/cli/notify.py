"""``servewatch notify``, ``check-config`` and ``silence``: the delivery side of the CLI."""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
import time
import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import orjson
from pydantic import ValidationError

from servewatch.pipeline.cli.common import (
    CommandError,
    Subcommands,
    add_broker_flags,
    ensure_topics_of,
    kafka_errors,
    login_name,
    parse_time,
    reach_broker,
    serve_metrics,
    settings_from,
    with_broker,
)
from servewatch.pipeline.settings import Settings

if TYPE_CHECKING:
    from servewatch.pipeline.notify.config import NotifyConfig
    from servewatch.schemas.silence import Matcher


def load_notify_config(path: str, command: str) -> NotifyConfig:
    from servewatch.pipeline.config_files import ConfigError
    from servewatch.pipeline.notify.config import load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        problems = str(exc).splitlines()
        if len(problems) == 1:
            raise CommandError(f"{path}: {problems[0]}", command) from None
        listed = "\n".join(f"  {problem}" for problem in problems)
        raise CommandError(f"{path}: {len(problems)} problems\n{listed}", command) from None


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validate a notifier config as ``amtool check-config`` does: exit 0 and a summary, or 2 and why."""
    config = load_notify_config(args.path, "check-config")
    print(f"{args.path}: valid; {len(config.sinks)} sink(s), {len(config.enabled_sinks)} enabled")
    for sink in config.sinks:
        timing, route = config.timing_of(sink), sink.route
        where = []
        if route.models:
            where.append(f"models {','.join(route.models)}")
        if route.signals:
            where.append(f"signals {','.join(s.value for s in route.signals)}")
        if route.causes:
            where.append(f"causes {','.join(route.causes)}")
        where += [f"{k}={v}" for k, v in route.labels.items()] + [str(m) for m in route.matchers]
        if route.explained_by_load is not None:
            where.append(f"explained_by_load={str(route.explained_by_load).lower()}")
        print(f"  {sink.name} ({sink.type}{'' if sink.enabled else ', disabled'}): {route.min_severity.value} and up"
              f"{'; ' + '; '.join(where) if where else ''}; group_wait {timing.group_wait:g}s, group_interval "
              f"{timing.group_interval:g}s, repeat_interval {timing.repeat_interval:g}s")  # fmt: skip
    return 0


def cmd_notify(args: argparse.Namespace) -> int:
    """Run the notifier on its own (its own consumer group and state table)."""
    import faust

    from servewatch.pipeline.notify.agent import add_notifier
    from servewatch.pipeline.streams.faust_app import faust_app
    from servewatch.pipeline.topics import declare_topics

    path = args.config or settings_from(args).delivery.notify_config
    if not path:
        raise CommandError("no config: pass --config FILE or set SERVEWATCH_NOTIFY_CONFIG", "notify")
    config = load_notify_config(path, "notify")
    with with_broker(settings_from(args), "notify", embedded=args.embedded) as settings:
        # A broker not up yet is waited for (SERVEWATCH_BROKER_WAIT_S), one that refuses is one line.
        asyncio.run(reach_broker(settings, "notify", functools.partial(ensure_topics_of, settings)))
        app = faust_app(settings, app_id=notify_app_id(settings))
        add_notifier(app, declare_topics(app, settings.kafka.topic_partitions), settings, config)
        serve_metrics(settings, "notifier")
        faust.Worker(app, loglevel=settings.process.log_level, quiet=True).execute_from_commandline()
    return 0


def notify_app_id(settings: Settings) -> str:
    """A notifier of its own has its own consumer group: it reads every anomaly, as the worker does."""
    return f"{settings.kafka.app_id}-notify"


def parse_matcher(text: str) -> Matcher:
    """A matcher as typed on the command line (Alertmanager's form: ``model=~"llama.*"``)."""
    from servewatch.schemas.silence import Matcher

    try:
        return Matcher.model_validate(text)
    except ValidationError as exc:  # its first message, without pydantic's field path and link
        raise CommandError(exc.errors(include_url=False)[0]["msg"].removeprefix("Value error, "), "silence") from None


def _when(text: str | None, default: float) -> float:
    return default if text is None else parse_time(text, "silence", "--start/--end")


def _bootstrap(args: argparse.Namespace) -> tuple[str, Settings]:
    settings = settings_from(args)
    if settings.kafka.bootstrap is None:
        raise CommandError("no Kafka broker: give --broker HOST:PORT or set SERVEWATCH_BROKER", "silence")
    return settings.kafka.bootstrap, settings


def cmd_silence_add(args: argparse.Namespace) -> int:
    from servewatch.pipeline.durations import parse_duration
    from servewatch.pipeline.kafka import KafkaAuth
    from servewatch.pipeline.notify.silence_store import write_silence
    from servewatch.schemas.silence import UNTIL_EXPIRED, Recurrence, Silence

    bootstrap, settings = _bootstrap(args)
    start = _when(args.start, time.time())
    if args.end is not None:
        end = _when(args.end, start)
    elif args.daily and args.duration is None:
        end = UNTIL_EXPIRED  # a maintenance schedule recurs until it is expired
    else:
        try:
            end = start + float(parse_duration(args.duration or "2h"))
        except ValueError as exc:
            raise CommandError(str(exc), "silence") from None
    recurrence = None
    if args.daily:
        begin, _, until = args.daily.partition("-")
        days = [d.strip().lower()[:3] for d in args.weekdays.split(",")] if args.weekdays else None
        try:
            recurrence = Recurrence(start=begin, end=until, **({"weekdays": days} if days else {}))
        except ValueError as exc:
            raise CommandError(f"--daily/--weekdays: {exc}", "silence") from None
    try:
        silence = Silence(id=args.id or uuid.uuid4().hex[:12], matchers=[parse_matcher(m) for m in args.matcher],
                          starts_at=start, ends_at=end, recurrence=recurrence, created_by=args.author or login_name(),
                          comment=args.comment)  # fmt: skip
    except ValueError as exc:
        raise CommandError(str(exc), "silence") from None
    with kafka_errors(settings, "silence"):
        asyncio.run(write_silence(bootstrap, silence, KafkaAuth.from_settings(settings)))
    print(silence.id)
    return 0


def cmd_silence_list(args: argparse.Namespace) -> int:
    from servewatch.pipeline.kafka import KafkaAuth
    from servewatch.pipeline.notify.silence_store import read_silences
    from servewatch.pipeline.notify.silences import state_of
    from servewatch.schemas.silence import UNTIL_EXPIRED

    bootstrap, settings = _bootstrap(args)
    now = time.time()
    with kafka_errors(settings, "silence"):
        silences = asyncio.run(read_silences(bootstrap, KafkaAuth.from_settings(settings)))
    shown = [s for s in silences if args.all or state_of(s, now) != "expired"]
    for silence in shown:
        if args.format == "json":
            print(orjson.dumps({**silence.model_dump(mode="json"), "state": state_of(silence, now)}).decode())
            continue
        until = "until expired" if silence.ends_at >= UNTIL_EXPIRED else _iso(silence.ends_at)
        span = f"{_iso(silence.starts_at)} .. {until}"
        if silence.recurrence:
            rule = silence.recurrence
            span += f", {','.join(rule.weekdays)} {rule.start}-{rule.end} UTC"
        print(f"{silence.id}  {state_of(silence, now):8}  {' '.join(str(m) for m in silence.matchers)}  {span}"
              f"  {silence.created_by}: {silence.comment}")  # fmt: skip
    if args.format == "text" and not shown:
        print("no silences", file=sys.stderr)
    return 0


def cmd_silence_expire(args: argparse.Namespace) -> int:
    from servewatch.pipeline.kafka import KafkaAuth
    from servewatch.pipeline.notify.silence_store import read_silences, write_silence

    bootstrap, settings = _bootstrap(args)
    auth = KafkaAuth.from_settings(settings)
    with kafka_errors(settings, "silence"):
        known = {s.id: s for s in asyncio.run(read_silences(bootstrap, auth))}
    for silence_id in args.ids:
        if silence_id not in known:
            raise CommandError(f"no silence with id {silence_id!r} (see `servewatch silence list --all`)", "silence")
    now = time.time()
    for silence_id in args.ids:
        silence = known[silence_id]
        expired = silence.model_copy(update={"ends_at": max(silence.starts_at, min(silence.ends_at, now))})
        with kafka_errors(settings, "silence"):
            asyncio.run(write_silence(bootstrap, expired, auth))
        print(f"expired {silence_id}")
    return 0


def _iso(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%MZ")


def add_notify_parsers(sub: Subcommands) -> None:
    p = sub.add_parser("notify", help="deliver anomalies to Slack, PagerDuty, Alertmanager and webhooks")
    p.add_argument("--config", help="the notifier's config file, YAML or TOML (default: SERVEWATCH_NOTIFY_CONFIG)")
    add_broker_flags(p)
    p.set_defaults(func=cmd_notify)

    p = sub.add_parser("check-config", help="validate a notifier config file and summarise its routes")
    p.add_argument("path", help="the YAML or TOML file")
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("silence", help="mute notifications that match, for a while or on a weekly schedule")
    verbs = p.add_subparsers(dest="verb", required=True)
    add = verbs.add_parser("add", help="add a silence (prints its id)")
    add.add_argument(
        "matcher", nargs="+", help='label matchers: model=llama-70b, severity!=critical, route=~"chat|rag"'
    )
    add.add_argument("--duration", help="how long from --start (default 2h, or with --daily until expired; "
                     "ignored with --end)")  # fmt: skip
    add.add_argument("--start", help="Unix seconds or ISO time (default now)")
    add.add_argument("--end", help="Unix seconds or ISO time")
    add.add_argument("--daily", metavar="HH:MM-HH:MM", help="a recurring maintenance window (UTC) within start..end")
    add.add_argument("--weekdays", help="with --daily: mon,tue,... (default every day)")
    add.add_argument("--comment", default="", help="why")
    # --by as for ``mark``; --author, Alertmanager's word (amtool's flag), is taken too.
    add.add_argument("--by", "--author", dest="author", help="who (default: this user's login name)")
    add.add_argument("--id", help="the silence's id (default: a random one)")
    expire = verbs.add_parser("expire", help="end silences now")
    expire.add_argument("ids", nargs="+")
    show = verbs.add_parser("list", help="active and pending silences")
    show.add_argument("--all", action="store_true", help="expired ones too")
    show.add_argument("--format", choices=("text", "json"), default="text", help="readable lines (default) or JSON")
    for verb, func in ((add, cmd_silence_add), (expire, cmd_silence_expire), (show, cmd_silence_list)):
        verb.add_argument("--broker", metavar="HOST:PORT", help="Kafka bootstrap servers (default: SERVEWATCH_BROKER)")
        verb.set_defaults(func=func)
