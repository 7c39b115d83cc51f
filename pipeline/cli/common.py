"""What every ``servewatch`` command shares: settings from its arguments, a broker to talk to,
and the errors a command line reports in one line instead of a traceback."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import getpass
import logging
import os
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import IO, TYPE_CHECKING, Any, NamedTuple, TextIO, TypeVar

from pydantic import ValidationError

from servewatch.pipeline.dev.broker import EmbeddedBroker
from servewatch.pipeline.notify.config import ENV_PREFIX as NOTIFY_PREFIX
from servewatch.pipeline.settings import Settings, variable_names
from servewatch.schemas.request_log import RequestLog

if TYPE_CHECKING:
    from servewatch.pipeline.cli.metrics_server import Command

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CommandError(Exception):
    """A command cannot run as asked; its message is the one line the user sees (exit 2),
    after ``servewatch <command>:`` when the command is known."""

    def __init__(self, message: str, command: str | None = None) -> None:
        super().__init__(message)
        self.command = command

    def line(self) -> str:
        return f"servewatch {self.command}: {self}" if self.command else f"servewatch: {self}"


class BrokerUnreachable(CommandError):
    """``kafka_errors``' error for a broker that was not reached at all (connection refused,
    name not resolved, no answer), as opposed to one that answered and refused: only this one
    may pass by waiting (``reach_broker``). ``reason``: the cause, as the line gives it."""

    def __init__(self, message: str, command: str | None, reason: str) -> None:
        super().__init__(message, command)
        self.reason = reason


def settings_from(args: argparse.Namespace, **overrides: object) -> Settings:
    """Settings from the environment (read once), with the command's --broker and ``overrides``
    on top; a bad value is a ``CommandError`` naming the variable and what it accepts."""
    values = {k: v for k, v in overrides.items() if v is not None}
    if getattr(args, "broker", None):
        values["broker"] = args.broker
    return load_settings(**values)


def load_settings(**values: object) -> Settings:
    warn_unknown_variables()
    try:
        return Settings(**values)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise CommandError(describe_settings_error(exc)) from None


def describe_settings_error(exc: ValidationError) -> str:
    """One line per bad setting: the environment variable, what it got, what it accepts."""
    lines = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else "?"
        got = error.get("input")
        lines.append(f"SERVEWATCH_{name.upper()}={got!s}: {error['msg']}")
    return "; ".join(lines)


#: ``SERVEWATCH_*`` variables read outside ``Settings``: the Apache Kafka jars of the test
#: brokers (``pipeline.dev.apache_kafka``).
OTHER_VARIABLES = frozenset({"SERVEWATCH_KAFKA_JARS"})


def known_variables() -> frozenset[str]:
    """Every ``SERVEWATCH_*`` name read as it is (the notifier's sink fields are a family)."""
    return variable_names() | OTHER_VARIABLES


def variable_is_read(variable: str, known: frozenset[str] | None = None) -> bool:
    """Whether something reads ``variable``: a setting, one of ``OTHER_VARIABLES``, or a
    notifier sink's field, ``SERVEWATCH_NOTIFY__<SINK>__<FIELD>``. The notify config checks
    the sink and the field when it loads (a sink not in the file is refused there), so only
    the shape is checked here."""
    if variable in (known_variables() if known is None else known):
        return True
    sink, _, field = variable.removeprefix(NOTIFY_PREFIX).partition("__")
    return variable.startswith(NOTIFY_PREFIX) and bool(sink) and bool(field)


def warn_unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """A ``SERVEWATCH_*`` variable nothing reads is a typo more often than not: say so, with
    the closest known name. Returns the variables warned about."""
    environ = os.environ if environ is None else environ
    known = known_variables()
    unknown = sorted(v for v in environ if v.startswith("SERVEWATCH_") and not variable_is_read(v, known))
    for variable in unknown:
        logger.warning("unknown setting %s ignored%s", variable, _hint(variable, sorted(known)))
    return unknown


def _hint(variable: str, names: list[str]) -> str:
    if variable.startswith("SERVEWATCH_NOTIFY") and "__" in variable:  # meant as a sink's field
        return f"; a notifier sink's field is {NOTIFY_PREFIX}<SINK NAME>__<FIELD>"
    close = difflib.get_close_matches(variable, names, n=1)
    return f"; did you mean {close[0]}?" if close else ""


@contextlib.contextmanager
def with_broker(settings: Settings, command: str, embedded: bool = False) -> Iterator[Settings]:
    """``settings`` with a broker: the configured one, or, only where asked for (``embedded``:
    the demo, or ``--embedded``), an in-memory one for the duration. Anything else without a
    broker is refused: a worker or shipper that quietly talks to a throwaway broker loses
    what it reads or sends. A refusal of the command's credentials, whenever it comes, is
    one line (``kafka_errors``)."""
    if settings.kafka.bootstrap is not None:
        with kafka_errors(settings, command, connecting=False):
            yield settings
        return
    if not embedded:
        raise CommandError(
            "no Kafka broker: pass --broker HOST:PORT or set SERVEWATCH_BROKER (for a local one, run "
            "`servewatch broker` in another shell; --embedded uses a throwaway in-memory broker)",
            command,
        )
    with EmbeddedBroker() as broker:
        print(f"embedded Kafka-compatible broker (Tansu) at {broker.bootstrap}", file=sys.stderr)
        yield settings.updated(broker=broker.bootstrap, broker_profile="tansu")


#: aiokafka's records of a bootstrap server it could not connect to, or not ask for metadata
#: (the forms naming a node id come from a client already running, and stay in the log).
_BOOTSTRAP_FAILURES = ('Unable connect to "', 'Unable to request metadata from "')


class _ClientFailures(logging.Filter):
    """Holds aiokafka's log records of a client that could not connect, for ``kafka_errors``
    to say in the command's one line what went wrong: a refused authentication always (the
    client then raises only "Unable to bootstrap"), any other bootstrap failure while a
    command is connecting (a running command's reconnections stay in its log)."""

    def __init__(self) -> None:
        super().__init__()
        self.connecting = 0  # open ``kafka_errors(connecting=True)`` scopes
        self.authentication: list[str] = []
        self.connection: list[BaseException | str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        from aiokafka.errors import AuthenticationFailedError, SaslAuthenticationFailed

        args = record.args if isinstance(record.args, tuple) else ()
        refused = [str(arg) for arg in args if isinstance(arg, AuthenticationFailedError | SaslAuthenticationFailed)]
        if refused:
            self.authentication += refused
            return False
        if self.connecting and isinstance(record.msg, str) and record.msg.startswith(_BOOTSTRAP_FAILURES):
            errors = [arg for arg in args if isinstance(arg, BaseException)]
            self.connection.append(errors[-1] if errors else record.getMessage())
            return False
        return True


class _ActiveFailures:
    """The one ``_ClientFailures`` on aiokafka's logger while any ``kafka_errors`` scope is
    open (nested scopes share it: a filter that dropped a record hides it from the next)."""

    filter: _ClientFailures | None = None


class _UnclosedClients(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unclosed AIOKafka")


def hush_unclosed_clients() -> None:
    """After a command's one line about a Kafka client's failure: that client, collected as
    the command ends, would add asyncio's "Unclosed AIOKafkaConsumer" (a client whose start
    failed is never stopped), a second message about the same failure."""
    logging.getLogger("asyncio").addFilter(_UnclosedClients())


@contextlib.contextmanager
def kafka_errors(settings: Settings, command: str, *, connecting: bool = True) -> Iterator[None]:
    """A Kafka client of the command that cannot connect: one line (``CommandError``, exit 2)
    naming the broker and what to check, instead of aiokafka's log records and a traceback;
    a ``BrokerUnreachable`` when the broker was not reached at all (``reach_broker`` waits).

    ``connecting``: the command is starting its clients (or is a one-shot command), and every
    bootstrap failure is the command's failure. Without it (around a long-running command's
    whole run, where clients reconnect and retry on their own) only a refused authentication
    is held back and reported; the rest stays in the log as it happens."""
    from aiokafka.errors import KafkaError

    outermost = _ActiveFailures.filter is None
    if _ActiveFailures.filter is None:
        _ActiveFailures.filter = _ClientFailures()
        logging.getLogger("aiokafka").addFilter(_ActiveFailures.filter)
    failures = _ActiveFailures.filter
    failures.connecting += connecting
    try:
        yield
    except KafkaError as exc:
        described = _describe(exc, settings, failures.authentication, failures.connection if connecting else [])
        if described is None or not (connecting or failures.authentication or _refused(exc)):
            raise
        logger.debug("the Kafka client's error", exc_info=True)  # the traceback, with --verbose
        failures.authentication.clear()
        failures.connection.clear()
        hush_unclosed_clients()
        if described.unreachable is not None:
            raise BrokerUnreachable(described.line, command, described.unreachable) from None
        raise CommandError(described.line, command) from None
    else:
        if connecting and failures.connection:  # held back, and a later attempt connected (another server)
            logger.warning("Kafka %s: %d failed connection attempt(s) before connecting; the last: %s",
                           settings.kafka.bootstrap, len(failures.connection), failures.connection[-1])  # fmt: skip
            failures.connection.clear()
    finally:
        failures.connecting -= connecting
        if outermost:
            logging.getLogger("aiokafka").removeFilter(failures)
            _ActiveFailures.filter = None
            if failures.authentication:  # not raised here (a Faust worker's clients): not hidden either
                logger.error(
                    "authentication failed at Kafka %s: %s", settings.kafka.bootstrap, failures.authentication[-1]
                )


#: ``reach_broker``'s pause after its first failed attempt, doubled after each until this longest.
BROKER_RETRY_FIRST_S = 1.0
BROKER_RETRY_MAX_S = 15.0


async def reach_broker(
    settings: Settings,
    command: str,
    contact: Callable[[], Awaitable[T]],
    *,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """A long-running command's first contact with its broker: ``contact()`` (in
    ``kafka_errors``), what it returns.

    A service manager (systemd, Kubernetes, compose) often starts the command before its
    broker is up; failing at once would only make it a crash loop. So a broker that cannot
    be reached is tried again, with pauses from 1 s doubling up to 15 s, until
    ``broker_wait_s`` has passed; then its one line, as without waiting. A broker that
    answers and refuses (credentials, TLS, SASL) or any other error is the one line at once:
    waiting would not change it. One warning at the first failure, one info line when a
    later attempt connects; aiokafka's records of each attempt stay held back as in
    ``kafka_errors``. ``sleep`` and ``clock``: the tests' fakes."""
    deadline = clock() + settings.kafka.broker_wait_s
    pause, failed = BROKER_RETRY_FIRST_S, 0
    while True:
        try:
            with kafka_errors(settings, command):
                result = await contact()
        except BrokerUnreachable as exc:
            left = deadline - clock()
            if left <= 0:
                raise
            if not failed:
                logger.warning("Kafka %s not reachable (%s); retrying for up to %g s (SERVEWATCH_BROKER_WAIT_S)",
                               settings.kafka.bootstrap, exc.reason, settings.kafka.broker_wait_s)  # fmt: skip
            failed += 1
            await sleep(min(pause, left))
            pause = min(pause * 2, BROKER_RETRY_MAX_S)
            continue
        if failed:
            logger.info("connected to Kafka %s after %d failed attempt(s)", settings.kafka.bootstrap, failed)
        return result


def _refused(exc: BaseException) -> bool:
    from aiokafka.errors import AuthenticationFailedError, SaslAuthenticationFailed

    return isinstance(exc, AuthenticationFailedError | SaslAuthenticationFailed)


def describe_kafka_error(
    exc: BaseException,
    settings: Settings,
    refusals: list[str] | None = None,
    failures: list[BaseException | str] | None = None,
) -> str | None:
    """What a command says of a Kafka client's failure: the broker, the cause and what to
    check; None for an error that is not about reaching or logging in to the broker.
    ``refusals`` and ``failures``: what aiokafka logged of the attempts (the exception it
    raises after a failed bootstrap says only "Unable to bootstrap")."""
    described = _describe(exc, settings, refusals, failures)
    return None if described is None else described.line


class _Described(NamedTuple):
    line: str
    #: The cause, when the broker was not reached at all (None: it answered, and refused).
    unreachable: str | None = None


def _describe(
    exc: BaseException,
    settings: Settings,
    refusals: list[str] | None = None,
    failures: list[BaseException | str] | None = None,
) -> _Described | None:
    from aiokafka.errors import KafkaConnectionError, UnsupportedSaslMechanismError

    where = f"Kafka {settings.kafka.bootstrap}"
    how: str = settings.kafka.security_protocol
    if settings.kafka.security_protocol.startswith("SASL_"):
        how += f" {settings.kafka.sasl_mechanism} as {settings.kafka.sasl_username!r}"
    if _refused(exc) or refusals:
        reason = (refusals[-1] if refusals else str(exc)).split(": ", 1)[-1]  # without "[Error 58] SaslAuth..."
        return _Described(f"authentication failed at {where} ({how}): {reason}; check SERVEWATCH_SASL_USERNAME, "
                          "SERVEWATCH_SASL_PASSWORD and SERVEWATCH_SASL_MECHANISM")  # fmt: skip
    cause: BaseException | str = (failures or [exc])[-1]
    if isinstance(cause, UnsupportedSaslMechanismError) or isinstance(exc, UnsupportedSaslMechanismError):
        return _Described(f"{where} does not accept SASL mechanism {settings.kafka.sasl_mechanism}: set "
                          "SERVEWATCH_SASL_MECHANISM to one its listener enables")  # fmt: skip
    if isinstance(cause, ssl.SSLError):
        parts = (getattr(cause, "reason", None), getattr(cause, "verify_message", None))  # set by OpenSSL only
        detail = ": ".join(str(part) for part in parts if part)
        return _Described(f"TLS with {where} failed ({how}): {detail or cause}; check SERVEWATCH_SSL_CAFILE (the "
                          "CA that signed the broker's certificate) and SERVEWATCH_SECURITY_PROTOCOL")  # fmt: skip
    if isinstance(cause, KafkaConnectionError) and "closed" in str(cause):
        # A listener that speaks another protocol (TLS, SASL) closes a connection it cannot read;
        # so does whatever else answers at a wrong address.
        return _Described(f"{where} closed the connection ({how}): check that the address is a Kafka listener's "
                          "and that SERVEWATCH_SECURITY_PROTOCOL and the SASL and TLS settings are what it "
                          "expects")  # fmt: skip
    if isinstance(cause, OSError | TimeoutError) or isinstance(exc, KafkaConnectionError):
        reason = str(cause) or type(cause).__name__
        if isinstance(cause, KafkaConnectionError) and cause is exc:
            reason = "no answer"  # aiokafka's own text names the address tuples again
        return _Described(f"cannot reach {where} ({reason}); check that the broker is up and the address is "
                          "right (--broker or SERVEWATCH_BROKER)", unreachable=reason)  # fmt: skip
    return None


# One flag vocabulary for every command (README's "Flags" table; tests/test_cli_safety.py
# checks that each command's flags are on it): --in and --out are files ('-': stdin, stdout),
# --format is always the output's form, --broker and --embedded always the Kafka to use.


#: What a command's ``add_*_parser`` adds its parser to: ``servewatch``'s subcommands.
Subcommands = argparse._SubParsersAction  # of argparse.ArgumentParser


def add_broker_flags(parser: argparse.ArgumentParser) -> None:
    """``--broker`` and ``--embedded``, for a command that must not run without a real Kafka."""
    parser.add_argument("--broker", metavar="HOST:PORT", help="Kafka bootstrap servers (default: SERVEWATCH_BROKER)")
    parser.add_argument("--embedded", action="store_true", help="without a broker, start a throwaway in-memory one "
                        "(development only: what it holds is gone when the command ends)")  # fmt: skip


def add_out_flag(parser: argparse.ArgumentParser, what: str, *, default: str | None = "-") -> None:
    where = "standard output" if default == "-" else "Kafka"
    parser.add_argument("--out", metavar="PATH", default=default, help=f"write {what} here ('-': standard output; "
                        f"default: {where})")  # fmt: skip


@contextlib.contextmanager
def output(path: str, mode: str = "wb") -> Iterator[IO[Any]]:
    """``--out``'s stream: the file at ``path``, closed afterwards, or standard output for '-'
    (left open: the command's summary may follow on stderr, or other output on stdout)."""
    if path == "-":
        yield sys.stdout.buffer if "b" in mode else sys.stdout
        return
    with open(path, mode, newline=None if "b" in mode else "") as stream:  # csv wants newline=""
        yield stream


class Progress:
    """A command's running progress line: rewritten in place on a terminal, silent when
    stderr is piped or redirected (a log file wants the summary, not a line per second);
    ``SERVEWATCH_PROGRESS`` (``auto``, ``always``, ``never``) overrides."""

    def __init__(self, stream: TextIO | None = None, mode: str | None = None) -> None:
        self.stream = stream or sys.stderr
        mode = mode or os.environ.get("SERVEWATCH_PROGRESS", "auto")
        self.live = mode == "always" or (mode == "auto" and self.stream.isatty())
        self.shown = False

    def show(self, text: str) -> None:
        if self.live:
            print(f"\r{text}", end="", file=self.stream, flush=True)
            self.shown = True

    def done(self) -> None:
        """End the progress line (before the summary)."""
        if self.shown:
            print(file=self.stream)
            self.shown = False


async def ensure_topics_of(settings: Settings) -> Settings:
    """Create servewatch's topics that are missing on the settings' broker; the settings with
    the replication they have (what the worker's tables' changelogs are created with too)."""
    from servewatch.pipeline.kafka import KafkaAuth, ensure_topics

    assert settings.kafka.bootstrap is not None
    replication = await ensure_topics(
        settings.kafka.bootstrap, settings.kafka.topic_partitions, auth=KafkaAuth.from_settings(settings),
        replication=settings.kafka.topic_replication,
    )  # fmt: skip
    return settings.updated(topic_replication=replication)


def serve_metrics(settings: Settings, command: Command) -> None:
    """Serve ``command``'s own Prometheus series (``metrics_server``) on its port."""
    from servewatch.pipeline.cli.metrics_server import DEFAULT_PORTS, command_modules, registry_for, serve

    port = DEFAULT_PORTS[command] if settings.process.metrics_port is None else settings.process.metrics_port
    if not port:
        return
    log = logging.getLogger("servewatch")
    registry = registry_for(command_modules(command, delivers=bool(settings.delivery.notify_config)))
    try:
        serve(registry, settings.process.metrics_host, port)
    except OSError as exc:
        # A second process on one host, or another program: running on without the metrics a
        # dashboard and its staleness alerts read would hide the process from them.
        raise CommandError(
            f"metrics port {settings.process.metrics_host}:{port} is taken ({exc.strerror}): set "
            "SERVEWATCH_METRICS_PORT to a free port, or to 0 to serve no metrics",
            "notify" if command == "notifier" else command,
        ) from None
    log.info("serving %s metrics on %s:%d/metrics", command, settings.process.metrics_host, port)


def read_request_logs(path: str, command: str) -> Iterator[RequestLog]:
    """Valid records of a JSONL file; rejected lines are counted on stderr, not fatal."""
    rejected, first = 0, ""
    try:
        with sys.stdin if path == "-" else open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    yield RequestLog.model_validate_json(line)
                except ValidationError as exc:
                    rejected += 1
                    first = first or f"line {number}: {exc.errors()[0]['msg']}"
    except OSError as exc:
        raise CommandError(str(exc), command) from None
    if rejected:
        print(f"servewatch {command}: {path}: {rejected:,} lines rejected (first: {first})", file=sys.stderr)


def parse_time(value: str, command: str, flag: str = "--at") -> float:
    """A time flag: unix seconds or ISO-8601 (``Z`` or an offset; a time without a zone is UTC)."""
    try:
        return float(value)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise CommandError(f"{flag} {value!r}: give unix seconds or an ISO-8601 time (2026-12-02T22:00Z)",
                           command) from None  # fmt: skip
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()


def login_name() -> str:
    """Who runs the command, for a record's author ("" where the system cannot say)."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no USER variable and no passwd entry (some containers)
        return ""
