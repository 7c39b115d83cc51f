"""``servewatch mark`` (a change marker onto ``servewatch.changes``) and ``servewatch changes``
(the markers with their latest verification report)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from pydantic import ValidationError

if TYPE_CHECKING:  # numpy-backed: loaded when a command needs it
    from servewatch.pipeline.changes.config import ChangesConfig
from servewatch.pipeline.changes.render import render
from servewatch.pipeline.cli.common import (
    CommandError,
    Subcommands,
    add_broker_flags,
    kafka_errors,
    login_name,
    parse_time,
    settings_from,
    with_broker,
)


def add_mark_parsers(sub: Subcommands) -> None:
    p = sub.add_parser("mark", help="mark a change (deploy, config flip) of a model: verified live, named on incidents")
    p.add_argument("--model", required=True, help="the model changed")
    p.add_argument("--desc", required=True, help='what changed, e.g. "enable prefix caching"')
    p.add_argument("--instance", help="the one instance changed (default: all of the model's)")
    p.add_argument("--label", action="append", default=[], metavar="K=V", help="a free-form label (deploy id, "
                   "ticket, version); repeatable")  # fmt: skip
    p.add_argument("--at", metavar="TIME", help="when it took effect: ISO-8601 or unix seconds (default: now)")
    p.add_argument("--id", help="the change's id (default: a new UUID)")
    p.add_argument("--by", help="who made it (default: the login name)")
    add_broker_flags(p)
    p.set_defaults(func=cmd_mark)

    p = sub.add_parser("changes", help="list change markers with their latest verification report")
    p.add_argument("--model", help="only this model's")
    p.add_argument("--format", choices=("text", "json"), default="text", help="text (default) or JSON lines")
    add_broker_flags(p)
    p.set_defaults(func=cmd_changes)


def parse_labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CommandError(f"--label {item!r}: write KEY=VALUE", "mark")
        labels[key.strip()] = value.strip()
    return labels


def cmd_mark(args: argparse.Namespace) -> int:
    from servewatch.pipeline.changes.store import write_marker
    from servewatch.pipeline.kafka import KafkaAuth
    from servewatch.schemas.change_marker import ChangeMarker

    try:
        at = parse_time(args.at, "mark") if args.at else time.time()
        marker = ChangeMarker(id=args.id or str(uuid.uuid4()), at=at,
                              model=args.model, instance=args.instance, labels=parse_labels(args.label),
                              description=args.desc, by=args.by if args.by is not None else login_name(),
                              source="cli")  # fmt: skip
    except ValidationError as exc:
        raise CommandError("; ".join(f"{e['loc'][0]}: {e['msg']}" for e in exc.errors()), "mark") from None
    with with_broker(settings_from(args), "mark", embedded=args.embedded) as settings, kafka_errors(settings, "mark"):
        assert settings.kafka.bootstrap is not None
        asyncio.run(write_marker(settings.kafka.bootstrap, marker, KafkaAuth.from_settings(settings)))
    print(marker.id)
    return 0


def cmd_changes(args: argparse.Namespace) -> int:
    from servewatch.pipeline.changes.store import read_changes
    from servewatch.pipeline.kafka import KafkaAuth

    with (
        with_broker(settings_from(args), "changes", embedded=args.embedded) as settings,
        kafka_errors(settings, "changes"),
    ):
        assert settings.kafka.bootstrap is not None
        markers, reports = asyncio.run(read_changes(settings.kafka.bootstrap, KafkaAuth.from_settings(settings)))
    latest = {report.change: report for report in reports if report.change}
    for marker in markers:
        if args.model and marker.model != args.model:
            continue
        report = latest.get(marker.id)
        if args.format == "json":
            print(marker.model_dump_json())
            if report is not None:
                print(report.model_dump_json())
            continue
        when = datetime.fromtimestamp(marker.at, UTC).strftime("%Y-%m-%d %H:%M:%S")
        where = f" ({marker.instance})" if marker.instance else ""
        print(f"change {marker.id} on {marker.model}{where} at {when} by {marker.by or '-'}: '{marker.description}'")
        if report is None:
            print("  no report yet (the worker verifies a change as its period after fills)")
            continue
        state = "final" if report.final else "interim"
        print(f"  {state} report:\n" + "\n".join("    " + line for line in render(report).splitlines()))
        for check in report.rollback:
            print(f"    rollback condition {'HOLDS' if check.holds else 'holds not'}: {check.condition}; "
                  f"{check.detail}")  # fmt: skip
    sys.stdout.flush()
    return 0


def load_changes_config(path: str | None, command: str = "worker") -> ChangesConfig:
    """The worker's change verification config (``SERVEWATCH_CHANGES_CONFIG``), errors located."""
    from servewatch.pipeline.changes.config import load_changes_config as load
    from servewatch.pipeline.config_files import ConfigError

    try:
        return load(path)
    except ConfigError as exc:
        raise CommandError(f"{path}: {exc}", command) from None
