"""Each long-running command serves only its own series, on its own port, on the loopback."""

from __future__ import annotations

import urllib.request

from prometheus_client import generate_latest

from servewatch.pipeline.cli.metrics_server import DEFAULT_PORTS, Command, command_modules, registry_for, serve
from servewatch.pipeline.settings import Settings


def names(command: Command, delivers: bool = False) -> str:
    return generate_latest(registry_for(command_modules(command, delivers))).decode()


def test_the_notifier_exports_none_of_the_workers_series() -> None:
    """A notifier that exported the worker's "last message" gauge at 0 set off staleness alerts."""
    from servewatch.pipeline.worker import metrics  # imported: its series exist in this process

    metrics.RECORDS.inc()
    notifier = names("notifier")
    assert "servewatch_notify_queued" in notifier and "python_gc" in notifier  # and the process's own
    assert "servewatch_last_message_timestamp_seconds" not in notifier and "servewatch_records" not in notifier


def test_the_worker_exports_its_series_and_the_notifiers_only_when_it_delivers() -> None:
    assert "servewatch_records_total" in names("worker") and "servewatch_segment_score" in names("worker")
    assert "servewatch_notifications" not in names("worker")
    assert "servewatch_notifications" in names("worker", delivers=True)


def test_commands_have_their_own_ports_and_listen_on_the_loopback_by_default() -> None:
    assert len(set(DEFAULT_PORTS.values())) == len(DEFAULT_PORTS)
    settings = Settings()
    assert settings.process.metrics_port is None and settings.process.metrics_host == "127.0.0.1"
    port = serve(registry_for(command_modules("notifier")), settings.process.metrics_host, 0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        assert b"servewatch_notify_queued" in page.read()


def test_a_taken_metrics_port_stops_the_command_with_one_line() -> None:
    import socket

    import pytest

    from servewatch.pipeline.cli.common import CommandError, serve_metrics

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CommandError) as stopped:
            serve_metrics(Settings(metrics_port=port), "notifier")
    line = stopped.value.line()
    assert line.startswith(f"servewatch notify: metrics port 127.0.0.1:{port} is taken") and "\n" not in line
    assert "SERVEWATCH_METRICS_PORT" in line
    serve_metrics(Settings(metrics_port=0), "worker")  # 0: no metrics, nothing to take
