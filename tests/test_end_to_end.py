"""End to end: ``servewatch scrape`` + ``servewatch ship`` + ``servewatch worker`` on the embedded broker.

A simulated vLLM server on 127.0.0.1 serves its ``/metrics``; its prefix caching is
switched off part way, at flat traffic. The scraper publishes its intervals, the shipper
a JSONL file of the same story's request logs, each as its own process, exactly as users
run them. The worker pages the engine's hit rate from the scrapes and the TTFT of the
request logs, whose hint names the instance whose metrics say caching is off.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import orjson
import pytest

from servewatch.pipeline import topics
from servewatch.pipeline.dev.simulator import EPOCH, Phase, Workload
from servewatch.schemas.anomaly import AnomalyEvent, Signal
from servewatch.schemas.incident_group import parse_anomaly_record
from tests.conftest import first_matching, own_broker
from tests.engine_sim import ExpositionHandler, SimulatedVllm

pytestmark = pytest.mark.integration

#: A broker of its own: these tests read whole topics from the beginning.
broker = own_broker

#: Scrapes with prefix caching on, then off, at the same traffic.
SCRAPES_ON, SCRAPES_OFF = 45, 12


class Engine(ExpositionHandler):
    """Each scrape sees 100 more requests served; caching goes off after ``SCRAPES_ON``."""

    sim = SimulatedVllm()
    scrapes = 0
    lock = threading.Lock()

    def text(self) -> str:
        with self.lock:
            cls = type(self)
            cls.sim.caching = cls.scrapes < SCRAPES_ON
            cls.sim.step()
            cls.scrapes += 1
            return cls.sim.text()


@pytest.fixture
def engine() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def servewatch(*args: str, broker: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a CLI command as its own process against ``broker``."""
    env_args = {"SERVEWATCH_BROKER": broker, "SERVEWATCH_LOG_LEVEL": "WARNING"}
    return subprocess.run(
        [sys.executable, "-m", "servewatch", *args],
        env={**os.environ, **env_args},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=True,
    )


def test_scraper_shipper_and_worker_page_a_prefix_cache_switched_off_at_flat_traffic(
    worker: str, engine: str, tmp_path: Path
) -> None:
    instance = engine.removeprefix("http://").removesuffix("/metrics")
    scraped = servewatch("scrape", "--target", engine, "--interval", "100ms", "--count", str(SCRAPES_ON + SCRAPES_OFF),
                         broker=worker)  # fmt: skip
    assert f"{engine}: up, {SCRAPES_ON + SCRAPES_OFF} scrapes" in scraped.stderr  # the summary (no progress when piped)

    # The request logs of the same story, on event times of their own (other tests share the topic).
    start = EPOCH + 3 * 86_400
    workload = Workload((Phase("normal", 240), Phase("cache_off", 150, prefix_caching=False)), seed=31,
                        models=("llama-3.1-70b",), start=start)  # fmt: skip
    logs = tmp_path / f"requests-{uuid.uuid4().hex[:6]}.jsonl"
    logs.write_bytes(b"".join(orjson.dumps(record) + b"\n" for record in workload.records()))
    shipped = servewatch("ship", "--in", str(logs), "--no-follow", "--state", str(tmp_path / "position.json"),
                         broker=worker)  # fmt: skip
    records = sum(1 for _ in logs.open("rb"))
    assert f"ship: read {records:,}, sent {records:,}, rejected 0" in shipped.stderr, shipped.stderr

    def engine_page(raw: bytes) -> AnomalyEvent | None:
        event = parse_anomaly_record(raw)
        if not isinstance(event, AnomalyEvent):
            return None  # an incident group's record
        mine = event.segment.get("instance") == instance and event.signal is Signal.CACHE_HIT_RATE and event.pages
        return event if mine else None

    hit = asyncio.run(first_matching(worker, topics.ANOMALIES, engine_page, timeout_s=60))
    assert hit.hints[0].code == "prefix_cache_disabled"

    def ttft_page(raw: bytes) -> AnomalyEvent | None:
        event = parse_anomaly_record(raw)
        if not isinstance(event, AnomalyEvent):
            return None  # an incident group's record
        mine = event.window_start >= start + 240 and event.signal is Signal.TTFT and event.pages
        return event if mine and "instance" not in event.segment else None

    ttft = asyncio.run(first_matching(worker, topics.ANOMALIES, ttft_page, timeout_s=90))
    assert ttft.segment["model"] == "llama-3.1-70b" and ttft.hints[0].code == "prefix_cache_ineffective"
    assert f"enable_prefix_caching=False on {instance}" in ttft.hints[0].message
    assert {r["sample"] for r in ttft.evidence} >= {"slowest", "uniform", "baseline"}
