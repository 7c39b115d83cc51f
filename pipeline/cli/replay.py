"""``servewatch replay``: request logs and/or recorded scrapes through the detectors, no broker."""

from __future__ import annotations

import argparse
import sys
import time
from typing import IO, TYPE_CHECKING

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.pipeline.cli.common import Progress, Subcommands, add_out_flag, output, settings_from
from servewatch.pipeline.settings import Settings
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.dead_letter import DeadLetter

if TYPE_CHECKING:  # imported where used: a replay of request logs needs no engine code
    from servewatch.pipeline.worker.engine_stage import JudgeEngines


def _where(letter: DeadLetter) -> str:
    """'line N' of the replayed file, from the chunk number and the position in the chunk."""
    if letter.source_offset is None:
        return "a chunk"
    if letter.record_index is None:
        return f"chunk {letter.source_offset + 1}"
    from servewatch.pipeline.replay.request_logs import REPLAY_CHUNK_LINES

    return f"near line {letter.source_offset * REPLAY_CHUNK_LINES + letter.record_index + 1}"


def cmd_replay(args: argparse.Namespace) -> int:
    """Request logs and/or recorded scrapes through the detectors, no broker; events as JSONL.

    With both, the scrapes go first: request-log events then name the instances whose
    metrics said enable_prefix_caching=False, as the worker's do.
    """
    if not args.input and not args.scrapes:
        print("servewatch replay: give --in FILE (request logs), --scrapes FILE or both", file=sys.stderr)
        return 2
    settings = settings_from(args)
    try:
        with output(args.out) as out:
            writer = _Writer(out, args.format == "text")  # grouped as the worker's grouping agent does
            engines = _replay_scrapes(args.scrapes, settings, writer) if args.scrapes else None
            if args.input:
                _replay_requests(args.input, settings, writer, engines)
    except OSError as exc:
        print(f"servewatch replay: {exc}", file=sys.stderr)
        return 2
    return 0


class _Writer:
    """Replay's output: each incident event with its group, then the group's record if the
    group moved; as JSON lines, or as the demo's readable lines (``--format text``)."""

    def __init__(self, out: IO[bytes], text: bool) -> None:
        self.out, self.text, self.grouper = out, text, IncidentGrouper()
        self.seen: set[str] = set()  # incidents already shown (text): later events are updates

    def write(self, event: AnomalyEvent) -> None:
        from servewatch.models.explain.event_text import event_text, group_text, utc

        event, told = self.grouper.add(event)
        if self.text:
            lines = [event_text(event, utc(event.window_start), update=event.fingerprint in self.seen)]
            lines += [group_text(group) for group in told if group.transition != "update"]
            self.seen.add(event.fingerprint)
            self.out.write("\n".join(lines).encode() + b"\n")
            return
        self.out.write(event.model_dump_json().encode() + b"\n")
        for group in told:
            self.out.write(group.model_dump_json().encode() + b"\n")


def _replay_scrapes(path: str, settings: Settings, writer: _Writer) -> JudgeEngines:
    from servewatch.pipeline.replay.scrapes import ScrapeReplay, ScrapeReplayStats

    replay = ScrapeReplay(settings)
    started, line = time.monotonic(), Progress()

    def progress(stats: ScrapeReplayStats) -> None:
        rate = stats.scrapes / max(time.monotonic() - started, 1e-9)
        line.show(f"{stats.scrapes:,} scrapes, {stats.intervals:,} intervals, {stats.events:,} events "
                  f"({rate:,.0f} scrapes/s)")  # fmt: skip

    with sys.stdin.buffer if path == "-" else open(path, "rb") as lines:
        for event in replay.run(lines, progress):
            writer.write(event)
    stats = replay.stats
    progress(stats)
    line.done()
    print(f"replayed {stats.scrapes:,} scrapes into {stats.intervals:,} engine intervals: {stats.events:,} anomaly "
          f"events, {stats.rejected:,} rejected lines", file=sys.stderr)  # fmt: skip
    for letter in stats.rejected_samples[:5]:
        print(f"  rejected ({letter.reason}) line {letter.source_offset}: {letter.error}", file=sys.stderr)
    return replay.engines


def _replay_requests(path: str, settings: Settings, writer: _Writer, engines: JudgeEngines | None) -> None:
    from servewatch.pipeline.replay.request_logs import REPLAY_CHUNK_LINES, JsonlChunks, Replay, ReplayStats

    chunks = JsonlChunks(path, REPLAY_CHUNK_LINES)
    replay = Replay(settings, reread=chunks.reread if chunks.rereadable else None)
    started, line = time.monotonic(), Progress()

    def progress(stats: ReplayStats) -> None:
        rate = stats.records / max(time.monotonic() - started, 1e-9)
        line.show(f"{stats.messages:,} chunks, {stats.records:,} records, {stats.windows:,} windows, "
                  f"{stats.events:,} events ({rate:,.0f} rec/s)")  # fmt: skip

    for event in replay.run(chunks, progress):
        if engines is not None:
            [event] = engines.explain([event])
        writer.write(event)
    stats = replay.stats
    progress(stats)
    line.done()
    two, one = replay.stage_two, replay.stage_one.windower
    print(
        f"replayed {stats.records:,} request logs in {stats.windows:,} segment windows: {stats.events:,} anomaly "
        f"events; {two.judged_records:,} judged, {two.late_records:,} late (after their window, more than "
        f"{one.allowed_lateness:.1f} s behind), {one.duplicates:,} repeated request ids, "
        f"{stats.dead_letters:,} rejected",
        file=sys.stderr,
    )
    for letter in stats.dead_letter_samples[:5]:
        print(f"  rejected ({letter.reason}) {_where(letter)}: {letter.error}", file=sys.stderr)


def add_replay_parser(sub: Subcommands) -> None:
    p = sub.add_parser("replay", help="run the detectors over request logs and/or recorded scrapes, no broker")
    p.add_argument("--in", dest="input", metavar="PATH", help="JSONL file of RequestLog records ('-': stdin)")
    p.add_argument("--scrapes", metavar="PATH", help="JSONL file of recorded scrapes, as `scrape --record` writes "
                   'them ({"timestamp", "instance", "body"} per line)')  # fmt: skip
    add_out_flag(p, "the events")
    p.add_argument("--format", choices=("json", "text"), default="json", help="JSON lines (AnomalyEvent and "
                   "IncidentGroup records, default) or readable lines, as the demo prints them")  # fmt: skip
    p.set_defaults(func=cmd_replay)
