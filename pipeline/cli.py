"""``servewatch``: the command line. Its modules (``cli*``) are the only ones that print.

Every command that needs Kafka takes ``--broker`` (or ``SERVEWATCH_BROKER``); without one it
starts the embedded Tansu broker on a free loopback port and stops it on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import orjson

from models.grouping import IncidentGrouper
from pipeline.broker import BrokerError, EmbeddedBroker
from pipeline.cli_common import (
    CommandError,
    Progress,
    add_embedded_flag,
    load_settings,
    settings_from,
    with_broker,
)
from pipeline.cli_scrape import cmd_scrape
from pipeline.cli_ship import cmd_ship
from pipeline.settings import Settings
from pipeline.tuning import tune_gc, tune_process
from schemas.anomaly import AnomalyEvent
from schemas.dead_letter import DeadLetter

if TYPE_CHECKING:  # imported where used: each command loads only what it needs
    from pipeline.engine_stage import JudgeEngines

logger = logging.getLogger("servewatch")


def cmd_broker(args: argparse.Namespace) -> int:
    # SIGTERM (a service manager, `kill`) ends the command as Ctrl-C does, so the context
    # manager stops the Tansu child and frees the port; left to its default, SIGTERM killed
    # this process and left the broker running.
    signal.signal(signal.SIGTERM, _interrupt)
    with EmbeddedBroker(port=args.port) as broker:
        print(f"broker ready: {broker.bootstrap}  (export SERVEWATCH_BROKER={broker.bootstrap}); Ctrl-C stops it")
        with contextlib.suppress(KeyboardInterrupt):
            while broker.running:
                time.sleep(0.5)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_worker(args: argparse.Namespace) -> int:
    import faust

    from pipeline.app import create_app

    with with_broker(settings_from(args), "worker", embedded=args.embedded) as settings:
        asyncio.run(_ensure_topics(settings))  # creates only what is missing
        app, _ = create_app(settings)
        tune_gc()  # again: Faust's app, topics and tables live as long as the process
        if settings.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(settings.metrics_port)
            logger.info("serving worker metrics on :%d/metrics", settings.metrics_port)
        worker = faust.Worker(app, loglevel=settings.log_level, quiet=True)
        worker.execute_from_commandline()  # runs until SIGTERM/SIGINT
    return 0


async def _ensure_topics(settings: Settings) -> None:
    from pipeline.kafka import ensure_topics

    assert settings.bootstrap is not None
    await ensure_topics(settings.bootstrap, settings.topic_partitions)


def cmd_demo(args: argparse.Namespace) -> int:
    from pipeline.demo import run_demo, start_worker, stop_worker, summarise

    if not args.speed > 0:
        raise CommandError(f"--speed must be above 0 (simulated seconds per wall second), got {args.speed}", "demo")
    started = time.monotonic()
    with with_broker(settings_from(args), "demo", embedded=True) as settings:
        assert settings.bootstrap is not None
        asyncio.run(_ensure_topics(settings))
        print("starting the servewatch worker ...", flush=True)
        worker = start_worker(settings.bootstrap)
        try:
            outcome = asyncio.run(run_demo(settings.bootstrap, speed=args.speed, out=lambda s: print(s, flush=True)))
        finally:
            stop_worker(worker)
    print("=== demo summary ===")
    for line in summarise(outcome):
        print(line)
    print(f"wall time {time.monotonic() - started:.0f} s")
    return 0 if outcome.surge_explained and outcome.cache_off_paged else 1


#: Lines per message when replaying a JSONL file: the worker's batched fast path, same code.
REPLAY_CHUNK_LINES = 1000


def _where(letter: DeadLetter) -> str:
    """'line N' of the replayed file, from the chunk number and the position in the chunk."""
    if letter.source_offset is None:
        return "a chunk"
    if letter.record_index is None:
        return f"chunk {letter.source_offset + 1}"
    return f"near line {letter.source_offset * REPLAY_CHUNK_LINES + letter.record_index + 1}"


def cmd_replay(args: argparse.Namespace) -> int:
    """Request logs and/or recorded scrapes through the detectors, no broker; events as JSONL.

    With both, the scrapes go first: request-log events then name the instances whose
    metrics said enable_prefix_caching=False, as the worker's do.
    """
    if not args.requests and not args.scrapes:
        print("servewatch replay: give --requests FILE, --scrapes FILE or both", file=sys.stderr)
        return 2
    settings = settings_from(args)
    out = sys.stdout.buffer if args.out == "-" else open(args.out, "wb")  # noqa: SIM115 - closed below
    writer = _Writer(out, args.format == "text")  # grouped as the worker's grouping agent does
    try:
        engines = _replay_scrapes(args.scrapes, settings, writer) if args.scrapes else None
        if args.requests:
            _replay_requests(args.requests, settings, writer, engines)
    except OSError as exc:
        print(f"servewatch replay: {exc}", file=sys.stderr)
        return 2
    finally:
        if out is not sys.stdout.buffer:
            out.close()
    return 0


class _Writer:
    """Replay's output: each incident event with its group, then the group's record if the
    group moved; as JSON lines, or as the demo's readable lines (``--format text``)."""

    def __init__(self, out: BinaryIO, text: bool) -> None:
        self.out, self.text, self.grouper = out, text, IncidentGrouper()
        self.seen: set[str] = set()  # incidents already shown (text): later events are updates

    def write(self, event: AnomalyEvent) -> None:
        from pipeline.event_text import event_text, group_text, utc

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
    from pipeline.scrape_replay import ScrapeReplay, ScrapeReplayStats

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
    from pipeline.replay import JsonlChunks, Replay, ReplayStats

    chunks = JsonlChunks(path, REPLAY_CHUNK_LINES)
    replay = Replay(settings, reread=chunks.reread if chunks.rereadable else None)
    started, line = time.monotonic(), Progress()

    def progress(stats: ReplayStats) -> None:
        rate = stats.records / max(time.monotonic() - started, 1e-9)
        line.show(f"{stats.messages:,} chunks, {stats.records:,} records, {stats.windows:,} windows, "
                  f"{stats.events:,} events ({rate:,.0f} rec/s)")  # fmt: skip

    for event in replay.run(chunks, progress):
        if engines is not None:
            engines.explain([event])
        writer.write(event)
    stats = replay.stats
    progress(stats)
    line.done()
    print(
        f"replayed {stats.records:,} request logs in {stats.windows:,} segment windows: {stats.events:,} anomaly "
        f"events, {stats.dead_letters:,} rejected records",
        file=sys.stderr,
    )
    for letter in stats.dead_letter_samples[:5]:
        print(f"  rejected ({letter.reason}) {_where(letter)}: {letter.error}", file=sys.stderr)


def cmd_schema(args: argparse.Namespace) -> int:
    from schemas import EXPORTED

    if args.name is None:  # the list
        for name, exported in EXPORTED.items():
            print(f"{name:16} {(exported.__doc__ or '').strip().splitlines()[0]}")
        return 0
    model = EXPORTED.get(args.name)
    if model is None:
        print(f"unknown schema {args.name!r}; choose from {', '.join(EXPORTED)}", file=sys.stderr)
        return 2
    text = orjson.dumps(model.model_json_schema(), option=orjson.OPT_INDENT_2).decode()
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Write the demo workload as JSONL, for trying ``replay`` without real logs."""
    from pipeline.workload import Workload, demo_phases

    workload = Workload(demo_phases(args.scale), seed=args.seed)
    count = 0
    with open(args.out, "wb") as out:
        for record in workload.records():
            out.write(orjson.dumps(record) + b"\n")
            count += 1
    print(f"wrote {count:,} request logs to {args.out}", file=sys.stderr)
    return 0


def _series_timestamp(text: str) -> float:
    """Unix seconds, unix milliseconds (Grafana's CSV export) or ISO-8601."""
    from datetime import UTC, datetime

    try:
        value = float(text)
    except ValueError:
        parsed = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()
    return value / 1000.0 if value > 1e11 else value


def _series_columns(
    path: str, fieldnames: list[str], time_column: str | None, value_column: str | None
) -> tuple[str, str]:
    """The time and value columns of an export: as given, else ``timestamp``/``time`` and
    ``value`` or the one other column (a Grafana export: ``time`` and the series' name)."""
    by_name = {name.strip().lower(): name for name in fieldnames}
    from models.series import LOAD_COLUMNS

    def pick(given: str | None, candidates: tuple[str, ...], what: str) -> str:
        if given is not None:
            if given.strip().lower() not in by_name:
                raise ValueError(f"{path}: no column {given!r} for {what}; columns are {fieldnames}")
            return by_name[given.strip().lower()]
        for name in candidates:
            if name in by_name:
                return by_name[name]
        raise ValueError(f"{path}: no {what} column among {fieldnames}; name it with --{what}-column")

    time_name = pick(time_column, ("timestamp", "time"), "time")
    known = {time_name.strip().lower(), *LOAD_COLUMNS, "trials"}
    others = tuple(name for name in by_name if name not in known)
    value_name = pick(value_column, ("value",) if "value" in by_name else others[:1] if len(others) == 1 else (),
                      "value")  # fmt: skip
    return time_name, value_name


def _read_series(
    path: str, time_column: str | None = None, value_column: str | None = None
) -> Iterator[dict[str, float]]:
    import csv

    from models.series import LOAD_COLUMNS

    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        fieldnames = list(reader.fieldnames or [])
        time_name, value_name = _series_columns(path, fieldnames, time_column, value_column)
        columns = {name.strip().lower(): name for name in fieldnames}
        optional = [name for name in (*LOAD_COLUMNS, "trials") if name in columns]
        for line, row in enumerate(reader, start=2):
            try:
                point = {"timestamp": _series_timestamp(row[time_name]), "value": float(row[value_name] or "nan")}
                for name in optional:
                    if row[columns[name]] not in (None, ""):
                        point[name] = float(row[columns[name]])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line}: {exc}") from None
            if math.isfinite(point["value"]):  # gaps in an export: skipped, not scored
                yield point


def _as_counts(points: list[dict[str, float]], kind: str, trials: int | None, path: str) -> None:
    """A rate series' values as counts of bad requests out of ``trials``, in place."""
    for point in points:
        n = point.get("trials", trials)
        if kind == "ratio":
            if n is None:
                raise ValueError(f"{path}: a ratio needs its requests: a 'trials' column or --trials N")
            if not 0.0 <= point["value"] <= 1.0:
                raise ValueError(f"{path}: ratio {point['value']} outside [0, 1] (percentages: divide by 100)")
            point["value"], point["trials"] = round(point["value"] * n), n
        else:
            if point["value"] != int(point["value"]):
                raise ValueError(f"{path}: {point['value']} is not a count of requests; for an error ratio pass "
                                 "--value-kind ratio (with --trials N or a trials column)")  # fmt: skip
            if n is not None:
                point["trials"] = n


def cmd_backtest_series(args: argparse.Namespace) -> int:
    """Score one exported series with a signal's model and its incident lifecycle, no look-ahead."""
    import csv

    from models.series import score_series
    from models.signals import BY_SIGNAL
    from schemas.anomaly import Signal

    settings = Settings()
    try:
        if args.signal not in {s.value for s in Signal} or Signal(args.signal) not in BY_SIGNAL:
            valid = ", ".join(sorted(s.value for s in BY_SIGNAL))
            raise ValueError(f"unknown --signal {args.signal!r}; one of {valid}")
        signal = Signal(args.signal)
        points = list(_read_series(args.input, args.time_column, args.value_column))
        if BY_SIGNAL[signal].kind == "rate":
            _as_counts(points, args.value_kind, args.trials, args.input)
    except (OSError, ValueError) as exc:
        print(f"servewatch backtest-series: {exc}", file=sys.stderr)
        return 2
    points.sort(key=lambda p: p["timestamp"])
    pages = 0
    out = sys.stdout if args.out == "-" else open(args.out, "w", newline="")  # noqa: SIM115
    try:
        writer = csv.writer(out)
        writer.writerow(["timestamp", "value", "anomaly_score", "is_anomaly", "status", "explained_by_load"])
        for p in score_series(points, signal, settings.threshold, settings.grace_windows):
            writer.writerow([f"{p.timestamp:.3f}", p.value, p.anomaly_score, str(p.is_anomaly).lower(), p.status,
                             str(p.explained_by_load).lower()])  # fmt: skip
            pages += p.is_anomaly
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"scored {len(points):,} points with the {signal.value} model: {pages:,} pages (incidents starting or "
          f"stepping up; threshold {settings.threshold})", file=sys.stderr)  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="servewatch", description="Streaming anomaly detection for LLM serving.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"servewatch {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("broker", help="run the embedded Kafka-compatible broker (Tansu) until Ctrl-C")
    p.add_argument("--port", type=int, default=0, help="loopback port (default: a free one)")
    p.set_defaults(func=cmd_broker)

    p = sub.add_parser("worker", help="run the detector worker (Faust)")
    p.add_argument("--broker", help="Kafka bootstrap host:port (default: SERVEWATCH_BROKER)")
    add_embedded_flag(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("demo", help="embedded broker + worker + scripted incidents, events printed live")
    p.add_argument("--broker", help="use this Kafka instead of the embedded broker")
    p.add_argument("--speed", type=float, default=25.0, help="simulated seconds per wall second (default 25)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("replay", help="run the detectors over request logs and/or recorded scrapes, no broker")
    p.add_argument("--requests", help="JSONL file of RequestLog records ('-' for stdin)")
    p.add_argument("--scrapes", help="JSONL file of recorded scrapes, as `scrape --record` writes them "
                   '({"timestamp", "instance", "body"} per line)')  # fmt: skip
    p.add_argument("--out", default="-", help="where to write the events (default stdout)")
    p.add_argument("--format", choices=("json", "text"), default="json", help="JSON lines (AnomalyEvent and "
                   "IncidentGroup records, default) or readable lines, as the demo prints them")  # fmt: skip
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("scrape", help="scrape vLLM/SGLang /metrics into canonical per-model intervals")
    p.add_argument("--target", action="append", required=True, help="metrics URL, e.g. http://10.0.0.7:8000/metrics "
                   "(repeat for more)")  # fmt: skip
    p.add_argument("--interval", default="10s", help="time between scrapes: 10s, 500ms, 1m (default 10s)")
    p.add_argument("--timeout", default="5s", help="per-scrape timeout (default 5s)")
    p.add_argument("--count", type=int, default=None, help="stop after this many rounds (default: until Ctrl-C)")
    p.add_argument("--give-up-after", default="5m", help="exit 1 when every target has been down this long "
                   "(default 5m; 0: never), so a supervisor sees it")  # fmt: skip
    p.add_argument("--record", help="append every good scrape to this JSONL file (timestamp, instance, body)")
    p.add_argument("--out", help="write intervals as JSONL here ('-' for stdout) instead of to Kafka")
    p.add_argument("--broker", help="Kafka bootstrap host:port (default: SERVEWATCH_BROKER)")
    add_embedded_flag(p)
    p.set_defaults(func=cmd_scrape)

    p = sub.add_parser("ship", help="ship request logs (JSONL file, stdin or HTTP) to the requests topic in batches")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", help="JSONL file, followed like tail -F (rotation, truncation, saved position)")
    source.add_argument("--stdin", action="store_true", help="read JSONL from standard input until it ends")
    source.add_argument("--listen", metavar="[HOST:]PORT", help="serve POST /v1/requests (one record or a JSON "
                        "array) on HOST:PORT (default host 127.0.0.1)")  # fmt: skip
    p.add_argument("--format", choices=["auto", "native", "openai"], default="auto", help="record layout: RequestLog "
                   "JSON, {response, request, timing} of an OpenAI-compatible server, or auto (default)")  # fmt: skip
    p.add_argument("--mapping", help="JSON file of RequestLog field -> path in each record, for other layouts")
    p.add_argument("--state", help="position file of --file (default: under $XDG_STATE_HOME/servewatch)")
    p.add_argument("--from", dest="start", choices=["beginning", "end"], default="beginning",
                   help="where --file starts without a saved position (default beginning)")  # fmt: skip
    p.add_argument("--no-follow", action="store_true", help="stop at the end of --file instead of following it")
    p.add_argument("--keep-prompt", action="store_true", help="ship prompts as logged (default: only prefix_hash)")
    p.add_argument("--prefix-chars", type=int, help="leading prompt characters hashed into prefix_hash (2000)")
    p.add_argument("--default", action="append", default=[], metavar="LABEL=VALUE", help="route, tenant, instance, "
                   "engine or engine_version for records without one (repeatable)")  # fmt: skip
    p.add_argument("--batch", type=int, help="records per message (default 500)")
    p.add_argument("--linger", help="how long a partly filled batch waits: 200ms (default), 1s")
    p.add_argument("--broker", help="Kafka bootstrap host:port (default: SERVEWATCH_BROKER)")
    add_embedded_flag(p)
    p.set_defaults(func=cmd_ship)

    p = sub.add_parser(
        "backtest-series", help="score one exported series (timestamp,value[,load columns]) with a signal's model"
    )
    p.add_argument("--in", dest="input", required=True, help="CSV with a time and a value column, and optional "
                   "load columns (requests_per_s, prompt_tokens_per_s, output_tokens_per_s) or trials")  # fmt: skip
    p.add_argument("--out", default="-", help="CSV to write (default stdout)")
    p.add_argument("--signal", default="ttft", help="whose model to use: ttft, itl, error_rate, cache_hit_rate, ...")
    p.add_argument("--time-column", help="the time column (default: timestamp or time; Grafana exports 'time')")
    p.add_argument("--value-column", help="the value column (default: value, or the one other column)")
    p.add_argument("--value-kind", choices=("count", "ratio"), default="count",
                   help="rate signals: bad requests per point (count) or their share (ratio)")  # fmt: skip
    p.add_argument("--trials", type=int, help="rate signals: requests per point, where there is no trials column")
    p.set_defaults(func=cmd_backtest_series)

    p = sub.add_parser("schema", help="print the JSON Schema of a wire format (without a name: list them)")
    p.add_argument("name", nargs="?", help="RequestLog, AnomalyEvent, IncidentGroup, EngineInterval or DeadLetter")
    p.add_argument("--out", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("generate", help="write the demo's synthetic workload as JSONL")
    p.add_argument("--out", required=True)
    p.add_argument("--scale", type=float, default=1.0, help="stretch every phase by this factor")
    p.add_argument("--seed", type=int, default=42)
    p.set_defaults(func=cmd_generate)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("servewatch")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        environment = load_settings()
    except CommandError as exc:
        print(exc.line(), file=sys.stderr)
        return 2
    if args.command in ("worker", "replay"):
        tune_process(environment.mmap_threshold_bytes)
    level = "DEBUG" if args.verbose else environment.log_level
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not args.verbose:
        # The Kafka client narrates every (re)connection, and httpx every request (a scrape
        # round is one per target), at INFO; keep the operator's view clean.
        for noisy in ("aiokafka", "httpx", "httpcore"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return int(args.func(args))
    except CommandError as exc:
        print(exc.line(), file=sys.stderr)
        return 2
    except BrokerError as exc:
        print(f"servewatch: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
