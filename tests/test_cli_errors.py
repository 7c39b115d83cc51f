"""Every command that opens a Kafka client fails in one line when the broker cannot be
reached: the address, the cause and what to check on stderr, exit 2, no traceback. (The
same for a refused password or a wrong TLS or SASL setting: tests/test_kafka_security_apache.py,
on an Apache Kafka node that enforces them.) A long-running command first waits for a broker
it cannot reach, for ``SERVEWATCH_BROKER_WAIT_S``, and says so in one line."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaError, SaslAuthenticationFailed, TopicAuthorizationFailedError

from servewatch.pipeline.cli.common import BrokerUnreachable, CommandError, reach_broker
from servewatch.pipeline.cli.main import main
from servewatch.pipeline.dev.broker import EmbeddedBroker, free_loopback_port
from servewatch.pipeline.dev.demo import stop_worker
from servewatch.pipeline.settings import Settings

#: Nothing listens on port 1 of the loopback interface: a connection is refused at once.
NOWHERE = "127.0.0.1:1"

#: Each command's arguments that get it as far as its first Kafka client.
KAFKA_COMMANDS = {
    "tail": ["tail", "--count", "1"],
    "web": ["web", "--port", "0"],
    "mark": ["mark", "--model", "m1", "--desc", "enable prefix caching"],
    "changes": ["changes"],
    "silence add": ["silence", "add", "model=m1"],
    "silence list": ["silence", "list"],
    "silence expire": ["silence", "expire", "abc"],
    "ship": ["ship", "--in", "{tmp}/requests.jsonl", "--no-follow", "--state", "{tmp}/state"],
    "scrape": ["scrape", "--target", "http://127.0.0.1:9/metrics", "--count", "1"],
    "worker": ["worker"],
    "notify": ["notify", "--config", "{tmp}/notify.yaml"],
    "demo": ["demo"],
}

#: The commands a service manager keeps running: they wait for a broker not up yet
#: (``SERVEWATCH_BROKER_WAIT_S``); the others fail at once.
LONG_RUNNING = ("worker", "notify", "scrape", "web")


def child_env(tmp_path: Path, **settings: str) -> dict[str, str]:
    """The environment of a ``servewatch`` child: none of the environment's settings (its
    broker), no metrics port, no progress line; ``settings`` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVEWATCH_")}
    env.update(XDG_STATE_HOME=str(tmp_path), SERVEWATCH_METRICS_PORT="0", SERVEWATCH_PROGRESS="never", **settings)
    return env


def run_cli(
    args: list[str], tmp_path: Path, timeout_s: float = 120.0, settings: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``servewatch <args>`` as a child, without a broker of the environment's (``settings``
    on top); ``timeout_s`` only bounds a hang."""
    return subprocess.run(
        [sys.executable, "-m", "servewatch", *args], env=child_env(tmp_path, **(settings or {})),
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip


def write_inputs(tmp_path: Path) -> None:
    """The files the commands of ``KAFKA_COMMANDS`` read."""
    (tmp_path / "requests.jsonl").write_text(
        '{"request_id": "r1", "timestamp": 1767225600.5, "model": "m1", "prompt_tokens": 100, '
        '"completion_tokens": 20, "e2e_s": 1.5, "finish_reason": "stop"}\n'
    )
    (tmp_path / "notify.yaml").write_text("sinks:\n  - {name: hook, type: webhook, url: 'http://127.0.0.1:9/x'}\n")


@pytest.mark.parametrize("command", list(KAFKA_COMMANDS))
def test_a_broker_not_there_is_one_line_naming_it(command: str, tmp_path: Path) -> None:
    write_inputs(tmp_path)
    args = [arg.format(tmp=tmp_path) for arg in KAFKA_COMMANDS[command]]
    name = command.split()[0]
    # The long-running commands told not to wait; the others with the default wait, which
    # they must not take: one line at once.
    wait = {"SERVEWATCH_BROKER_WAIT_S": "0"} if name in LONG_RUNNING else {}
    done = run_cli([*args, "--broker", NOWHERE], tmp_path, settings=wait)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith(f"servewatch {name}: cannot reach Kafka {NOWHERE} ("), errors[0]
    assert "check that the broker is up and the address is right" in errors[0], errors[0]
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stdout == ""  # nothing printed as if it had worked (a marker's id, a silence's)


def test_a_name_that_does_not_resolve_is_one_line_too(tmp_path: Path) -> None:
    done = run_cli(["tail", "--broker", "kafka.invalid:9092"], tmp_path)
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert errors[0].startswith("servewatch tail: cannot reach Kafka kafka.invalid:9092 ("), errors[0]


# One command in the default set (they share ``reach_broker``; each run waits its 3 s), all
# of them in the marked set.
@pytest.mark.parametrize(
    "command", [c if c == "worker" else pytest.param(c, marks=pytest.mark.integration) for c in LONG_RUNNING]
)
def test_a_long_running_command_waits_for_the_broker_then_fails_in_at_most_three_lines(
    command: str, tmp_path: Path
) -> None:
    """Started before its broker (a service manager's order), it says once that it waits; given
    up, it fails as a command that does not wait does: nothing per attempt, no traceback."""
    write_inputs(tmp_path)
    args = [arg.format(tmp=tmp_path) for arg in KAFKA_COMMANDS[command]]
    done = run_cli([*args, "--broker", NOWHERE], tmp_path, settings={"SERVEWATCH_BROKER_WAIT_S": "3"})
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) <= 3, done.stderr
    assert "Traceback" not in done.stderr and "Unable connect" not in done.stderr, done.stderr
    waiting = [line for line in lines if "retrying for up to 3 s (SERVEWATCH_BROKER_WAIT_S)" in line]
    assert len(waiting) == 1 and f"Kafka {NOWHERE} not reachable (" in waiting[0], done.stderr
    assert lines[-1].startswith(f"servewatch {command}: cannot reach Kafka {NOWHERE} ("), done.stderr
    assert done.stdout == ""


def wait_for_line(path: Path, text: str, process: subprocess.Popen[bytes], timeout_s: float = 90.0) -> str:
    """The first line of ``path`` (a child's stderr) that holds ``text``; ``timeout_s`` only
    bounds a hang, and a child that ended fails at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [line for line in path.read_text(errors="replace").splitlines() if text in line]
        if found:
            return found[0]
        assert process.poll() is None, f"exited {process.returncode}:\n{path.read_text(errors='replace')[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in its stderr:\n{path.read_text(errors='replace')[-3000:]}")


@pytest.mark.integration
def test_a_worker_started_before_its_broker_connects_once_it_is_up(tmp_path: Path) -> None:
    """The broker comes up on the worker's address only after the worker said it waits: the
    worker gets past its first contact (its topics made) and keeps running."""
    port = free_loopback_port()
    stderr = tmp_path / "worker.log"
    env = child_env(
        tmp_path, SERVEWATCH_BROKER=f"127.0.0.1:{port}", SERVEWATCH_BROKER_PROFILE="tansu",
        SERVEWATCH_BROKER_WAIT_S="120", SERVEWATCH_LOG_LEVEL="INFO",
        SERVEWATCH_APP_ID=f"servewatch-test-{uuid.uuid4().hex[:8]}",
    )  # fmt: skip
    with stderr.open("wb") as err:  # a file: a child's chatty log never blocks on a pipe
        worker = subprocess.Popen(
            [sys.executable, "-m", "servewatch", "worker"], env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        wait_for_line(stderr, "retrying for up to 120 s", worker)
        with EmbeddedBroker(port=port):
            connected = wait_for_line(stderr, f"connected to Kafka 127.0.0.1:{port} after", worker)
            assert worker.poll() is None
            stop_worker(worker)
    finally:
        stop_worker(worker)
    log = stderr.read_text(errors="replace")
    assert log.count("not reachable") == 1 and "Unable connect" not in log, log[-3000:]
    assert "failed attempt(s)" in connected and "cannot reach" not in log, log[-3000:]


class FakeTime:
    """A clock that moves only when slept on; the pauses asked for."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.pauses: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


class FirstContact:
    """A first contact that fails ``failures`` times as aiokafka's does (a record of the
    attempt on its logger, then "Unable to bootstrap"), with ``cause`` as the attempt's error,
    then connects."""

    def __init__(self, failures: int, cause: BaseException | None = None) -> None:
        self.failures = failures
        self.cause = cause or ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 1)")
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls > self.failures:
            return "connected"
        if isinstance(self.cause, KafkaError) and not isinstance(self.cause, SaslAuthenticationFailed):
            raise self.cause  # an error of a client that connected
        logging.getLogger("aiokafka").error('Unable connect to "%s:%s": %s', "127.0.0.1", 1, self.cause)
        raise KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 1, <AddressFamily.AF_INET: 2>)]")


def waited(settings: Settings, contact: FirstContact, fake: FakeTime) -> object:
    return asyncio.run(reach_broker(settings, "worker", contact, sleep=fake.sleep, clock=fake.clock))


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


@pytest.mark.parametrize(
    ("cause", "reason"),
    [
        (ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 1)"),
         "[Errno 111] Connect call failed ('127.0.0.1', 1)"),
        (socket.gaierror(-2, "Name or service not known"), "[Errno -2] Name or service not known"),
        (TimeoutError(), "TimeoutError"),  # no answer within the connection timeout
    ],
)  # fmt: skip
def test_reach_broker_backs_off_doubling_up_to_15_s_and_says_so_once(
    cause: BaseException, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    fake, contact = FakeTime(), FirstContact(failures=6, cause=cause)
    assert waited(Settings(broker=NOWHERE, broker_wait_s=60), contact, fake) == "connected"
    assert fake.pauses == [1, 2, 4, 8, 15, 15] and contact.calls == 7
    assert records(caplog, logging.WARNING) == [
        f"Kafka {NOWHERE} not reachable ({reason}); retrying for up to 60 s (SERVEWATCH_BROKER_WAIT_S)"
    ]
    assert records(caplog, logging.INFO) == [f"connected to Kafka {NOWHERE} after 6 failed attempt(s)"]
    assert not [r for r in caplog.records if r.name.startswith("aiokafka")]  # held back, every attempt


@pytest.mark.parametrize(("wait_s", "pauses", "warnings"), [(20, [1, 2, 4, 8, 5], 1), (0, [], 0)])
def test_reach_broker_gives_up_with_the_one_line_at_the_deadline(
    wait_s: float, pauses: list[float], warnings: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    fake, contact = FakeTime(), FirstContact(failures=1000)
    with pytest.raises(BrokerUnreachable) as raised:
        waited(Settings(broker=NOWHERE, broker_wait_s=wait_s), contact, fake)
    assert fake.pauses == pauses and contact.calls == len(pauses) + 1  # the last pause ends at the deadline
    assert raised.value.line().startswith(f"servewatch worker: cannot reach Kafka {NOWHERE} ([Errno 111] ")
    assert len(records(caplog, logging.WARNING)) == warnings and not records(caplog, logging.INFO)
    assert not [r for r in caplog.records if r.name.startswith("aiokafka")]


def tls_refused() -> ssl.SSLError:
    """As OpenSSL raises it (made by hand, it has no ``reason``)."""
    error = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    error.reason, error.verify_message = "CERTIFICATE_VERIFY_FAILED", "self-signed certificate"
    return error


@pytest.mark.parametrize(
    ("cause", "line"),
    [
        (SaslAuthenticationFailed("[Error 58] SaslAuthenticationFailed: bad password"), "authentication failed at"),
        (tls_refused(), "TLS with Kafka"),
        (KafkaConnectionError("Connection at 127.0.0.1:1 closed"), "closed the connection"),
    ],
)
def test_reach_broker_does_not_wait_for_a_broker_that_refuses(
    cause: BaseException, line: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A broker that answers and refuses refuses again: the one line at once, no warning."""
    fake, contact = FakeTime(), FirstContact(failures=1, cause=cause)
    with pytest.raises(CommandError) as raised:
        waited(Settings(broker=NOWHERE, broker_wait_s=60), contact, fake)
    assert not isinstance(raised.value, BrokerUnreachable) and line in raised.value.line()
    assert contact.calls == 1 and fake.pauses == [] and not records(caplog, logging.WARNING)


def test_reach_broker_does_not_wait_on_another_kafka_error() -> None:
    fake, contact = FakeTime(), FirstContact(failures=1, cause=TopicAuthorizationFailedError("servewatch.requests"))
    with pytest.raises(TopicAuthorizationFailedError):
        waited(Settings(broker=NOWHERE, broker_wait_s=60), contact, fake)
    assert contact.calls == 1 and fake.pauses == []


def test_a_kafka_error_no_command_describes_is_still_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client's failure past its start (here: the broker's ACLs) reaches ``main``: one line
    with its class and the broker, not a traceback."""
    from aiokafka.errors import TopicAuthorizationFailedError

    from servewatch.pipeline.cli import tail

    def refused(args: object) -> int:
        raise TopicAuthorizationFailedError("servewatch.anomalies")

    monkeypatch.setattr(tail, "cmd_tail", refused)
    monkeypatch.delenv("SERVEWATCH_BROKER", raising=False)
    assert main(["tail", "--broker", "kafka-0:9092"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1, errors
    assert errors[0].startswith("servewatch tail: Kafka kafka-0:9092: TopicAuthorizationFailedError"), errors[0]


@pytest.mark.parametrize(
    "args",
    [
        ["tail", "--signal", "ttfb"],
        ["tail", "--severity", "loud"],
        ["worker", "--nope"],
        [],
        ["no-such-command"],
        ["changes", "--config", "x.yaml"],
    ],
)
def test_a_command_line_that_does_not_parse_is_one_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """What is wrong and where to look, not the usage block above it (``-h`` prints that)."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(errors) == 1, errors
    assert errors[0].startswith("servewatch") and "error:" in errors[0] and errors[0].endswith(" -h)"), errors[0]
    if args and args[0] in ("tail", "worker", "changes"):
        assert errors[0].startswith(f"servewatch {args[0]}: error:"), errors[0]  # the command it is about


@pytest.mark.parametrize("args", [["-v", "worker"], ["worker", "-v"], ["silence", "add", "model=m", "--verbose"]])
def test_verbose_is_taken_before_or_after_the_command(args: list[str]) -> None:
    from servewatch.pipeline.cli.main import build_parser

    assert build_parser().parse_args(args).verbose is True
    assert build_parser().parse_args([a for a in args if a not in ("-v", "--verbose")]).verbose is False


def test_every_duration_flag_reads_the_same_forms() -> None:
    """``ship --linger 1h30m`` as ``silence add --duration 1h30m`` and a notifier's timings."""
    from servewatch.pipeline.durations import parse_duration

    assert [parse_duration(t) for t in ("1h30m", "250ms", "10s", "2.5", "7d")] == [5400.0, 0.25, 10.0, 2.5, 604800.0]
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")


#: Each command that reads a file, given one that is missing ({missing}) or malformed ({bad}):
#: (arguments, settings, what the one line must name).
FILE_PROBLEMS = {
    "replay --in missing": (["replay", "--in", "{missing}"], {}, "No such file"),
    "replay --scrapes missing": (["replay", "--scrapes", "{missing}"], {}, "No such file"),
    "replay --out in a missing folder": (
        ["replay", "--in", "{requests}", "--out", "{missing}/x.jsonl"],
        {},
        "No such file",
    ),
    "generate --out in a missing folder": (["generate", "--out", "{missing}/x.jsonl"], {}, "No such file"),
    "backtest-series --in missing": (["backtest-series", "--in", "{missing}"], {}, "No such file"),
    "backtest-series --in not a series": (["backtest-series", "--in", "{bad}"], {}, "time column"),
    "profile --in missing": (["profile", "--in", "{missing}"], {}, "No such file"),
    "compare --in missing": (["compare", "--in", "{missing}", "--at", "1767225600"], {}, "No such file"),
    "check-config missing": (["check-config", "{missing}"], {}, "cannot read"),
    "check-config malformed": (["check-config", "{bad}"], {}, "not valid YAML at line 2"),
    "notify --config malformed": (["notify", "--config", "{bad}"], {}, "not valid YAML at line 2"),
    "ship --in missing": (["ship", "--in", "{missing}", "--no-follow"], {}, "no such file"),
    "worker, notify config missing": (["worker"], {"SERVEWATCH_NOTIFY_CONFIG": "{missing}"}, "cannot read"),
    "worker, notify config malformed": (["worker"], {"SERVEWATCH_NOTIFY_CONFIG": "{bad}"}, "not valid YAML at line 2"),
    "worker, changes config malformed": (
        ["worker"],
        {"SERVEWATCH_CHANGES_CONFIG": "{bad}"},
        "not valid YAML at line 2",
    ),
    "a setting that does not parse": (["replay", "--in", "{requests}"], {"SERVEWATCH_WINDOW_S": "ten"}, "WINDOW_S"),
}


@pytest.mark.parametrize("case", list(FILE_PROBLEMS))
def test_a_missing_file_or_a_malformed_config_is_at_most_three_lines_and_exit_2(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before any broker is tried (the worker reads its files first): the file and what is
    wrong with it, no traceback."""
    write_inputs(tmp_path)
    (tmp_path / "bad.yaml").write_text("sinks: [\n  - {name: x\n")
    names = {"missing": str(tmp_path / "nope" / "missing.yaml"), "bad": str(tmp_path / "bad.yaml"),
             "requests": str(tmp_path / "requests.jsonl")}  # fmt: skip
    args, settings, named = FILE_PROBLEMS[case]
    for key in [key for key in os.environ if key.startswith("SERVEWATCH_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SERVEWATCH_BROKER", NOWHERE)
    monkeypatch.setenv("SERVEWATCH_BROKER_WAIT_S", "0")
    monkeypatch.setenv("SERVEWATCH_METRICS_PORT", "0")
    for key, value in settings.items():
        monkeypatch.setenv(key, value.format(**names))
    code = main([arg.format(**names) for arg in args])
    errors = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and 1 <= len(errors) <= 3, errors
    assert named in errors[0] and "Traceback" not in "".join(errors) and "Kafka" not in errors[0], errors
