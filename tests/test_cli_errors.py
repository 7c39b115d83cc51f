"""Every command that opens a Kafka client fails in one line when the broker cannot be
reached: the address, the cause and what to check on stderr, exit 2, no traceback. (The
same for a refused password or a wrong TLS or SASL setting: tests/test_kafka_security_apache.py,
on an Apache Kafka node that enforces them.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from servewatch.pipeline.cli.main import main

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


def run_cli(args: list[str], tmp_path: Path, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``servewatch <args>`` as a child, without a broker of the environment's; ``timeout_s``
    only bounds a hang."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVEWATCH_")}
    env.update(XDG_STATE_HOME=str(tmp_path), SERVEWATCH_METRICS_PORT="0", SERVEWATCH_PROGRESS="never")
    return subprocess.run(
        [sys.executable, "-m", "servewatch", *args], env=env, stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=timeout_s, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("command", list(KAFKA_COMMANDS))
def test_a_broker_not_there_is_one_line_naming_it(command: str, tmp_path: Path) -> None:
    (tmp_path / "requests.jsonl").write_text(
        '{"request_id": "r1", "timestamp": 1767225600.5, "model": "m1", "prompt_tokens": 100, '
        '"completion_tokens": 20, "e2e_s": 1.5, "finish_reason": "stop"}\n'
    )
    (tmp_path / "notify.yaml").write_text("sinks:\n  - {name: hook, type: webhook, url: 'http://127.0.0.1:9/x'}\n")
    args = [arg.format(tmp=tmp_path) for arg in KAFKA_COMMANDS[command]]
    done = run_cli([*args, "--broker", NOWHERE], tmp_path)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, done.stderr
    name = command.split()[0]
    assert errors[0].startswith(f"servewatch {name}: cannot reach Kafka {NOWHERE} ("), errors[0]
    assert "check that the broker is up and the address is right" in errors[0], errors[0]
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stdout == ""  # nothing printed as if it had worked (a marker's id, a silence's)


def test_a_name_that_does_not_resolve_is_one_line_too(tmp_path: Path) -> None:
    done = run_cli(["tail", "--broker", "kafka.invalid:9092"], tmp_path)
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert errors[0].startswith("servewatch tail: cannot reach Kafka kafka.invalid:9092 ("), errors[0]


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
    [["tail", "--signal", "ttfb"], ["tail", "--severity", "loud"], ["worker", "--nope"], [], ["no-such-command"]],
)
def test_a_command_line_that_does_not_parse_is_one_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """What is wrong and where to look, not the usage block above it (``-h`` prints that)."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(errors) == 1, errors
    assert errors[0].startswith("servewatch") and "error:" in errors[0] and errors[0].endswith(" -h)"), errors[0]


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
