"""``servewatch tail``: the anomaly topic as it arrives, readable or as JSON, filtered.

Incident events and group records print as the demo shows them (``models.explain.event_text``),
the head line coloured by severity on a terminal (never when piped, or with ``NO_COLOR``);
``--format json`` prints each record as it is on the topic.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from dataclasses import dataclass
from typing import TextIO

from servewatch.models.detect.lifecycle import SEVERITY_RANK
from servewatch.models.explain.event_text import event_text, group_text, utc
from servewatch.pipeline.cli.common import CommandError, Subcommands, kafka_errors, settings_from
from servewatch.schemas.anomaly import AnomalyEvent, Signal
from servewatch.schemas.incident_group import IncidentGroup, parse_anomaly_record

#: ANSI colours of a head line by severity.
COLOURS = {"critical": "\033[1;31m", "warning": "\033[33m", "info": "\033[36m"}
RESET = "\033[0m"


@dataclass(frozen=True)
class Filters:
    """Which records to show: all of the given conditions hold (none given: every record)."""

    model: str | None = None
    signal: str | None = None
    severity: str | None = None  # at least this severe
    paging_only: bool = False

    def keep(self, record: AnomalyEvent | IncidentGroup) -> bool:
        if isinstance(record, IncidentGroup):
            model, signals = record.model, {s.value for s in record.signals}
        else:
            model, signals = record.segment.get("model", "other"), {record.signal.value}
        if self.model is not None and model != self.model:
            return False
        if self.signal is not None and self.signal not in signals:
            return False
        if self.severity is not None and SEVERITY_RANK[record.severity.value] < SEVERITY_RANK[self.severity]:
            return False
        return not self.paging_only or record.pages


def render(record: AnomalyEvent | IncidentGroup, colour: bool) -> str:
    text = group_text(record) if isinstance(record, IncidentGroup) else event_text(record, utc(record.window_start))
    if not colour:
        return text
    head, _, rest = text.partition("\n")
    coloured = f"{COLOURS.get(record.severity.value, '')}{head}{RESET}"
    return f"{coloured}\n{rest}" if rest else coloured


def wants_colour(stream: TextIO) -> bool:
    return stream.isatty() and "NO_COLOR" not in os.environ


def cmd_tail(args: argparse.Namespace) -> int:
    """Print the anomaly topic's records as they arrive (``--from-beginning``: from the start)."""
    from servewatch.pipeline import topics
    from servewatch.pipeline.kafka import KafkaAuth, read_topic

    settings = settings_from(args)
    bootstrap = settings.kafka.bootstrap
    if bootstrap is None:
        raise CommandError("no Kafka broker: give --broker HOST:PORT or set SERVEWATCH_BROKER", "tail")
    filters = Filters(args.model, args.signal, args.severity, args.paging_only)
    colour = args.format == "text" and wants_colour(sys.stdout)

    async def follow() -> int:
        shown = 0
        async for raw in read_topic(bootstrap, topics.ANOMALIES, from_beginning=args.from_beginning,
                                    auth=KafkaAuth.from_settings(settings)):  # fmt: skip
            try:
                record = parse_anomaly_record(raw)
            except ValueError as exc:
                print(f"servewatch tail: unreadable record skipped ({exc})", file=sys.stderr)
                continue
            if not filters.keep(record):
                continue
            print(raw.decode() if args.format == "json" else render(record, colour), flush=True)
            shown += 1
            if args.count is not None and shown >= args.count:
                break
        return shown

    # Its one client bootstraps once: any failure to connect is the command's, one line.
    with kafka_errors(settings, "tail"), contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a tail ends
        asyncio.run(follow())
    return 0


def add_tail_parser(sub: Subcommands) -> None:
    p = sub.add_parser("tail", help="print anomaly events and incident groups as they arrive, filtered")
    p.add_argument("--format", choices=("text", "json"), default="text", help="readable lines, coloured by "
                   "severity on a terminal (default), or each record as JSON")  # fmt: skip
    p.add_argument("--model", help="only this model's records")
    p.add_argument("--signal", choices=[signal.value for signal in Signal], metavar="SIGNAL",
                   help="only records of this signal (a group: one of its signals): "
                   + ", ".join(signal.value for signal in Signal))  # fmt: skip
    p.add_argument("--severity", choices=tuple(SEVERITY_RANK), help="only this severe or more")
    p.add_argument("--paging-only", action="store_true", help="only records that page")
    p.add_argument("--from-beginning", action="store_true", help="from the topic's start, not only new records")
    p.add_argument("--count", type=int, help="stop after this many records (default: until Ctrl-C)")
    p.add_argument("--broker", metavar="HOST:PORT", help="Kafka bootstrap servers (default: SERVEWATCH_BROKER)")
    p.set_defaults(func=cmd_tail)
