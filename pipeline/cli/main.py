"""``servewatch``: the parser and the small commands; ``pipeline/cli/`` is the only package that prints.

Every command that needs Kafka takes ``--broker`` (or ``SERVEWATCH_BROKER``); without one,
``worker``, ``ship`` and ``scrape`` refuse to run unless given ``--embedded`` (see
``common.with_broker``). A broker that cannot be reached, or refuses the credentials, is
one line naming it and what to check, exit 2 (``common.kafka_errors``). Each command
imports what it needs when it runs, so that ``servewatch --help`` stays quick.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
import sys
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, NoReturn

import orjson

import servewatch
from servewatch.pipeline.cli.backtest import add_backtest_parser
from servewatch.pipeline.cli.common import (
    CommandError,
    Subcommands,
    add_broker_flags,
    add_out_flag,
    describe_kafka_error,
    ensure_topics_of,
    hush_unclosed_clients,
    kafka_errors,
    load_settings,
    output,
    reach_broker,
    serve_metrics,
    settings_from,
    with_broker,
)
from servewatch.pipeline.cli.compare import add_compare_parser
from servewatch.pipeline.cli.loadgen import add_loadgen_parser
from servewatch.pipeline.cli.mark import add_mark_parsers, load_changes_config
from servewatch.pipeline.cli.notify import add_notify_parsers
from servewatch.pipeline.cli.profile import add_profile_parser
from servewatch.pipeline.cli.replay import add_replay_parser
from servewatch.pipeline.cli.scrape import add_scrape_parser
from servewatch.pipeline.cli.ship import add_ship_parser
from servewatch.pipeline.cli.tail import add_tail_parser
from servewatch.pipeline.cli.web import add_web_parser
from servewatch.pipeline.dev.broker import BrokerError, EmbeddedBroker
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.tuning import tune_gc, tune_process

if TYPE_CHECKING:  # imported where used: each command loads only what it needs
    pass

logger = logging.getLogger("servewatch")


def cmd_broker(args: argparse.Namespace) -> int:
    # SIGTERM (a service manager, `kill`) ends the command as Ctrl-C does, so the context
    # manager stops the Tansu child and frees the port; left to its default, SIGTERM killed
    # this process and left the broker running.
    from servewatch.pipeline.dev.apache_kafka import ApacheKafka, KafkaCluster

    signal.signal(signal.SIGTERM, _interrupt)
    broker: EmbeddedBroker | ApacheKafka | KafkaCluster
    if args.apache:  # a development aid: Apache Kafka from the jars Maven fetches once (Java 17+, mvn)
        broker = KafkaCluster(size=args.apache) if args.apache > 1 else ApacheKafka(port=args.port)
    else:
        broker = EmbeddedBroker(port=args.port)
    with broker:
        print(f"broker ready: {broker.bootstrap}  (export SERVEWATCH_BROKER={broker.bootstrap} "
              f"SERVEWATCH_BROKER_PROFILE={broker.profile}); Ctrl-C stops it")  # fmt: skip
        with contextlib.suppress(KeyboardInterrupt):
            while broker.running:
                time.sleep(0.5)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_worker(args: argparse.Namespace) -> int:
    import faust

    from servewatch.pipeline.cli.notify import load_notify_config
    from servewatch.pipeline.worker import create_app

    settings = settings_from(args)
    # The files first: a config that cannot work is said at once, not after the broker's wait.
    notify_config = (
        load_notify_config(settings.delivery.notify_config, "worker") if settings.delivery.notify_config else None
    )
    changes_config = load_changes_config(settings.changes.changes_config) if settings.changes.watch_changes else None
    with with_broker(settings, "worker", embedded=args.embedded) as settings:
        # The first contact (creates only the topics that are missing): a broker not up yet is
        # waited for (SERVEWATCH_BROKER_WAIT_S), one that refuses is one line.
        settings = asyncio.run(reach_broker(settings, "worker", functools.partial(ensure_topics_of, settings)))
        app, topics = create_app(settings)
        if notify_config is not None:  # the worker delivers too (`servewatch notify` does it on its own)
            from servewatch.pipeline.notify.agent import add_notifier

            add_notifier(app, topics, settings, notify_config)
        if changes_config is not None:  # verifies each change marker: ChangeReports, rollback conditions
            from servewatch.pipeline.changes.agent import add_change_watcher

            add_change_watcher(app, topics, settings, changes_config)
        tune_gc()  # again: Faust's app, topics and tables live as long as the process
        serve_metrics(settings, "worker")
        worker = faust.Worker(app, loglevel=settings.process.log_level, quiet=True)
        try:
            worker.execute_from_commandline()  # runs until SIGTERM/SIGINT (and exits through SystemExit)
        finally:
            from servewatch.pipeline.worker.metrics import accounting_line

            print(f"worker: {accounting_line()}", file=sys.stderr)
    return 0


#: Change verification in the demo: periods of simulated minutes (its cache-off phase lasts 4),
#: and a rollback condition on TTFT that the cache-off rollout crosses.
DEMO_CHANGES_CONFIG = """\
before: 3m
after: 3m
check_every: 1m
rollback:
  - {signal: ttft_p95, worse_by: 50%, scope: model, min_requests: 200}
"""


def cmd_demo(args: argparse.Namespace) -> int:
    from servewatch.pipeline.dev.children import start_announcing, stop
    from servewatch.pipeline.dev.demo import run_demo, start_worker, stop_worker, summarise
    from servewatch.pipeline.dev.demo_sinks import start_receiver
    from servewatch.pipeline.kafka import KafkaAuth

    if not args.speed > 0:
        raise CommandError(f"--speed must be above 0 (simulated seconds per wall second), got {args.speed}", "demo")
    started = time.monotonic()
    with with_broker(settings_from(args), "demo", embedded=True) as settings:
        assert settings.kafka.bootstrap is not None
        with kafka_errors(settings, "demo"):
            asyncio.run(ensure_topics_of(settings))
        receiver = start_receiver()
        print(f"local Slack/PagerDuty/Alertmanager/webhook receiver at {receiver.url}; the worker delivers there "
              f"({receiver.config})", flush=True)  # fmt: skip
        print("starting the servewatch worker ...", flush=True)
        changes = receiver.config.with_name("changes.yaml")  # the demo's periods: its phases last minutes
        changes.write_text(DEMO_CHANGES_CONFIG)
        worker = start_worker(settings.kafka.bootstrap, {"SERVEWATCH_BROKER_PROFILE": settings.kafka.broker_profile,
                                                   "SERVEWATCH_NOTIFY_CONFIG": str(receiver.config),
                                                   "SERVEWATCH_CHANGES_CONFIG": str(changes)})  # fmt: skip
        page_env = {"SERVEWATCH_BROKER": settings.kafka.bootstrap, "SERVEWATCH_METRICS_PORT": "0"}
        web, url = start_announcing(["servewatch", "web", "--port", "0"], "triage page: ", page_env)
        print(f"triage page: {url} (live while the demo runs; --stay keeps it up afterwards)", flush=True)
        try:
            auth = KafkaAuth.from_settings(settings)
            outcome = asyncio.run(
                run_demo(settings.kafka.bootstrap, speed=args.speed, out=lambda s: print(s, flush=True), auth=auth)
            )
            print("=== demo summary ===")
            for line in [*summarise(outcome), *receiver.summary()]:
                print(line)
            if args.stay:
                print(f"staying up: triage page {url}, broker {settings.kafka.bootstrap}; Ctrl-C ends", flush=True)
                with contextlib.suppress(KeyboardInterrupt):
                    while worker.poll() is None:
                        time.sleep(0.5)
        finally:
            stop(web)
            stop_worker(worker)
            receiver.stop()
    print(f"wall time {time.monotonic() - started:.0f} s")
    return 0 if outcome.surge_explained and outcome.cache_off_paged else 1


def cmd_schema(args: argparse.Namespace) -> int:
    from servewatch.schemas import EXPORTED

    if args.name is None:  # the list
        firsts = {name: ((model.__doc__ or "").strip().splitlines() or [""])[0] for name, model in EXPORTED.items()}
        text = "\n".join(f"{name:16} {first}" for name, first in firsts.items())
    else:  # one of EXPORTED (the parser's choices)
        text = orjson.dumps(EXPORTED[args.name].model_json_schema(), option=orjson.OPT_INDENT_2).decode()
    with output(args.out, "w") as out:
        out.write(text + "\n")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Write the demo workload as JSONL, for trying ``replay`` without real logs."""
    from servewatch.pipeline.dev.simulator import Workload, demo_phases

    workload = Workload(demo_phases(args.scale), seed=args.seed)
    count = 0
    with output(args.out) as out:
        for record in workload.records():
            out.write(orjson.dumps(record) + b"\n")
            count += 1
    print(f"wrote {count:,} request logs to {'stdout' if args.out == '-' else args.out}", file=sys.stderr)
    return 0


class _Parser(argparse.ArgumentParser):
    """A command line that cannot be parsed is one line (exit 2) saying what and where to look,
    not the whole usage block above it; ``-h`` still prints the usage. Subcommands' parsers
    are of the same class (``add_subparsers`` makes them so). ``commands``: the top-level
    parser's subcommand parsers by name (``build_parser``), which say what a command does not
    take, with its own name and ``-h``."""

    commands: Mapping[str, argparse.ArgumentParser] = MappingProxyType({})

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} -h)\n")


def add_broker_parser(sub: Subcommands) -> None:
    p = sub.add_parser("broker", help="run the embedded Kafka-compatible broker (Tansu) until Ctrl-C")
    p.add_argument("--port", type=int, default=0, help="loopback port (default: a free one)")
    p.add_argument("--apache", type=int, nargs="?", const=1, default=0, metavar="NODES",
                   help="Apache Kafka instead (KRaft; NODES > 1: a cluster, 3 replicas, min.insync.replicas 2), "
                        "from jars Maven fetches once into ~/.cache/servewatch (needs Java 17+ and mvn)")  # fmt: skip
    p.set_defaults(func=cmd_broker)


def add_worker_parser(sub: Subcommands) -> None:
    p = sub.add_parser("worker", help="run the detector worker (Faust)")
    add_broker_flags(p)
    p.set_defaults(func=cmd_worker)


def add_demo_parser(sub: Subcommands) -> None:
    p = sub.add_parser("demo", help="embedded broker + worker + scripted incidents, events printed live")
    p.add_argument("--broker", metavar="HOST:PORT", help="use this Kafka instead of the embedded broker")
    p.add_argument("--speed", type=float, default=25.0, help="simulated seconds per wall second (default 25)")
    p.add_argument("--stay", action="store_true", help="after the summary, keep broker, worker and triage page up "
                   "until Ctrl-C")  # fmt: skip
    p.set_defaults(func=cmd_demo)


def add_schema_parser(sub: Subcommands) -> None:
    p = sub.add_parser("schema", help="print the JSON Schema of a wire format (without a name: list them)")
    from servewatch.schemas import EXPORTED  # pydantic models only: cheap

    p.add_argument("name", nargs="?", choices=sorted(EXPORTED), metavar="NAME", help=", ".join(sorted(EXPORTED)))
    add_out_flag(p, "the schema (or the list)")
    p.set_defaults(func=cmd_schema)


def add_generate_parser(sub: Subcommands) -> None:
    p = sub.add_parser("generate", help="write the demo's synthetic workload as JSONL")
    add_out_flag(p, "the workload as JSONL")
    p.add_argument("--scale", type=float, default=1.0, help="stretch every phase by this factor")
    p.add_argument("--seed", type=int, default=42)
    p.set_defaults(func=cmd_generate)


#: Every command, in the order ``servewatch --help`` lists them; each declares its own parser.
COMMANDS: tuple[Callable[[Subcommands], None], ...] = (
    add_broker_parser,
    add_worker_parser,
    add_demo_parser,
    add_replay_parser,
    add_scrape_parser,
    add_ship_parser,
    add_backtest_parser,
    add_schema_parser,
    add_tail_parser,
    add_notify_parsers,
    add_web_parser,
    add_compare_parser,
    add_profile_parser,
    add_loadgen_parser,
    add_mark_parsers,
    add_generate_parser,
)


def build_parser() -> _Parser:
    about = "Streaming anomaly detection for LLM serving."
    top = _Parser(prog="servewatch", description=about)
    parser: argparse.ArgumentParser = top  # its subparsers are ArgumentParsers to the add_*_parser helpers
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"servewatch {servewatch.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    top.commands = sub.choices

    for add in COMMANDS:
        add(sub)
    _verbose_everywhere(parser)
    return top


def _verbose_everywhere(parser: argparse.ArgumentParser) -> None:
    """``-v`` after the command too (``servewatch worker -v``), as people type it; a command's
    own ``-v`` leaves the top-level one alone when absent (``SUPPRESS``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in set(action.choices.values()):
                command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                                     help="debug logging")  # fmt: skip
                _verbose_everywhere(command)


def _kafka_failure(exc: Exception, args: argparse.Namespace, environment: Settings) -> str | None:
    """The one line for a Kafka client's failure that no command turned into one (each does
    where its clients start: ``common.kafka_errors``); None for anything else."""
    if "aiokafka" not in sys.modules:  # no Kafka client was loaded, so none failed
        return None
    from aiokafka.errors import KafkaError

    if not isinstance(exc, KafkaError):
        return None
    settings = environment.updated(broker=args.broker) if getattr(args, "broker", None) else environment
    return describe_kafka_error(exc, settings) or f"Kafka {settings.kafka.bootstrap}: {type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        environment = load_settings()
    except CommandError as exc:
        print(exc.line(), file=sys.stderr)
        return 2
    if args.command in ("worker", "replay"):
        tune_process(environment.process.mmap_threshold_bytes)
    level = "DEBUG" if args.verbose else environment.process.log_level
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
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
        # A file named on the command line or in a setting: what and which, not a traceback.
        print(f"servewatch {args.command}: {exc.strerror}: {exc.filename}", file=sys.stderr)
        return 2
    except Exception as exc:
        line = _kafka_failure(exc, args, environment)
        if line is None:
            raise
        logger.debug("the Kafka client's error", exc_info=True)  # the traceback, with --verbose
        hush_unclosed_clients()
        print(f"servewatch {args.command}: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
