"""Every servewatch command on an Apache Kafka node that enforces SASL/SCRAM over TLS, connecting
with the documented settings only (``SERVEWATCH_SECURITY_PROTOCOL=SASL_SSL`` and the rest); a
wrong password, or settings that do not fit the listener, are one line on stderr for every
command that opens a Kafka client, and clients without TLS and SCRAM are refused."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import orjson
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError

from servewatch.models.detect.events import incident_event
from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.models.detect.lifecycle import Transition
from servewatch.pipeline import topics
from servewatch.pipeline.dev.apache_kafka import ApacheKafka
from servewatch.pipeline.dev.broker import free_loopback_port
from servewatch.pipeline.dev.children import start_announcing, stop
from servewatch.pipeline.dev.demo import start_worker, stop_worker
from servewatch.pipeline.dev.kafka_security import KafkaSecurity, generate_security
from servewatch.pipeline.kafka import KafkaAuth, ensure_topics, producer, read_topic
from servewatch.pipeline.worker.metrics import served_value
from servewatch.schemas.anomaly import Hint, Severity, Signal
from tests.engine_sim import ExpositionHandler
from tests.test_cli_errors import KAFKA_COMMANDS
from tests.test_exposition import vllm_v1

pytestmark = [pytest.mark.apache_kafka, pytest.mark.timeout(900)]


class Secured:
    """The module's node and how to reach it."""

    def __init__(self, kafka: ApacheKafka, security: KafkaSecurity) -> None:
        self.kafka, self.security = kafka, security
        self.bootstrap = kafka.bootstrap
        self.auth: KafkaAuth = security.auth()

    def env(self, password: str | None = None) -> dict[str, str]:
        """The documented settings, and no metrics port of its own (tests run side by side)."""
        return {**self.security.env(self.bootstrap, password), "SERVEWATCH_METRICS_PORT": "0",
                "SERVEWATCH_PROGRESS": "never"}  # fmt: skip

    def run(
        self,
        *args: str,
        password: str | None = None,
        overrides: dict[str, str | None] | None = None,
        timeout_s: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """``servewatch <args>`` as a child with the documented settings in its environment
        (``overrides`` on top; None removes a variable)."""
        env: dict[str, str | None] = {**os.environ, **self.env(password), **(overrides or {})}
        return subprocess.run(
            [sys.executable, "-m", "servewatch", *args], env={k: v for k, v in env.items() if v is not None},
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s, check=False,
        )  # fmt: skip


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    security = generate_security(tmp_path_factory.mktemp("kafka-tls"))
    with ApacheKafka(security=security, startup_timeout_s=120.0) as kafka:
        node = Secured(kafka, security)
        asyncio.run(ensure_topics(node.bootstrap, 4, auth=node.auth))
        yield node


def _records(tag: str, count: int) -> list[dict[str, object]]:
    now = time.time()
    return [
        {"request_id": f"{tag}-{n}", "timestamp": now - 1.0 + n / count, "model": "m1", "route": "chat",
         "prompt_tokens": 600 + n, "completion_tokens": 40 + n, "e2e_s": 1.4, "ttft_s": 0.25, "finish_reason": "stop"}
        for n in range(count)
    ]  # fmt: skip


async def _collect(node: Secured, topic: str, wanted: bytes, count: int, timeout_s: float = 60.0) -> list[bytes]:
    """The first ``count`` messages of ``topic`` containing ``wanted``, read over SASL_SSL."""

    async def scan() -> list[bytes]:
        found: list[bytes] = []
        async for value in read_topic(node.bootstrap, topic, auth=node.auth):
            if wanted in value:
                found.append(value)
                if len(found) >= count:
                    break
        return found

    return await asyncio.wait_for(scan(), timeout_s)


def _request_ids(values: list[bytes], tag: str) -> set[str]:
    ids: set[str] = set()
    for value in values:
        parsed = orjson.loads(value)
        for record in parsed if isinstance(parsed, list) else [parsed]:
            if str(record.get("request_id", "")).startswith(f"{tag}-"):
                ids.add(record["request_id"])
    return ids


def test_ship_delivers_a_file_over_sasl_ssl(secured: Secured, tmp_path: Path) -> None:
    tag = f"ship{uuid.uuid4().hex[:6]}"
    path = tmp_path / "requests.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in _records(tag, 40)))
    done = secured.run("ship", "--in", str(path), "--no-follow", "--state", str(tmp_path / "state"), "--batch", "10")
    assert done.returncode == 0, done.stderr
    assert "sent 40" in done.stderr and "pending 0" in done.stderr, done.stderr
    values = asyncio.run(_collect(secured, topics.REQUESTS, tag.encode(), 4))
    assert _request_ids(values, tag) == {f"{tag}-{n}" for n in range(40)}


class _Engine(ExpositionHandler):
    def text(self) -> str:
        return vllm_v1([0.05] * 10, prompt=10_000.0, hits=5_000.0, queries=10_000.0, stops=10)


def test_scrape_publishes_intervals_over_sasl_ssl(secured: Secured) -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
        done = secured.run("scrape", "--target", url, "--interval", "100ms", "--count", "3")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert done.returncode == 0, done.stderr
    instance = f"127.0.0.1:{httpd.server_address[1]}".encode()
    values = asyncio.run(_collect(secured, topics.SCRAPES, instance, 2))
    assert {orjson.loads(v)["engine"] for v in values} == {"vllm"}


def test_worker_consumes_over_sasl_ssl(secured: Secured) -> None:
    port = free_loopback_port()
    env = {**secured.env(), "SERVEWATCH_METRICS_PORT": str(port), "SERVEWATCH_APP_ID": f"sec-{uuid.uuid4().hex[:6]}"}
    worker = start_worker(secured.kafka.bootstrap, env)
    try:
        deadline = time.monotonic() + 120
        while served_value(port, "servewatch_live_segments") != 0 or served_value(port, "servewatch_messages_total"):
            assert worker.poll() is None, f"the worker exited ({worker.returncode})"
            assert time.monotonic() < deadline, "the worker did not come up"
            time.sleep(0.5)
        before = served_value(port, "servewatch_records_total")

        async def produce() -> None:
            prod = producer(secured.kafka.bootstrap, auth=secured.auth)
            await prod.start()
            try:
                for partition in range(4):
                    batch = _records(f"worker{partition}", 50)
                    await prod.send_and_wait(topics.REQUESTS, orjson.dumps(batch), partition=partition)
            finally:
                await prod.stop()

        asyncio.run(produce())
        deadline = time.monotonic() + 120
        while served_value(port, "servewatch_records_total") < before + 200:
            assert worker.poll() is None, f"the worker exited ({worker.returncode})"
            assert time.monotonic() < deadline, "the worker read nothing over SASL_SSL"
            time.sleep(0.5)
    finally:
        stop_worker(worker)
    assert worker.returncode == 0


def _publish_incident(secured: Secured, model: str) -> None:
    event = incident_event(
        key=f"model={model}", signal=Signal.TTFT, incident_start=time.time() - 60, transition=Transition.FIRING,
        labels={"model": model, "route": "chat"}, window=(time.time() - 60, time.time() - 50), observed=2.0,
        expected=0.5, score=9.0, severity=Severity.CRITICAL, summary=f"ttft of {model} is up.",
        hints=[Hint(code="prefix_cache_ineffective", message="check enable_prefix_caching")],
    )  # fmt: skip
    _, groups = IncidentGrouper().add(event)

    async def publish() -> None:
        prod = producer(secured.kafka.bootstrap, auth=secured.auth)
        await prod.start()
        try:
            for record in [event, *groups]:
                await prod.send_and_wait(topics.ANOMALIES, record.model_dump_json().encode())
        finally:
            await prod.stop()

    asyncio.run(publish())


def test_tail_reads_anomalies_over_sasl_ssl(secured: Secured) -> None:
    model = f"tail-{uuid.uuid4().hex[:6]}"
    _publish_incident(secured, model)
    done = secured.run("tail", "--from-beginning", "--model", model, "--count", "2", "--format", "json")
    assert done.returncode == 0, done.stderr
    # unkeyed, on any of 4 partitions: in either order
    assert sorted(orjson.loads(line).get("kind") for line in done.stdout.splitlines()) == ["group", "incident"]


def test_web_shows_incidents_read_over_sasl_ssl(secured: Secured) -> None:
    model = f"web-{uuid.uuid4().hex[:6]}"
    _publish_incident(secured, model)
    web, url = start_announcing(["servewatch", "web", "--port", "0"], "triage page: ", secured.env())
    try:
        deadline, models = time.monotonic() + 60, set[str]()
        while model not in models:
            assert time.monotonic() < deadline, f"the page never showed {model}: {models}"
            time.sleep(0.5)
            groups = httpx.get(f"{url}api/groups", timeout=5).json()["groups"]
            models = {group.get("model") for group in groups}
    finally:
        stop(web)


@pytest.mark.parametrize("command", list(KAFKA_COMMANDS))
def test_a_wrong_password_is_one_line_naming_the_broker(secured: Secured, command: str, tmp_path: Path) -> None:
    (tmp_path / "requests.jsonl").write_bytes(orjson.dumps(_records("wrong", 1)[0]) + b"\n")
    (tmp_path / "notify.yaml").write_text("sinks:\n  - {name: hook, type: webhook, url: 'http://127.0.0.1:9/x'}\n")
    args = [arg.format(tmp=tmp_path) for arg in KAFKA_COMMANDS[command]]
    done = secured.run(*args, password="not-the-password", timeout_s=90)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith(f"servewatch {command.split()[0]}: authentication failed at Kafka "), errors[0]
    assert secured.kafka.bootstrap in errors[0] and "SERVEWATCH_SASL_PASSWORD" in errors[0], errors[0]
    assert done.returncode == 2, (done.returncode, done.stderr)


#: Settings that do not fit the node's listener (SASL_SSL, SCRAM-SHA-512, the fixture's CA),
#: and what the one line then says to check; None removes the variable.
_NO_SASL: dict[str, str | None] = {"SERVEWATCH_SASL_USERNAME": None, "SERVEWATCH_SASL_PASSWORD": None}
MISFITS: dict[str, tuple[dict[str, str | None], str]] = {
    "another mechanism": ({"SERVEWATCH_SASL_MECHANISM": "SCRAM-SHA-256"}, "does not accept SASL mechanism"),
    "the system's CAs": ({"SERVEWATCH_SSL_CAFILE": None}, "SERVEWATCH_SSL_CAFILE"),
    "SASL without TLS": ({"SERVEWATCH_SECURITY_PROTOCOL": "SASL_PLAINTEXT"}, "SERVEWATCH_SECURITY_PROTOCOL"),
    "TLS without SASL": ({"SERVEWATCH_SECURITY_PROTOCOL": "SSL", **_NO_SASL}, "SERVEWATCH_SECURITY_PROTOCOL"),
    "plain text": ({"SERVEWATCH_SECURITY_PROTOCOL": "PLAINTEXT", **_NO_SASL}, "SERVEWATCH_SECURITY_PROTOCOL"),
}


@pytest.mark.parametrize("misfit", list(MISFITS))
def test_settings_that_do_not_fit_the_listener_are_one_line_saying_what_to_check(secured: Secured, misfit: str) -> None:
    overrides, check = MISFITS[misfit]
    done = secured.run("tail", "--count", "1", overrides=overrides, timeout_s=90)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("servewatch tail: ") and secured.kafka.bootstrap in errors[0], errors[0]
    assert check in errors[0], errors[0]
    assert done.returncode == 2, (done.returncode, done.stderr)


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL"])
def test_clients_without_tls_and_scram_are_refused(secured: Secured, protocol: str) -> None:
    auth = KafkaAuth(protocol, cafile=str(secured.security.cafile))

    async def connect() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=secured.kafka.bootstrap, request_timeout_ms=5000,
                                    **auth.client_options())  # fmt: skip
        try:
            await admin.start()
            await admin.list_topics()
        finally:
            await admin.close()

    with pytest.raises(KafkaConnectionError):
        asyncio.run(asyncio.wait_for(connect(), 30))
